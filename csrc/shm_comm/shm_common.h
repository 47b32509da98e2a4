// Helpers shared by the shared-memory collectives (shm_comm.cpp) and the
// point-to-point channels (shm_channel.cpp): error messages, the clock, and
// the liveness test behind [Note: shm crash safety].
#pragma once

#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

namespace dsrun_shm {

inline void set_err(char* err, int errlen, const char* fmt, ...) __attribute__((format(printf, 3, 4)));
inline void set_err(char* err, int errlen, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  if (err && errlen > 0) vsnprintf(err, errlen, fmt, ap);
  va_end(ap);
}

// Seconds on the monotonic clock.
inline double now_s() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

// True unless the process is gone or a zombie (dead, not yet reaped).
inline bool alive(int pid) {
  if (pid <= 0) return true;  // not attached yet: cannot tell
  if (kill(pid, 0) != 0 && errno == ESRCH) return false;
  char path[64], buf[256];
  snprintf(path, sizeof path, "/proc/%d/stat", pid);
  FILE* f = fopen(path, "r");
  if (!f) return errno != ENOENT;
  const size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = 0;
  const char* close_paren = strrchr(buf, ')');  // the name may contain spaces
  return !(close_paren && close_paren[1] == ' ' && (close_paren[2] == 'Z' || close_paren[2] == 'X'));
}

}  // namespace dsrun_shm
