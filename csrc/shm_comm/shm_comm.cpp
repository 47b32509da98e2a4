// Shared-memory collectives for the ranks of one node (CPU tensors): one POSIX
// shared-memory segment per group, a slot per rank, and spinning barriers on
// per-rank counters. C interface for ctypes in dsrun/ops/shm_comm.py; no torch
// header (see [Note: build time] in dsrun/ops/builder.py).
//
// Segment layout: [Header, 4 KiB][RankCtl x world][2 buffers x world x slot_bytes]
//
// [Note: shm collective protocol] A collective is cut into steps that fit a
// slot. In each step every rank copies its part into its own slot, then all
// meet at a barrier, then each reads what it needs from the others' slots
// (all_reduce adds a second barrier: each rank reduces 1/world of the step
// into its own slot, the others then copy those reduced pieces). Steps
// alternate between two buffers, so a rank may start writing step s+1 while
// slower ranks still read step s; it cannot get to step s+2 before every rank
// has passed the barrier of step s+1, that is, finished reading step s.
// Each element is reduced by exactly one rank, in rank order, so every rank
// receives bit-identical results.
//
// [Note: shm call check] Every rank must make the same calls with the same
// sizes. Each call writes its descriptor (operation, dtype, element count,
// root, reduce op, call sequence number) into its RankCtl before its first
// barrier; after that barrier every rank compares every rank's descriptor
// with rank 0's and, on any difference, fails before reading another rank's
// data, with a message naming rank 0's call and the first differing rank's.
// Every rank sees the same descriptors, so every rank fails with the same
// message. Descriptors alternate between two places by call parity, like the
// buffers: a rank cannot write call k+2's descriptor before every rank has
// passed a barrier of call k+1, that is, finished checking call k. A call
// with no data still makes that one barrier, so it is checked too.
//
// [Note: shm crash safety] The segment's name is removed as soon as every rank
// has mapped it (dsrun/ops/shm_comm.py), so the kernel frees it when the last
// process exits, however it exits. A waiting rank checks that the ranks it
// waits for are alive (pid not gone or a zombie) and that no rank has flagged
// an error, so a crash turns into an error on the others instead of a hang.
#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <string>

#include "shm_comm/shm_common.h"

namespace {

using dsrun_shm::alive;
using dsrun_shm::now_s;
using dsrun_shm::set_err;

constexpr uint64_t kMagic = 0x647372756e73686dULL;  // "dsrunshm"
constexpr int64_t kHeaderBytes = 4096;

struct Header {
  std::atomic<uint64_t> magic;
  int32_t world;
  int32_t pad;
  int64_t slot_bytes;
  std::atomic<int32_t> abort_rank;  // -1, or the first rank that failed
};

// One collective call as a rank made it; see [Note: shm call check].
struct Call {
  int32_t op;      // CallOp
  int32_t dtype;   // dtype code of dsrun/ops/shm_comm.py (DTYPE_CODES)
  int64_t count;   // elements (per rank for all_gather)
  int32_t root;    // broadcast source, else -1
  int32_t reduce;  // Op for reductions, else -1
  uint64_t seq;    // 1 for the group's first call, then +1 per call
  int64_t most;    // all_to_all: this rank's largest block sent or received, in bytes (not compared)
};

struct alignas(64) RankCtl {
  std::atomic<uint64_t> seq;  // barriers this rank has reached
  std::atomic<int32_t> pid;
  std::atomic<int32_t> sleepers;  // ranks asleep on seq's futex word (see barrier)
  Call call[2];               // by call parity
};

struct Group {
  char* base = nullptr;
  size_t bytes = 0;
  int rank = 0, world = 0;
  int64_t slot_bytes = 0;
  uint64_t epoch = 0;  // barriers passed by this rank
  uint64_t step = 0;   // steps done, selects the buffer
  uint64_t calls = 0;  // collective calls made by this rank
  double timeout_s = 300;
  Header* hdr() { return reinterpret_cast<Header*>(base); }
  RankCtl* ctl(int r) { return reinterpret_cast<RankCtl*>(base + kHeaderBytes) + r; }
  char* slot(int buffer, int r) {
    const int64_t ctl_bytes = ((static_cast<int64_t>(sizeof(RankCtl)) * world + 4095) / 4096) * 4096;
    return base + kHeaderBytes + ctl_bytes + (static_cast<int64_t>(buffer) * world + r) * slot_bytes;
  }
};

size_t segment_bytes(int world, int64_t slot_bytes) {
  const int64_t ctl_bytes = ((static_cast<int64_t>(sizeof(RankCtl)) * world + 4095) / 4096) * 4096;
  return static_cast<size_t>(kHeaderBytes + ctl_bytes + 2 * world * slot_bytes);
}

// Returns 0, or -1 with a message when a rank died, failed, or time ran out.
// A rank that waits long sleeps on the futex word of the rank it waits for,
// which wakes it when it arrives: [Note: sleeping waits] in shm_channel.cpp.
int barrier(Group& g, char* err, int errlen) {
  const uint64_t target = ++g.epoch;
  RankCtl* mine = g.ctl(g.rank);
  mine->seq.store(target, std::memory_order_seq_cst);
  if (mine->sleepers.load(std::memory_order_seq_cst) > 0)
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&mine->seq), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
  const double start = now_s();
  for (int r = 0; r < g.world; ++r) {
    uint64_t spins = 0;
    double next_check = start + 1e-3;
    RankCtl* other = g.ctl(r);
    while (other->seq.load(std::memory_order_acquire) < target) {
      ++spins;
      if (spins < 2000) {
#if defined(__x86_64__)
        __builtin_ia32_pause();
#endif
        continue;
      }
      // Fewer cores than ranks is common (2 cores here): let the others run,
      // then sleep until rank r arrives (at most 1 ms, for the checks below).
      if (spins < 2064) {
        sched_yield();
        continue;
      }
      const uint64_t seen = other->seq.load(std::memory_order_seq_cst);
      other->sleepers.fetch_add(1, std::memory_order_seq_cst);
      if (other->seq.load(std::memory_order_seq_cst) < target) {
        const timespec most{0, 1000000};
        syscall(SYS_futex, reinterpret_cast<uint32_t*>(&other->seq), FUTEX_WAIT, static_cast<uint32_t>(seen), &most,
                nullptr, 0);
      }
      other->sleepers.fetch_sub(1, std::memory_order_seq_cst);
      // The checks below run at most once a millisecond, by the clock.
      const double t = now_s();
      if (t < next_check) continue;
      next_check = t + 1e-3;
      // Rank r may have arrived, and even exited, while this rank slept or was
      // descheduled: its arrival counts (what it published stays mapped).
      if (other->seq.load(std::memory_order_acquire) >= target) break;
      const int bad = g.hdr()->abort_rank.load();
      if (bad >= 0 && bad != g.rank) {
        set_err(err, errlen, "shm collective aborted: rank %d failed", bad);
        return -1;
      }
      if (!alive(g.ctl(r)->pid.load())) {
        int expected = -1;
        g.hdr()->abort_rank.compare_exchange_strong(expected, r);
        set_err(err, errlen, "shm collective: rank %d (pid %d) exited while rank %d waited for it", r,
                g.ctl(r)->pid.load(), g.rank);
        return -1;
      }
      if (t - start > g.timeout_s) {
        int expected = -1;
        g.hdr()->abort_rank.compare_exchange_strong(expected, g.rank);
        set_err(err, errlen, "shm collective: rank %d timed out after %.0f s waiting for rank %d", g.rank,
                g.timeout_s, r);
        return -1;
      }
    }
  }
  return 0;
}

// ---- the call check (see [Note: shm call check]) --------------------------
enum CallOp { BARRIER = 0, ALL_REDUCE = 1, REDUCE_SCATTER = 2, ALL_GATHER = 3, BROADCAST = 4, ALL_TO_ALL = 5 };

const char* call_name(int op) {
  static const char* names[] = {"barrier", "all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all"};
  return op >= 0 && op <= ALL_TO_ALL ? names[op] : "unknown collective";
}

const char* dtype_name(int dtype) {  // the order of DTYPE_CODES in shm_comm.py
  static const char* names[] = {"float32", "bfloat16", "float16", "float64", "int64", "int32",
                                "int16", "int8", "uint8", "bool", "complex64", "complex128"};
  return dtype >= 0 && dtype < static_cast<int>(sizeof names / sizeof names[0]) ? names[dtype] : "other dtype";
}

void describe(const Call& c, char* out, size_t len) {
  static const char* reduce_names[] = {"sum", "max", "min"};
  char extra[64] = "";
  if (c.reduce >= 0 && c.reduce <= 2) snprintf(extra, sizeof extra, ", op %s", reduce_names[c.reduce]);
  if (c.root >= 0) snprintf(extra, sizeof extra, ", root %d", c.root);
  if (c.op == BARRIER) {
    snprintf(out, len, "barrier (call #%llu)", static_cast<unsigned long long>(c.seq));
    return;
  }
  if (c.op == ALL_TO_ALL && c.count < 0) {
    snprintf(out, len, "all_to_all(%s, uneven blocks) (call #%llu)", dtype_name(c.dtype),
             static_cast<unsigned long long>(c.seq));
    return;
  }
  snprintf(out, len, "%s(%lld %s elements%s%s) (call #%llu)", call_name(c.op), static_cast<long long>(c.count),
           dtype_name(c.dtype), c.op == ALL_GATHER ? " per rank" : c.op == ALL_TO_ALL ? " per block" : "", extra,
           static_cast<unsigned long long>(c.seq));
}

bool same(const Call& a, const Call& b) {
  return a.op == b.op && a.dtype == b.dtype && a.count == b.count && a.root == b.root && a.reduce == b.reduce &&
         a.seq == b.seq;
}

// The first barrier of a call: publish this rank's descriptor, meet, compare.
int checked_barrier(Group& g, Call c, char* err, int errlen) {
  c.seq = ++g.calls;
  const int parity = static_cast<int>(c.seq % 2);
  g.ctl(g.rank)->call[parity] = c;  // published by the barrier's release store
  if (barrier(g, err, errlen)) return -1;
  const Call first = g.ctl(0)->call[parity];
  for (int r = 1; r < g.world; ++r) {
    const Call other = g.ctl(r)->call[parity];
    if (!same(first, other)) {
      char a[160], b[160];
      describe(first, a, sizeof a);
      describe(other, b, sizeof b);
      set_err(err, errlen,
              "ranks disagree: rank 0 called %s, rank %d called %s; every rank must make the same "
              "collective calls in the same order with the same dtype, size and root",
              a, r, b);
      return -1;
    }
  }
  return 0;
}

// ---- element types and reductions --------------------------------------
enum Dtype { F32 = 0, BF16 = 1, F16 = 2 };
enum Op { SUM = 0, MAX = 1, MIN = 2 };

inline float bf16_load(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
inline uint16_t bf16_store(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

template <typename T> inline float load(T x);
template <> inline float load<float>(float x) { return x; }
template <> inline float load<uint16_t>(uint16_t x) { return bf16_load(x); }
template <> inline float load<_Float16>(_Float16 x) { return static_cast<float>(x); }
template <typename T> inline T store(float x);
template <> inline float store<float>(float x) { return x; }
template <> inline uint16_t store<uint16_t>(float x) { return bf16_store(x); }
template <> inline _Float16 store<_Float16>(float x) { return static_cast<_Float16>(x); }

template <int O> inline float combine(float a, float b) {
  if (O == SUM) return a + b;
  if (O == MAX) return a > b || a != a ? a : b;  // nan propagates, as torch
  return a < b || a != a ? a : b;
}

// out[i] (and out2[i] unless null) = op over r of src[r][i], accumulated in
// fp32 in rank order. out may alias a source: each tile is read before it is
// written. The clones give an AVX2/F16C build picked at load time (ifunc) and
// a baseline one.
template <typename T, int O>
__attribute__((target_clones("arch=haswell", "default")))
void reduce(T* out, T* out2, T* const* src, int nsrc, int64_t n) {
  constexpr int64_t kTile = 1024;  // keeps the fp32 accumulator in L1
  float acc[kTile];
  for (int64_t b = 0; b < n; b += kTile) {
    const int64_t m = n - b < kTile ? n - b : kTile;
    const T* s0 = src[0] + b;
    for (int64_t i = 0; i < m; ++i) acc[i] = load<T>(s0[i]);
    for (int r = 1; r < nsrc; ++r) {
      const T* s = src[r] + b;
      for (int64_t i = 0; i < m; ++i) acc[i] = combine<O>(acc[i], load<T>(s[i]));
    }
    T* o = out + b;
    for (int64_t i = 0; i < m; ++i) o[i] = store<T>(acc[i]);
    if (out2 != nullptr) memcpy(out2 + b, o, m * sizeof(T));  // from L1, no second reduction
  }
}

template <typename T>
int reduce_op(int op, T* out, T* out2, T* const* src, int nsrc, int64_t n) {
  switch (op) {
    case SUM: reduce<T, SUM>(out, out2, src, nsrc, n); return 0;
    case MAX: reduce<T, MAX>(out, out2, src, nsrc, n); return 0;
    case MIN: reduce<T, MIN>(out, out2, src, nsrc, n); return 0;
    default: return -1;
  }
}

int reduce_any(int dtype, int op, void* out, void* out2, void* const* src, int nsrc, int64_t n) {
  switch (dtype) {
    case F32:
      return reduce_op<float>(op, static_cast<float*>(out), static_cast<float*>(out2),
                              reinterpret_cast<float* const*>(src), nsrc, n);
    case BF16:
      return reduce_op<uint16_t>(op, static_cast<uint16_t*>(out), static_cast<uint16_t*>(out2),
                                 reinterpret_cast<uint16_t* const*>(src), nsrc, n);
    case F16:
      return reduce_op<_Float16>(op, static_cast<_Float16*>(out), static_cast<_Float16*>(out2),
                                 reinterpret_cast<_Float16* const*>(src), nsrc, n);
    default: return -1;
  }
}

int elem_size(int dtype) { return dtype == F32 ? 4 : 2; }

}  // namespace

extern "C" {

// Creates (create=1, one rank) or attaches to the segment `name`. Returns
// nullptr with a message in err on failure.
void* dsrun_shm_open(const char* name, int rank, int world, int64_t slot_bytes, int create, double timeout_s,
                     char* err, int errlen) {
  if (world < 1 || rank < 0 || rank >= world || slot_bytes <= 0 || slot_bytes % 64) {
    set_err(err, errlen, "bad arguments: rank %d, world %d, slot_bytes %lld (a positive multiple of 64)", rank,
            world, static_cast<long long>(slot_bytes));
    return nullptr;
  }
  const size_t bytes = segment_bytes(world, slot_bytes);
  int fd;
  if (create) {
    shm_unlink(name);  // a segment left by a crash before its name was removed
    fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
    if (fd >= 0 && ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
      const int e = errno;
      close(fd);
      shm_unlink(name);
      set_err(err, errlen, "ftruncate shm %s to %zu bytes: %s", name, bytes, strerror(e));
      return nullptr;
    }
  } else {
    fd = shm_open(name, O_RDWR | O_CLOEXEC, 0600);
  }
  if (fd < 0) {
    set_err(err, errlen, "shm_open %s: %s", name, strerror(errno));
    return nullptr;
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != bytes) {
    close(fd);
    set_err(err, errlen, "shm %s has %lld bytes, expected %zu (world size or slot size differ between ranks?)",
            name, static_cast<long long>(st.st_size), bytes);
    return nullptr;
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    set_err(err, errlen, "mmap shm %s (%zu bytes): %s", name, bytes, strerror(errno));
    return nullptr;
  }
  auto* g = new Group;
  g->base = static_cast<char*>(p);
  g->bytes = bytes;
  g->rank = rank;
  g->world = world;
  g->slot_bytes = slot_bytes;
  g->timeout_s = timeout_s;
  if (create) {
    g->hdr()->world = world;
    g->hdr()->slot_bytes = slot_bytes;
    g->hdr()->abort_rank.store(-1);
    for (int r = 0; r < world; ++r) {
      g->ctl(r)->seq.store(0);
      g->ctl(r)->pid.store(0);
      g->ctl(r)->sleepers.store(0);
    }
    g->hdr()->magic.store(kMagic, std::memory_order_release);
  } else if (g->hdr()->magic.load(std::memory_order_acquire) != kMagic || g->hdr()->world != world) {
    munmap(p, bytes);
    delete g;
    set_err(err, errlen, "shm %s is not initialised for world size %d", name, world);
    return nullptr;
  }
  g->ctl(rank)->pid.store(getpid());
  return g;
}

void dsrun_shm_close(void* h) {
  auto* g = static_cast<Group*>(h);
  munmap(g->base, g->bytes);
  delete g;
}

int dsrun_shm_unlink(const char* name) { return shm_unlink(name) == 0 ? 0 : -errno; }

int dsrun_shm_barrier(void* h, char* err, int errlen) {
  return checked_barrier(*static_cast<Group*>(h), Call{BARRIER, -1, 0, -1, -1, 0, 0}, err, errlen);
}

// data [n] in place. Returns 0 or -1 with a message.
// [Note: shm traffic] A rank never stages what only it reads: its own piece
// stays in its private memory and is reduced (or copied) from there, and the
// reduced piece is written to the caller's tensor and the slot in one pass.
// For 2 ranks this moves 4 bytes per byte of tensor instead of 5.5.
int dsrun_shm_all_reduce(void* h, void* data, int64_t n, int dtype, int op, char* err, int errlen) {
  Group& g = *static_cast<Group*>(h);
  const int es = elem_size(dtype);
  const int64_t chunk = g.slot_bytes / es;
  char* d = static_cast<char*>(data);
  void* src[1024];
  if (g.world > 1024) {
    set_err(err, errlen, "world size %d above 1024", g.world);
    return -1;
  }
  const Call call{ALL_REDUCE, dtype, n, -1, op, 0, 0};
  if (n == 0) return checked_barrier(g, call, err, errlen);
  for (int64_t off = 0; off < n; off += chunk) {
    const int64_t c = n - off < chunk ? n - off : chunk;
    const int b = static_cast<int>(g.step++ % 2);
    char* mine = g.slot(b, g.rank);
    for (int r = 0; r < g.world; ++r) {  // rank r reduces elements [c*r/w, c*(r+1)/w) of the step
      const int64_t rlo = c * r / g.world, rhi = c * (r + 1) / g.world;
      if (r != g.rank) memcpy(mine + rlo * es, d + (off + rlo) * es, (rhi - rlo) * es);
    }
    if (off == 0 ? checked_barrier(g, call, err, errlen) : barrier(g, err, errlen)) return -1;
    const int64_t lo = c * g.rank / g.world, hi = c * (g.rank + 1) / g.world;
    for (int r = 0; r < g.world; ++r) src[r] = r == g.rank ? d + (off + lo) * es : g.slot(b, r) + lo * es;
    if (reduce_any(dtype, op, d + (off + lo) * es, mine + lo * es, src, g.world, hi - lo)) {
      set_err(err, errlen, "bad dtype %d or op %d", dtype, op);
      return -1;
    }
    if (barrier(g, err, errlen)) return -1;
    for (int r = 0; r < g.world; ++r) {
      const int64_t rlo = c * r / g.world, rhi = c * (r + 1) / g.world;
      if (r != g.rank) memcpy(d + (off + rlo) * es, g.slot(b, r) + rlo * es, (rhi - rlo) * es);
    }
  }
  return 0;
}

// in [world * n], out [n]: out = op over ranks of in[rank*n : (rank+1)*n].
int dsrun_shm_reduce_scatter(void* h, void* out, const void* in, int64_t n, int dtype, int op, char* err,
                             int errlen) {
  Group& g = *static_cast<Group*>(h);
  const int es = elem_size(dtype);
  const int64_t chunk = g.slot_bytes / es / g.world;  // a slot holds one chunk of every rank's part
  const char* s = static_cast<const char*>(in);
  void* src[1024];
  if (chunk < 1 || g.world > 1024) {
    set_err(err, errlen, "slot too small for world size %d", g.world);
    return -1;
  }
  const Call call{REDUCE_SCATTER, dtype, n, -1, op, 0, 0};
  if (n == 0) return checked_barrier(g, call, err, errlen);
  for (int64_t off = 0; off < n; off += chunk) {
    const int64_t c = n - off < chunk ? n - off : chunk;
    const int b = static_cast<int>(g.step++ % 2);
    char* mine = g.slot(b, g.rank);
    for (int j = 0; j < g.world; ++j)  // see [Note: shm traffic]
      if (j != g.rank) memcpy(mine + j * c * es, s + (j * n + off) * es, c * es);
    if (off == 0 ? checked_barrier(g, call, err, errlen) : barrier(g, err, errlen)) return -1;
    for (int r = 0; r < g.world; ++r)
      src[r] = r == g.rank ? const_cast<char*>(s) + (g.rank * n + off) * es : g.slot(b, r) + g.rank * c * es;
    if (reduce_any(dtype, op, static_cast<char*>(out) + off * es, nullptr, src, g.world, c)) {
      set_err(err, errlen, "bad dtype %d or op %d", dtype, op);
      return -1;
    }
  }
  return 0;  // no closing barrier needed: see [Note: shm collective protocol]
}

// in [nbytes], out [world * nbytes]: out[r] = rank r's in. dtype and count
// (elements of in) only identify the call (see [Note: shm call check]).
int dsrun_shm_all_gather(void* h, void* out, const void* in, int64_t nbytes, int dtype, int64_t count, char* err,
                         int errlen) {
  Group& g = *static_cast<Group*>(h);
  const int64_t chunk = g.slot_bytes;
  char* o = static_cast<char*>(out);
  const Call call{ALL_GATHER, dtype, count, -1, -1, 0, 0};
  if (nbytes == 0) return checked_barrier(g, call, err, errlen);
  for (int64_t off = 0; off < nbytes; off += chunk) {
    const int64_t c = nbytes - off < chunk ? nbytes - off : chunk;
    const int b = static_cast<int>(g.step++ % 2);
    memcpy(g.slot(b, g.rank), static_cast<const char*>(in) + off, c);
    if (o + g.rank * nbytes != in)  // in may be this rank's piece of out (gather in place)
      memcpy(o + g.rank * nbytes + off, static_cast<const char*>(in) + off, c);
    if (off == 0 ? checked_barrier(g, call, err, errlen) : barrier(g, err, errlen)) return -1;
    for (int r = 0; r < g.world; ++r)
      if (r != g.rank) memcpy(o + r * nbytes + off, g.slot(b, r), c);
  }
  return 0;
}

// data [nbytes] from rank src to all; dtype and count identify the call.
int dsrun_shm_broadcast(void* h, void* data, int64_t nbytes, int src, int dtype, int64_t count, char* err,
                        int errlen) {
  Group& g = *static_cast<Group*>(h);
  const int64_t chunk = g.slot_bytes;
  char* d = static_cast<char*>(data);
  const Call call{BROADCAST, dtype, count, src, -1, 0, 0};
  if (nbytes == 0) return checked_barrier(g, call, err, errlen);
  for (int64_t off = 0; off < nbytes; off += chunk) {
    const int64_t c = nbytes - off < chunk ? nbytes - off : chunk;
    const int b = static_cast<int>(g.step++ % 2);
    if (g.rank == src) memcpy(g.slot(b, src), d + off, c);
    if (off == 0 ? checked_barrier(g, call, err, errlen) : barrier(g, err, errlen)) return -1;
    if (g.rank != src) memcpy(d + off, g.slot(b, src), c);
  }
  return 0;
}

// [Note: shm all-to-all] Each rank's slot is cut into world sub-slots, one
// per destination: a 64-byte header holding the whole block's size, then up
// to `cap` bytes of the block. In step s every rank copies bytes
// [s*cap, (s+1)*cap) of its block for rank j into sub-slot j (its own block
// goes straight from input to output), all meet at a barrier, then each
// copies its piece from sub-slot `rank` of every other rank. Blocks may
// differ in size (all_to_all with split sizes); the number of steps is set
// by the largest block any rank sends or receives, which each rank publishes
// in its call descriptor (Call::most) and every rank reads after the first
// barrier, so all take the same steps. After that barrier each receiver also
// checks the sizes in the headers against what it expects: a disagreement
// fails that rank and flags the group, so the others fail at their next
// barrier on it (at once when the exchange takes more steps).
int dsrun_shm_all_to_all(void* h, void* out, const void* in, const int64_t* send_bytes, const int64_t* send_off,
                         const int64_t* recv_bytes, const int64_t* recv_off, int dtype, int64_t count, char* err,
                         int errlen) {
  Group& g = *static_cast<Group*>(h);
  const int64_t sub = g.slot_bytes / g.world / 64 * 64;
  const int64_t cap = sub - 64;
  if (cap < 64) {
    set_err(err, errlen, "slot of %lld bytes too small for an all_to_all over %d ranks",
            static_cast<long long>(g.slot_bytes), g.world);
    return -1;
  }
  const char* s = static_cast<const char*>(in);
  char* o = static_cast<char*>(out);
  int64_t most = 0;
  for (int j = 0; j < g.world; ++j) {
    if (j == g.rank) continue;
    if (send_bytes[j] > most) most = send_bytes[j];
    if (recv_bytes[j] > most) most = recv_bytes[j];
  }
  Call call{ALL_TO_ALL, dtype, count, -1, -1, 0, most};
  memcpy(o + recv_off[g.rank], s + send_off[g.rank], send_bytes[g.rank]);
  int64_t steps = 1;
  for (int64_t step = 0; step < steps; ++step) {
    const int b = static_cast<int>(g.step++ % 2);
    char* mine = g.slot(b, g.rank);
    const int64_t lo = step * cap;
    for (int j = 0; j < g.world; ++j) {
      if (j == g.rank) continue;
      char* sj = mine + j * sub;
      memcpy(sj, &send_bytes[j], sizeof(int64_t));
      if (send_bytes[j] > lo) memcpy(sj + 64, s + send_off[j] + lo, std::min(cap, send_bytes[j] - lo));
    }
    if (step == 0) {
      if (checked_barrier(g, call, err, errlen)) return -1;
      const int parity = static_cast<int>(g.calls % 2);
      int64_t largest = 0;
      for (int r = 0; r < g.world; ++r) largest = std::max(largest, g.ctl(r)->call[parity].most);
      steps = largest > cap ? (largest + cap - 1) / cap : 1;
      for (int r = 0; r < g.world; ++r) {
        int64_t sent;
        memcpy(&sent, g.slot(b, r) + g.rank * sub, sizeof(int64_t));
        if (r != g.rank && sent != recv_bytes[r]) {
          int expected = -1;
          g.hdr()->abort_rank.compare_exchange_strong(expected, g.rank);
          set_err(err, errlen,
                  "all_to_all: rank %d sends %lld bytes to rank %d, which expects %lld; the split sizes "
                  "must agree (rank i's input split j = rank j's output split i)",
                  r, static_cast<long long>(sent), g.rank, static_cast<long long>(recv_bytes[r]));
          return -1;
        }
      }
    } else if (barrier(g, err, errlen)) {
      return -1;
    }
    for (int r = 0; r < g.world; ++r)
      if (r != g.rank && recv_bytes[r] > lo)
        memcpy(o + recv_off[r] + lo, g.slot(b, r) + g.rank * sub + 64, std::min(cap, recv_bytes[r] - lo));
  }
  return 0;
}

}  // extern "C"
