// io_uring engine (liburing).
#include <errno.h>
#include <liburing.h>
#include <string.h>

#include "aio_engine.h"

namespace dsrun_aio {
namespace {

class UringEngine final : public Engine {
 public:
  explicit UringEngine(io_uring ring) : ring_(ring) {}
  ~UringEngine() override { io_uring_queue_exit(&ring_); }

  int submit(const IoReq* reqs, int n) override {
    int queued = 0;
    for (; queued < n; ++queued) {
      io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
      if (sqe == nullptr) break;  // ring full: submit what we have
      const IoReq& r = reqs[queued];
      if (r.write)
        io_uring_prep_write(sqe, r.fd, r.buf, static_cast<unsigned>(r.len), r.off);
      else
        io_uring_prep_read(sqe, r.fd, r.buf, static_cast<unsigned>(r.len), r.off);
      sqe->user_data = static_cast<uint64_t>(r.tag);
    }
    int ret;
    do ret = io_uring_submit(&ring_); while (ret == -EINTR);
    return ret < 0 ? ret : queued;
  }

  int reap(IoDone* out, int max, int min_wait) override {
    int n = 0;
    while (n < max) {
      io_uring_cqe* cqe = nullptr;
      const int ret = n < min_wait ? io_uring_wait_cqe(&ring_, &cqe) : io_uring_peek_cqe(&ring_, &cqe);
      if (ret == -EAGAIN) break;  // nothing more ready and min_wait reached
      if (ret == -EINTR) continue;
      if (ret < 0) return ret;
      out[n].tag = static_cast<int>(cqe->user_data);
      out[n].res = cqe->res;
      ++n;
      io_uring_cqe_seen(&ring_, cqe);
    }
    return n;
  }

 private:
  io_uring ring_;
};

}  // namespace

std::unique_ptr<Engine> make_uring_engine(int depth, std::string* err) {
  io_uring ring;
  const int ret = io_uring_queue_init(static_cast<unsigned>(depth), &ring, 0);
  if (ret < 0) {
    *err = std::string("io_uring_queue_init: ") + strerror(-ret);
    return nullptr;
  }
  return std::unique_ptr<Engine>(new UringEngine(ring));
}

}  // namespace dsrun_aio
