// A caching host allocator for large CPU tensors: freed blocks of one size
// are kept and handed to the next request of that size instead of going back
// to the kernel, so a buffer that a training step frees and allocates again
// (a ZeRO-3 unit's gathered weights, a gradient staging region, a gradient,
// an activation) does not pay a page fault and the kernel's zeroing for every
// 4 KiB page each time. See [Note: caching host allocator] in
// dsrun/runtime/allocator.py for the policy and why.
//
// [Note: huge pages] Blocks of huge_bytes or more are mapped on a 2 MiB
// boundary and marked MADV_HUGEPAGE, so that (where transparent huge pages
// are "madvise" or "always") they are backed by 2 MiB pages: one fault and
// one TLB entry per 2 MiB instead of 512, and physically contiguous memory.
// The last matters for O_DIRECT: a device request holds a bounded number of
// memory segments (254 on a virtio disk), so a write from scattered 4 KiB
// pages is cut into requests of about 1 MiB, while from 2 MiB pages the
// block layer builds requests of up to max_sectors_kb. Measured on the 48M
// GPT's ZeRO-3 checkpoint (2 ranks, 575 MB, virtio disk, saves alternated):
// 660-670 device requests and 0.32-0.40 s per save with 4 KiB pages, 265-290
// requests and 0.27-0.32 s with 2 MiB pages (stage 1: 450-480 -> 180-190
// requests, 0.31-0.34 -> 0.20-0.28 s). Only whole 2 MiB ranges inside a
// block get huge pages, so a block is rounded up to whole 2 MiB pages when
// that costs at most an eighth of it (block_bytes): a 704 x 704 fp32 weight
// (1.98 MB) would otherwise stay on 4 KiB pages. Large tensors are written
// in full, so RSS grows by the rounding alone.
//
// Only c10's allocator interface is included (not torch/extension.h; see
// [Note: build time] in dsrun/ops/builder.py). C interface for ctypes.
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <pthread.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <new>
#include <unordered_map>
#include <vector>

namespace {

constexpr size_t kPage = 4096;
constexpr size_t kHugePage = size_t(2) << 20;

// A fresh anonymous mapping of `bytes` (a multiple of kPage); from
// huge_bytes on (0: never) 2 MiB-aligned and marked MADV_HUGEPAGE (see
// [Note: huge pages]). Returns MAP_FAILED when the kernel refuses.
void* map_block(size_t bytes, size_t huge_bytes) {
  if (huge_bytes == 0 || bytes < huge_bytes) {
    return mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  }
  // Over-map by 2 MiB and unmap the ends, leaving an aligned block.
  const size_t reserve = bytes + kHugePage;
  char* raw =
      static_cast<char*>(mmap(nullptr, reserve, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  if (raw == MAP_FAILED) return MAP_FAILED;
  char* block = raw + (kHugePage - reinterpret_cast<uintptr_t>(raw) % kHugePage) % kHugePage;
  if (block > raw) munmap(raw, block - raw);
  if (raw + reserve > block + bytes) munmap(block + bytes, raw + reserve - (block + bytes));
  madvise(block, bytes, MADV_HUGEPAGE);  // advice: refused (THP off) leaves 4 KiB pages
  return block;
}

class CachingHostAllocator final : public c10::Allocator {
 public:
  // small: serves requests under min_bytes; its raw deleter must exist
  // (torch's default CPU allocator has one). cap_bytes: most bytes cached,
  // on top of the peak rule (0 = the peak rule alone). huge_bytes: blocks
  // from this size on get huge pages (0 = none; see [Note: huge pages]).
  CachingHostAllocator(c10::Allocator* small, size_t min_bytes, size_t cap_bytes, size_t huge_bytes)
      : small_(small), small_delete_(small->raw_deleter()), min_bytes_(min_bytes), cap_bytes_(cap_bytes),
        huge_bytes_(huge_bytes) {}

  c10::DataPtr allocate(size_t n) override {
    if (n < min_bytes_) return small_->allocate(n);
    const size_t bytes = block_bytes(n);
    std::vector<std::pair<void*, size_t>> evicted;
    void* ptr = nullptr;
    {
      std::lock_guard<std::mutex> g(mu_);
      auto it = free_.find(bytes);
      if (it != free_.end()) {
        ptr = it->second.back();
        it->second.pop_back();
        if (it->second.empty()) free_.erase(it);
        cached_ -= bytes;
        ++hits_;
      } else {
        ++misses_;
        // Keep live + cached within the peak of live bytes (or the new live
        // total when that is a new peak): give back cached blocks, largest first.
        const size_t limit = std::max(peak_live_, live_bytes_ + bytes);
        while (cached_ > 0 && live_bytes_ + bytes + cached_ > limit) {
          auto last = std::prev(free_.end());
          evicted.emplace_back(last->second.back(), last->first);
          cached_ -= last->first;
          last->second.pop_back();
          if (last->second.empty()) free_.erase(last);
        }
      }
      live_bytes_ += bytes;
      peak_live_ = std::max(peak_live_, live_bytes_);
    }
    for (auto& [p, b] : evicted) munmap(p, b);
    if (ptr == nullptr) {
      ptr = map_block(bytes, huge_bytes_);
      if (ptr == MAP_FAILED && release() > 0) {  // cached blocks of other sizes may be in the way
        ptr = map_block(bytes, huge_bytes_);
      }
      if (ptr == MAP_FAILED) {
        std::lock_guard<std::mutex> g(mu_);
        live_bytes_ -= bytes;
        throw std::bad_alloc();
      }
    }
    {
      std::lock_guard<std::mutex> g(mu_);
      live_[ptr] = bytes;
    }
    // context == data: torch's raw_allocate/raw_deallocate (used by some
    // kernels, e.g. bf16 matmul) require it.
    return {ptr, ptr, &CachingHostAllocator::deleter, c10::Device(c10::DeviceType::CPU)};
  }

  // The size of the block that serves a request of n bytes: whole pages;
  // with huge pages on, from huge_bytes / 2 on, whole 2 MiB pages when that
  // adds at most an eighth (a 1.98 MB tensor takes one 2 MiB page instead
  // of 484 small ones; see [Note: huge pages]).
  size_t block_bytes(size_t n) const {
    const size_t bytes = (n + kPage - 1) / kPage * kPage;
    if (huge_bytes_ == 0 || bytes < huge_bytes_ / 2) return bytes;
    const size_t whole = (bytes + kHugePage - 1) / kHugePage * kHugePage;
    return (whole - bytes) * 8 <= bytes ? whole : bytes;
  }

  c10::DeleterFnPtr raw_deleter() const override { return &CachingHostAllocator::deleter; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }

  // Unmaps every cached block and restarts the peak from the bytes live
  // now. Returns the bytes given back.
  size_t release() {
    std::map<size_t, std::vector<void*>> drop;
    {
      std::lock_guard<std::mutex> g(mu_);
      drop.swap(free_);
      cached_ = 0;
      peak_live_ = live_bytes_;
    }
    size_t total = 0;
    for (auto& [bytes, ptrs] : drop) {
      for (void* p : ptrs) munmap(p, bytes);
      total += bytes * ptrs.size();
    }
    return total;
  }

  void stats(uint64_t* out) {
    std::lock_guard<std::mutex> g(mu_);
    out[0] = cached_;
    out[1] = hits_;
    out[2] = misses_;
    out[3] = live_bytes_;
    out[4] = peak_live_;
    out[5] = cap_bytes_;
  }

  static CachingHostAllocator* instance;

  // fork() while another thread (the communication thread) holds the lock
  // would leave the child's copy locked forever: hold it across the fork.
  static void before_fork() { instance->mu_.lock(); }
  static void after_fork() { instance->mu_.unlock(); }

 private:
  // Frees `ptr`: a block of ours is cached when live + cached stays within
  // the peak of live bytes (and the cap, if any), else it goes back to the
  // kernel; anything else was the small allocator's.
  void give(void* ptr) {
    size_t bytes = 0;
    bool keep = false;
    {
      std::lock_guard<std::mutex> g(mu_);
      auto it = live_.find(ptr);
      if (it != live_.end()) {
        bytes = it->second;
        live_.erase(it);
        live_bytes_ -= bytes;
        keep = live_bytes_ + cached_ + bytes <= peak_live_ && (cap_bytes_ == 0 || cached_ + bytes <= cap_bytes_);
        if (keep) {
          free_[bytes].push_back(ptr);
          cached_ += bytes;
        }
      }
    }
    if (bytes == 0) {
      small_delete_(ptr);
    } else if (!keep) {
      munmap(ptr, bytes);
    }
  }

  static void deleter(void* ptr) { instance->give(ptr); }

  c10::Allocator* small_;
  const c10::DeleterFnPtr small_delete_;
  const size_t min_bytes_;
  const size_t cap_bytes_;
  const size_t huge_bytes_;
  std::mutex mu_;
  std::map<size_t, std::vector<void*>> free_;  // cached blocks by size
  std::unordered_map<void*, size_t> live_;     // blocks handed out -> size
  size_t cached_ = 0, live_bytes_ = 0, peak_live_ = 0;
  uint64_t hits_ = 0, misses_ = 0;
};

CachingHostAllocator* CachingHostAllocator::instance = nullptr;

}  // namespace

extern "C" {

// Installs the allocator as torch's CPU allocator (once per process; later
// calls return 1 and change nothing). Requests of min_bytes or more are
// served by it, smaller ones by the allocator that was installed before.
// cap_bytes: most bytes the cache keeps, 0 = no cap beyond the peak rule.
// huge_bytes: blocks of this size or more get huge pages, 0 = none.
// Returns 0 on the first installation, 1 when already installed, 2 when
// the installed allocator has no raw deleter to hand small blocks back to.
int dsrun_host_alloc_install(uint64_t min_bytes, uint64_t cap_bytes, uint64_t huge_bytes) {
  if (CachingHostAllocator::instance != nullptr) return 1;
  if (c10::GetCPUAllocator()->raw_deleter() == nullptr) return 2;
  // Never deleted: blocks handed out keep pointing at its deleter until exit.
  CachingHostAllocator::instance =
      new CachingHostAllocator(c10::GetCPUAllocator(), min_bytes, cap_bytes, huge_bytes);
  pthread_atfork(&CachingHostAllocator::before_fork, &CachingHostAllocator::after_fork,
                 &CachingHostAllocator::after_fork);
  c10::SetCPUAllocator(CachingHostAllocator::instance, /*priority=*/1);
  return 0;
}

// Gives every cached block back to the kernel and restarts the peak of live
// bytes from now. Returns the bytes released.
uint64_t dsrun_host_alloc_release() {
  return CachingHostAllocator::instance ? CachingHostAllocator::instance->release() : 0;
}

// out[6] = {bytes cached now, requests served from the cache, requests that
// mapped fresh memory, bytes of large blocks live now, their peak since the
// last release, the cap in bytes (0: none)}; zeros when not installed.
void dsrun_host_alloc_stats(uint64_t* out) {
  if (CachingHostAllocator::instance) {
    CachingHostAllocator::instance->stats(out);
  } else {
    std::fill(out, out + 6, 0);
  }
}

}  // extern "C"
