// The asynchronous I/O handle: splits each read/write into blocks, spreads
// them over worker threads (each with its own engine and a pool of
// page-aligned bounce buffers), handles O_DIRECT's alignment rules for any
// size, and reports errors with the file name and errno. C interface for
// ctypes in dsrun/ops/aio.py.
//
// [Note: O_DIRECT and unaligned sizes] O_DIRECT needs the memory address, the
// file offset and the length to be multiples of the logical block size
// (kAlign = 4096 covers every device). A request is cut in three: a head up
// to the first aligned file offset, an aligned middle, and a tail shorter
// than kAlign. The middle goes through the engine with O_DIRECT, straight
// from the caller's memory when it is aligned, else through bounce buffers.
// The head and tail (under 4 KiB each) go through a second, buffered file
// descriptor with pread/pwrite: padding the tail to a full block instead would
// overwrite whatever follows it in the file. Files that refuse O_DIRECT
// (tmpfs) use the buffered descriptor for everything.
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "aio_engine.h"

namespace dsrun_aio {
namespace {

constexpr int64_t kAlign = 4096;

struct Op {
  bool write = false;
  char* user = nullptr;
  int64_t nbytes = 0;
  int64_t file_off = 0;
  int fd_direct = -1;  // O_DIRECT, or -1 when the file system refuses it
  int fd_buffered = -1;
  std::string path;
  int64_t mid_begin = 0;  // byte range of the request that goes through the engine
  int64_t mid_len = 0;
  int64_t block_size = 0;
  std::atomic<int> parts_left{0};
  std::mutex mu;
  int err = 0;
  std::string errmsg;

  int engine_fd() const { return fd_direct >= 0 ? fd_direct : fd_buffered; }

  void fail(int e, const char* what, int64_t at) {
    std::lock_guard<std::mutex> g(mu);
    if (err) return;  // keep the first error
    err = e;
    char buf[512];
    snprintf(buf, sizeof buf, "%s %s: %s (errno %d) at offset %lld", write ? "pwrite" : "pread", path.c_str(),
             what ? what : strerror(e), e, static_cast<long long>(at));
    errmsg = buf;
  }
  bool failed() {
    std::lock_guard<std::mutex> g(mu);
    return err != 0;
  }
  ~Op() {
    if (fd_direct >= 0) close(fd_direct);
    if (fd_buffered >= 0) close(fd_buffered);
  }
};

// Moves [off, off+len) of the request with plain pread/pwrite on the buffered
// descriptor (head, tail, and the rest of a short transfer).
bool sync_io(Op& op, int64_t begin, int64_t len) {
  while (len > 0) {
    char* p = op.user + begin;
    const off_t at = op.file_off + begin;
    const ssize_t r = op.write ? pwrite(op.fd_buffered, p, len, at) : pread(op.fd_buffered, p, len, at);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      op.fail(errno, nullptr, at);
      return false;
    }
    if (r == 0) {  // end of file on a read, or a device that takes nothing
      op.fail(op.write ? EIO : ENODATA, op.write ? "wrote 0 bytes" : "read past end of file", at);
      return false;
    }
    begin += r;
    len -= r;
  }
  return true;
}

struct Part {
  std::shared_ptr<Op> op;
  int64_t first_block, end_block;
};

class Worker {
 public:
  Worker(std::unique_ptr<Engine> engine, int depth, int64_t block_size, bool single_submit, bool overlap,
         std::atomic<int64_t>* direct_bytes)
      : engine_(std::move(engine)), depth_(depth), block_size_(block_size), single_submit_(single_submit),
        overlap_(overlap), direct_bytes_(direct_bytes), bounce_(depth, nullptr), slot_begin_(depth),
        slot_len_(depth), slot_bounced_(depth) {}

  bool alloc_buffers(std::string* err) {
    for (auto& b : bounce_) {
      if (posix_memalign(reinterpret_cast<void**>(&b), kAlign, block_size_) != 0) {
        *err = "cannot allocate aligned bounce buffers";
        return false;
      }
    }
    return true;
  }
  ~Worker() {
    for (char* b : bounce_) free(b);
  }

  // Runs blocks [first, end) of op's middle range with up to depth_ in flight.
  void run(const Part& part) {
    Op& op = *part.op;
    std::vector<int> free_slots;
    for (int s = depth_ - 1; s >= 0; --s) free_slots.push_back(s);
    std::vector<IoReq> batch;
    std::vector<IoDone> done(depth_);
    int64_t next = part.first_block;
    int in_flight = 0;
    bool stop = false;
    while ((next < part.end_block && !stop) || in_flight > 0) {
      // With overlap_events, refill free slots as soon as any completes;
      // without, submit a full batch and wait for all of it.
      if (overlap_ || in_flight == 0) {
        batch.clear();
        while (!stop && next < part.end_block && !free_slots.empty()) {
          const int s = free_slots.back();
          free_slots.pop_back();
          const int64_t b = op.mid_begin + next * block_size_;
          const int64_t len = std::min(block_size_, op.mid_begin + op.mid_len - b);
          char* mem = op.user + b;
          const bool bounce = op.fd_direct >= 0 && reinterpret_cast<uintptr_t>(mem) % kAlign != 0;
          if (bounce) {
            if (op.write) memcpy(bounce_[s], mem, len);
            mem = bounce_[s];
          }
          slot_begin_[s] = b;
          slot_len_[s] = len;
          slot_bounced_[s] = bounce;
          batch.push_back(IoReq{op.engine_fd(), op.write, mem, static_cast<size_t>(len), op.file_off + b, s});
          ++next;
          if (single_submit_) stop = !submit(op, batch, free_slots, in_flight);
        }
        if (!batch.empty()) stop = !submit(op, batch, free_slots, in_flight) || stop;
      }
      if (in_flight == 0) break;
      const int n = engine_->reap(done.data(), depth_, overlap_ ? 1 : in_flight);
      if (n < 0) {  // the engine itself failed: nothing more will complete
        op.fail(-n, nullptr, op.file_off + op.mid_begin);
        return;
      }
      for (int i = 0; i < n; ++i) {
        const int s = done[i].tag;
        const int64_t res = done[i].res;
        --in_flight;
        free_slots.push_back(s);
        if (res < 0) {
          op.fail(static_cast<int>(-res), nullptr, op.file_off + slot_begin_[s]);
          stop = true;
          continue;
        }
        if (op.fd_direct >= 0) direct_bytes_->fetch_add(res, std::memory_order_relaxed);
        if (!op.write && slot_bounced_[s]) memcpy(op.user + slot_begin_[s], bounce_[s], res);
        // A short transfer (end of device space, a signal): finish it synchronously.
        if (res < slot_len_[s] && !sync_io(op, slot_begin_[s] + res, slot_len_[s] - res)) stop = true;
      }
      if (op.failed()) stop = true;
    }
  }

 private:
  bool submit(Op& op, std::vector<IoReq>& batch, std::vector<int>& free_slots, int& in_flight) {
    const int n = engine_->submit(batch.data(), static_cast<int>(batch.size()));
    if (n < 0) {
      op.fail(-n, nullptr, batch[0].off);
      for (const IoReq& r : batch) free_slots.push_back(r.tag);
      batch.clear();
      return false;
    }
    in_flight += n;
    for (size_t i = n; i < batch.size(); ++i) free_slots.push_back(batch[i].tag);
    const bool all = n == static_cast<int>(batch.size());
    if (!all) op.fail(EAGAIN, "the engine accepted only part of a batch", batch[n].off);
    batch.clear();
    return all;
  }

  std::unique_ptr<Engine> engine_;
  int depth_;
  int64_t block_size_;
  bool single_submit_, overlap_;
  std::atomic<int64_t>* direct_bytes_;  // the handle's count of bytes moved with O_DIRECT
  std::vector<char*> bounce_;
  std::vector<int64_t> slot_begin_, slot_len_;
  std::vector<bool> slot_bounced_;
};

class Handle {
 public:
  Handle(int64_t block_size, int threads) : block_size_(block_size), threads_(threads) {}

  bool init(int engine_kind, int depth, bool single_submit, bool overlap, std::string* err) {
    for (int t = 0; t < threads_; ++t) {
      auto engine = engine_kind == 0 ? make_uring_engine(depth, err) : make_kernel_aio_engine(depth, err);
      if (!engine) return false;
      workers_.emplace_back(
          new Worker(std::move(engine), depth, block_size_, single_submit, overlap, &direct_bytes_));
      if (!workers_.back()->alloc_buffers(err)) return false;
    }
    queues_.resize(threads_);
    for (int t = 0; t < threads_; ++t) threads_vec_.emplace_back([this, t] { loop(t); });
    return true;
  }

  ~Handle() {
    {
      std::lock_guard<std::mutex> g(mu_);
      quit_ = true;
    }
    cv_.notify_all();
    for (auto& th : threads_vec_) th.join();
  }

  // Opens the file, checks sizes, does head and tail, queues the middle.
  int submit(bool write, char* buf, int64_t nbytes, const char* path, int64_t offset, std::string* err) {
    auto op = std::make_shared<Op>();
    op->write = write;
    op->user = buf;
    op->nbytes = nbytes;
    op->file_off = offset;
    op->path = path;
    op->block_size = block_size_;
    const int flags = write ? (O_WRONLY | O_CREAT) : O_RDONLY;
    op->fd_buffered = open(path, flags | O_CLOEXEC, 0644);
    if (op->fd_buffered < 0) {
      op->fail(errno, nullptr, offset);
      *err = op->errmsg;
      return -op->err;
    }
    op->fd_direct = open(path, flags | O_CLOEXEC | O_DIRECT, 0644);
    if (op->fd_direct < 0 && errno != EINVAL) {  // EINVAL: no O_DIRECT here (tmpfs)
      op->fail(errno, nullptr, offset);
      *err = op->errmsg;
      return -op->err;
    }
    if (!write) {
      struct stat st;
      if (fstat(op->fd_buffered, &st) != 0) {
        op->fail(errno, nullptr, offset);
      } else if (nbytes > 0 && offset + nbytes > st.st_size) {
        char what[160];
        snprintf(what, sizeof what, "read past end of file (%lld bytes wanted, file has %lld)",
                 static_cast<long long>(nbytes), static_cast<long long>(st.st_size));
        op->fail(ENODATA, what, offset);
      }
      if (op->err) {
        *err = op->errmsg;
        return -op->err;
      }
    }
    // See [Note: O_DIRECT and unaligned sizes].
    int64_t head = 0, tail = 0;
    if (op->fd_direct >= 0) {
      head = std::min<int64_t>(nbytes, (kAlign - offset % kAlign) % kAlign);
      tail = (nbytes - head) % kAlign;
    }
    op->mid_begin = head;
    op->mid_len = nbytes - head - tail;
    if ((head && !sync_io(*op, 0, head)) || (tail && !sync_io(*op, nbytes - tail, tail))) {
      *err = op->errmsg;
      return -op->err;
    }
    const int64_t blocks = (op->mid_len + block_size_ - 1) / block_size_;
    const int parts = static_cast<int>(std::min<int64_t>(threads_, blocks));
    std::lock_guard<std::mutex> g(mu_);
    ops_.push_back(op);
    op->parts_left = parts;
    for (int t = 0; t < parts; ++t)
      queues_[t].push_back(Part{op, blocks * t / parts, blocks * (t + 1) / parts});
    cv_.notify_all();
    return 0;
  }

  // Bytes the engines moved with O_DIRECT since the handle was made.
  int64_t direct_bytes() const { return direct_bytes_.load(std::memory_order_relaxed); }

  // Waits for every submitted op; returns their count or -errno of the first failure.
  int64_t wait(std::string* err) {
    std::unique_lock<std::mutex> g(mu_);
    done_cv_.wait(g, [this] {
      for (auto& op : ops_)
        if (op->parts_left.load() > 0) return false;
      return true;
    });
    int64_t n = static_cast<int64_t>(ops_.size());
    for (auto& op : ops_) {
      if (op->err) {
        *err = op->errmsg;
        n = -op->err;
        break;
      }
    }
    ops_.clear();  // closes the files
    return n;
  }

 private:
  void loop(int t) {
    for (;;) {
      Part part;
      {
        std::unique_lock<std::mutex> g(mu_);
        cv_.wait(g, [&] { return quit_ || !queues_[t].empty(); });
        if (quit_ && queues_[t].empty()) return;
        part = queues_[t].front();
        queues_[t].pop_front();
      }
      workers_[t]->run(part);
      if (part.op->parts_left.fetch_sub(1) == 1) {
        std::lock_guard<std::mutex> g(mu_);
        done_cv_.notify_all();
      }
    }
  }

  int64_t block_size_;
  int threads_;
  std::vector<std::unique_ptr<Worker>> workers_;
  std::vector<std::thread> threads_vec_;
  std::vector<std::deque<Part>> queues_;
  std::vector<std::shared_ptr<Op>> ops_;
  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  bool quit_ = false;
  std::atomic<int64_t> direct_bytes_{0};
};

void copy_err(const std::string& msg, char* err, int errlen) {
  if (err && errlen > 0) snprintf(err, errlen, "%s", msg.c_str());
}

}  // namespace
}  // namespace dsrun_aio

using dsrun_aio::Handle;

// engine: 0 = io_uring, 1 = Linux native AIO ("libaio" in Python). Returns nullptr with a message in err.
extern "C" void* dsrun_aio_create(int engine, int64_t block_size, int queue_depth, int threads, int single_submit,
                                  int overlap_events, char* err, int errlen) {
  if (block_size <= 0 || block_size % dsrun_aio::kAlign != 0 || block_size > dsrun_aio::kMaxBlock ||
      queue_depth <= 0 || threads <= 0) {
    dsrun_aio::copy_err("block_size must be a positive multiple of 4096 up to 1 GiB; queue_depth and threads positive",
                        err, errlen);
    return nullptr;
  }
  std::string msg;
  try {  // no C++ exception may cross into ctypes: it would abort the process
    auto* h = new Handle(block_size, threads);
    if (!h->init(engine, queue_depth, single_submit != 0, overlap_events != 0, &msg)) {
      delete h;
      dsrun_aio::copy_err(msg, err, errlen);
      return nullptr;
    }
    return h;
  } catch (const std::exception& e) {
    dsrun_aio::copy_err(std::string("cannot create the aio handle: ") + e.what(), err, errlen);
    return nullptr;
  }
}

extern "C" void dsrun_aio_destroy(void* h) { delete static_cast<Handle*>(h); }

// Returns 0, or -errno with the message (file, errno, offset) in err.
extern "C" int dsrun_aio_submit(void* h, int write, void* buf, int64_t nbytes, const char* path, int64_t offset,
                                char* err, int errlen) {
  std::string msg;
  int rc;
  try {
    rc = static_cast<Handle*>(h)->submit(write != 0, static_cast<char*>(buf), nbytes, path, offset, &msg);
  } catch (const std::exception& e) {
    msg = std::string(write ? "pwrite " : "pread ") + path + ": " + e.what();
    rc = -ENOMEM;
  }
  if (rc != 0) dsrun_aio::copy_err(msg, err, errlen);
  return rc;
}

// Returns the number of completed requests, or -errno of the first failure.
extern "C" int64_t dsrun_aio_wait(void* h, char* err, int errlen) {
  std::string msg;
  const int64_t rc = static_cast<Handle*>(h)->wait(&msg);
  if (rc < 0) dsrun_aio::copy_err(msg, err, errlen);
  return rc;
}

// Bytes moved with O_DIRECT (page cache bypassed) by the handle's engines so far.
extern "C" int64_t dsrun_aio_direct_bytes(void* h) { return static_cast<Handle*>(h)->direct_bytes(); }
