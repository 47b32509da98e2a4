// Linux native AIO engine (libaio), the second engine where io_uring is refused.
#include <errno.h>
#include <libaio.h>
#include <string.h>

#include <vector>

#include "aio_engine.h"

namespace dsrun_aio {
namespace {

class LibaioEngine final : public Engine {
 public:
  LibaioEngine(io_context_t ctx, int depth) : ctx_(ctx), cbs_(depth), events_(depth) {}
  ~LibaioEngine() override { io_destroy(ctx_); }

  int submit(const IoReq* reqs, int n) override {
    std::vector<iocb*> ptrs(n);
    for (int i = 0; i < n; ++i) {
      const IoReq& r = reqs[i];
      iocb* cb = &cbs_[r.tag];  // one control block per slot: it lives until completion
      if (r.write)
        io_prep_pwrite(cb, r.fd, r.buf, r.len, r.off);
      else
        io_prep_pread(cb, r.fd, r.buf, r.len, r.off);
      cb->data = reinterpret_cast<void*>(static_cast<intptr_t>(r.tag));
      ptrs[i] = cb;
    }
    int done = 0;
    while (done < n) {  // io_submit may take fewer than asked
      const int ret = io_submit(ctx_, n - done, ptrs.data() + done);
      if (ret == -EINTR || ret == -EAGAIN) continue;
      if (ret < 0) return done > 0 ? done : ret;
      done += ret;
    }
    return done;
  }

  int reap(IoDone* out, int max, int min_wait) override {
    if (max > static_cast<int>(events_.size())) max = static_cast<int>(events_.size());
    int ret;
    do ret = io_getevents(ctx_, min_wait, max, events_.data(), nullptr); while (ret == -EINTR);
    if (ret < 0) return ret;
    for (int i = 0; i < ret; ++i) {
      out[i].tag = static_cast<int>(reinterpret_cast<intptr_t>(events_[i].data));
      out[i].res = static_cast<int64_t>(static_cast<long>(events_[i].res));
    }
    return ret;
  }

 private:
  io_context_t ctx_;
  std::vector<iocb> cbs_;
  std::vector<io_event> events_;
};

}  // namespace

std::unique_ptr<Engine> make_libaio_engine(int depth, std::string* err) {
  io_context_t ctx = nullptr;
  const int ret = io_setup(depth, &ctx);
  if (ret < 0) {
    *err = std::string("io_setup: ") + strerror(-ret);
    return nullptr;
  }
  return std::unique_ptr<Engine>(new LibaioEngine(ctx, depth));
}

}  // namespace dsrun_aio
