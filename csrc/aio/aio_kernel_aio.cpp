// Linux native AIO engine (the interface libaio wraps), the second engine
// where io_uring is refused (a seccomp policy, kernel.io_uring_disabled, a
// kernel older than 5.6). Built on the kernel's own <linux/aio_abi.h> and
// raw system calls, so it needs no libaio-dev either. Reference: the
// io_setup(2), io_submit(2), io_getevents(2) and io_destroy(2) man pages.
#include <errno.h>
#include <linux/aio_abi.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <vector>

#include "aio_engine.h"

namespace dsrun_aio {
namespace {

// Raw system calls: return the result, or -errno (as the kernel does).
long sys_ret(long r) { return r < 0 ? -errno : r; }

class KernelAioEngine final : public Engine {
 public:
  KernelAioEngine(aio_context_t ctx, int depth) : ctx_(ctx), cbs_(depth), events_(depth) {}
  ~KernelAioEngine() override { syscall(__NR_io_destroy, ctx_); }

  int submit(const IoReq* reqs, int n) override {
    std::vector<iocb*> ptrs(n);
    for (int i = 0; i < n; ++i) {
      const IoReq& r = reqs[i];
      iocb* cb = &cbs_[r.tag];  // one control block per slot: it lives until completion
      memset(cb, 0, sizeof *cb);
      cb->aio_lio_opcode = r.write ? IOCB_CMD_PWRITE : IOCB_CMD_PREAD;
      cb->aio_fildes = static_cast<__u32>(r.fd);
      cb->aio_buf = reinterpret_cast<__u64>(r.buf);
      cb->aio_nbytes = r.len;
      cb->aio_offset = r.off;
      cb->aio_data = static_cast<__u64>(r.tag);
      ptrs[i] = cb;
    }
    int done = 0;
    while (done < n) {  // io_submit may take fewer than asked
      const long ret = sys_ret(syscall(__NR_io_submit, ctx_, static_cast<long>(n - done), ptrs.data() + done));
      if (ret == -EINTR || ret == -EAGAIN) continue;
      if (ret < 0) return done > 0 ? done : static_cast<int>(ret);
      done += static_cast<int>(ret);
    }
    return done;
  }

  int reap(IoDone* out, int max, int min_wait) override {
    if (max > static_cast<int>(events_.size())) max = static_cast<int>(events_.size());
    long ret;
    do {
      ret = sys_ret(syscall(__NR_io_getevents, ctx_, static_cast<long>(min_wait), static_cast<long>(max),
                            events_.data(), nullptr));
    } while (ret == -EINTR);
    if (ret < 0) return static_cast<int>(ret);
    for (long i = 0; i < ret; ++i) {
      out[i].tag = static_cast<int>(events_[i].data);
      out[i].res = events_[i].res;
    }
    return static_cast<int>(ret);
  }

 private:
  aio_context_t ctx_;
  std::vector<iocb> cbs_;
  std::vector<io_event> events_;
};

}  // namespace

std::unique_ptr<Engine> make_kernel_aio_engine(int depth, std::string* err) {
  aio_context_t ctx = 0;  // io_setup requires it zeroed
  const long ret = sys_ret(syscall(__NR_io_setup, static_cast<unsigned>(depth), &ctx));
  if (ret < 0) {
    *err = std::string("io_setup: ") + strerror(static_cast<int>(-ret));
    return nullptr;
  }
  return std::unique_ptr<Engine>(new KernelAioEngine(ctx, depth));
}

}  // namespace dsrun_aio
