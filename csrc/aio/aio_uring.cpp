// io_uring engine on the kernel's own interface: <linux/io_uring.h> (from
// linux-libc-dev, which comes with gcc) and raw system calls. No liburing.
//
// [Note: io_uring rings] io_uring_setup(2) creates a submission queue (SQ)
// and a completion queue (CQ) shared with the kernel through mmap(2): the SQ
// ring (head, tail, mask, and an array of indices into the SQE array), the
// SQE array itself, and the CQ ring (head, tail, mask and the CQEs; the same
// mapping as the SQ ring when the kernel reports IORING_FEAT_SINGLE_MMAP).
// Each side owns one index per ring and only reads the other:
//   SQ: we write the SQEs, then publish them by storing the tail with release
//       order; the kernel consumes them and moves the head, which we load
//       with acquire order to know which SQE slots are free again.
//   CQ: the kernel writes a CQE, then moves the tail (release); we load the
//       tail with acquire order, read the CQEs up to it, then store the head
//       with release order so the kernel may reuse those slots.
// io_uring_enter(2) submits what was published (to_submit) and, with
// IORING_ENTER_GETEVENTS, sleeps until min_complete CQEs are there.
// The rings are used by one thread (one engine per worker thread), so no
// lock is needed on our side. The SQ has `depth` entries and the CQ twice
// that (the kernel's default); the worker never has more than `depth`
// requests in flight, so the CQ cannot overflow.
// Reference: the io_uring(7), io_uring_setup(2) and io_uring_enter(2) man
// pages, and Jens Axboe, "Efficient IO with io_uring" (kernel.dk, 2019).
#include <errno.h>
#include <linux/io_uring.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <vector>

#include "aio_engine.h"

namespace dsrun_aio {
namespace {

// Raw system calls: return the result, or -errno (as the kernel does).
long sys_ret(long r) { return r < 0 ? -errno : r; }

int uring_setup(unsigned entries, io_uring_params* p) {
  return static_cast<int>(sys_ret(syscall(__NR_io_uring_setup, entries, p)));
}

int uring_enter(int fd, unsigned to_submit, unsigned min_complete, unsigned flags) {
  return static_cast<int>(sys_ret(syscall(__NR_io_uring_enter, fd, to_submit, min_complete, flags, nullptr, 0)));
}

int uring_register(int fd, unsigned opcode, void* arg, unsigned nr_args) {
  return static_cast<int>(sys_ret(syscall(__NR_io_uring_register, fd, opcode, arg, nr_args)));
}

unsigned load_acquire(const unsigned* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
unsigned load_relaxed(const unsigned* p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }  // an index we own
void store_release(unsigned* p, unsigned v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

// The three mappings of one ring; unmapped and closed by the destructor.
struct Ring {
  int fd = -1;
  void* sq_map = MAP_FAILED;
  size_t sq_map_len = 0;
  void* cq_map = MAP_FAILED;  // == sq_map with IORING_FEAT_SINGLE_MMAP
  size_t cq_map_len = 0;
  void* sqes_map = MAP_FAILED;
  size_t sqes_map_len = 0;

  ~Ring() {
    if (sqes_map != MAP_FAILED) munmap(sqes_map, sqes_map_len);
    if (cq_map != MAP_FAILED && cq_map != sq_map) munmap(cq_map, cq_map_len);
    if (sq_map != MAP_FAILED) munmap(sq_map, sq_map_len);
    if (fd >= 0) close(fd);
  }
};

template <typename T>
T* at(void* base, __u32 offset) {
  return reinterpret_cast<T*>(static_cast<char*>(base) + offset);
}

class UringEngine final : public Engine {
 public:
  // Takes a ring whose three regions are mapped; see [Note: io_uring rings].
  UringEngine(std::unique_ptr<Ring> ring, const io_uring_params& p) : ring_(std::move(ring)) {
    sq_head_ = at<unsigned>(ring_->sq_map, p.sq_off.head);
    sq_tail_ = at<unsigned>(ring_->sq_map, p.sq_off.tail);
    sq_mask_ = *at<unsigned>(ring_->sq_map, p.sq_off.ring_mask);
    sq_entries_ = *at<unsigned>(ring_->sq_map, p.sq_off.ring_entries);
    sq_array_ = at<unsigned>(ring_->sq_map, p.sq_off.array);
    sqes_ = static_cast<io_uring_sqe*>(ring_->sqes_map);
    cq_head_ = at<unsigned>(ring_->cq_map, p.cq_off.head);
    cq_tail_ = at<unsigned>(ring_->cq_map, p.cq_off.tail);
    cq_mask_ = *at<unsigned>(ring_->cq_map, p.cq_off.ring_mask);
    cqes_ = at<io_uring_cqe>(ring_->cq_map, p.cq_off.cqes);
  }

  int submit(const IoReq* reqs, int n) override {
    const unsigned head = load_acquire(sq_head_);  // SQEs before head were consumed by the kernel
    const unsigned tail0 = load_relaxed(sq_tail_);  // only this thread writes the tail
    const int room = static_cast<int>(sq_entries_ - (tail0 - head));
    const int queued = std::min(n, room);  // ring full: submit what fits
    unsigned tail = tail0;
    for (int i = 0; i < queued; ++i, ++tail) {
      const IoReq& r = reqs[i];
      const unsigned idx = tail & sq_mask_;
      io_uring_sqe* sqe = &sqes_[idx];
      memset(sqe, 0, sizeof *sqe);
      sqe->opcode = r.write ? IORING_OP_WRITE : IORING_OP_READ;
      sqe->fd = r.fd;
      sqe->addr = reinterpret_cast<__u64>(r.buf);
      sqe->len = static_cast<__u32>(r.len);  // block_size <= kMaxBlock (aio_engine.h) fits
      sqe->off = static_cast<__u64>(r.off);
      sqe->user_data = static_cast<__u64>(r.tag);
      sq_array_[idx] = idx;
    }
    store_release(sq_tail_, tail);  // publish the SQEs written above
    unsigned left = static_cast<unsigned>(queued);
    while (left > 0) {
      const int ret = uring_enter(ring_->fd, left, 0, 0);
      if (ret == -EINTR) continue;
      if (ret < 0) {
        // Withdraw what the kernel did not take, so that it is never submitted
        // behind the caller's back (no other thread touches this ring, and
        // the kernel reads the tail only inside io_uring_enter).
        store_release(sq_tail_, load_acquire(sq_head_));
        const int taken = queued - static_cast<int>(left);
        return taken > 0 ? taken : ret;
      }
      left -= static_cast<unsigned>(ret);
    }
    return queued;
  }

  int reap(IoDone* out, int max, int min_wait) override {
    int n = 0;
    while (n < max) {
      unsigned head = load_relaxed(cq_head_);  // only this thread writes the head
      const unsigned tail = load_acquire(cq_tail_);
      for (; head != tail && n < max; ++head, ++n) {
        const io_uring_cqe& cqe = cqes_[head & cq_mask_];
        out[n].tag = static_cast<int>(cqe.user_data);
        out[n].res = cqe.res;
      }
      store_release(cq_head_, head);  // the CQEs read above may be reused
      if (n >= min_wait) break;
      const int ret = uring_enter(ring_->fd, 0, static_cast<unsigned>(min_wait - n), IORING_ENTER_GETEVENTS);
      if (ret < 0 && ret != -EINTR) return ret;
    }
    return n;
  }

 private:
  std::unique_ptr<Ring> ring_;
  unsigned *sq_head_, *sq_tail_, *sq_array_, sq_mask_, sq_entries_;
  io_uring_sqe* sqes_;
  unsigned *cq_head_, *cq_tail_, cq_mask_;
  io_uring_cqe* cqes_;
};

void* map_region(int fd, size_t len, __u64 offset) {
  return mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, static_cast<off_t>(offset));
}

// Whether the kernel supports IORING_OP_READ and IORING_OP_WRITE (Linux 5.6+;
// the probe itself is 5.6+ too, so a kernel without it lacks them as well).
bool has_read_write(int fd, std::string* err) {
  const unsigned nops = 256;
  std::vector<char> buf(sizeof(io_uring_probe) + nops * sizeof(io_uring_probe_op), 0);
  auto* probe = reinterpret_cast<io_uring_probe*>(buf.data());
  const int ret = uring_register(fd, IORING_REGISTER_PROBE, probe, nops);
  if (ret < 0) {
    *err = std::string("io_uring_register(IORING_REGISTER_PROBE): ") + strerror(-ret) + " (kernel older than 5.6?)";
    return false;
  }
  for (unsigned op : {static_cast<unsigned>(IORING_OP_READ), static_cast<unsigned>(IORING_OP_WRITE)}) {
    if (op > probe->last_op || !(probe->ops[op].flags & IO_URING_OP_SUPPORTED)) {
      *err = "io_uring: the kernel lacks IORING_OP_READ/IORING_OP_WRITE (needs Linux 5.6+)";
      return false;
    }
  }
  return true;
}

}  // namespace

std::unique_ptr<Engine> make_uring_engine(int depth, std::string* err) {
  io_uring_params p;
  memset(&p, 0, sizeof p);
  auto ring = std::make_unique<Ring>();
  ring->fd = uring_setup(static_cast<unsigned>(depth), &p);
  if (ring->fd < 0) {
    *err = std::string("io_uring_setup: ") + strerror(-ring->fd);
    return nullptr;
  }
  ring->sq_map_len = p.sq_off.array + p.sq_entries * sizeof(__u32);
  ring->cq_map_len = p.cq_off.cqes + p.cq_entries * sizeof(io_uring_cqe);
  const bool single = (p.features & IORING_FEAT_SINGLE_MMAP) != 0;
  if (single) ring->sq_map_len = ring->cq_map_len = std::max(ring->sq_map_len, ring->cq_map_len);
  ring->sq_map = map_region(ring->fd, ring->sq_map_len, IORING_OFF_SQ_RING);
  if (ring->sq_map != MAP_FAILED)
    ring->cq_map = single ? ring->sq_map : map_region(ring->fd, ring->cq_map_len, IORING_OFF_CQ_RING);
  if (ring->cq_map != MAP_FAILED) {
    ring->sqes_map_len = p.sq_entries * sizeof(io_uring_sqe);
    ring->sqes_map = map_region(ring->fd, ring->sqes_map_len, IORING_OFF_SQES);
  }
  if (ring->sqes_map == MAP_FAILED) {
    *err = std::string("io_uring: mmap of the rings: ") + strerror(errno);
    return nullptr;
  }
  if (!has_read_write(ring->fd, err)) return nullptr;
  return std::unique_ptr<Engine>(new UringEngine(std::move(ring), p));
}

}  // namespace dsrun_aio
