// Engines that move blocks between memory and files asynchronously: io_uring
// or Linux native AIO, both on the kernel's UAPI headers and raw system calls
// (no liburing or libaio: the op builds with gcc and linux-libc-dev alone).
// No torch header (see [Note: build time] in dsrun/ops/builder.py).
#pragma once
#include <stdint.h>
#include <sys/types.h>

#include <memory>
#include <string>

namespace dsrun_aio {

// Largest block (bytes) one request may carry: io_uring's length field is 32
// bits, and Linux moves at most 2 GiB - 4 KiB per read/write call anyway.
constexpr int64_t kMaxBlock = int64_t{1} << 30;

// One block transfer. `tag` is the caller's slot index, in [0, depth).
struct IoReq {
  int fd;
  bool write;
  char* buf;
  size_t len;
  off_t off;
  int tag;
};

struct IoDone {
  int tag;
  int64_t res;  // bytes moved, or -errno
};

class Engine {
 public:
  virtual ~Engine() = default;
  // Queues and submits n requests; returns how many were submitted or -errno.
  virtual int submit(const IoReq* reqs, int n) = 0;
  // Waits until at least min_wait requests completed, returns up to max of
  // them in out; returns the count or -errno.
  virtual int reap(IoDone* out, int max, int min_wait) = 0;
};

// Each returns nullptr and sets *err when the kernel refuses the engine
// (e.g. io_uring disabled by a seccomp policy).
std::unique_ptr<Engine> make_uring_engine(int depth, std::string* err);
std::unique_ptr<Engine> make_kernel_aio_engine(int depth, std::string* err);

}  // namespace dsrun_aio
