// Shared-memory point-to-point channels between two ranks of one node (CPU
// tensors): one POSIX shared-memory segment per (sender, receiver, tag), a
// single-producer/single-consumer ring of slots in it. C interface for ctypes
// in dsrun/ops/shm_comm.py (ShmChannel); no torch header (see [Note: build
// time] in dsrun/ops/builder.py).
//
// Segment layout: [ChanHeader, 4 KiB][Desc x slots, rounded up to 4 KiB][slots x slot_bytes]
//
// [Note: shm channel protocol] A message of n bytes travels as max(1,
// ceil(n / slot_bytes)) chunks, one per slot. The sender copies a chunk into
// slot head % slots, writes the slot's descriptor (message number, message
// size, offset, chunk size), then publishes it by advancing `head` (release);
// the receiver waits for head > tail (acquire), checks the descriptor, copies
// the chunk out and frees the slot by advancing `tail` (release). The sender
// may run up to `slots` chunks ahead, so a send returns as soon as its last
// chunk is in the ring, before the receiver has looked at it, and the two
// sides copy different slots of a large message at the same time. Only one
// thread of the sending process pushes at a time and one thread of the
// receiving process pops, so each counter has one writer and needs no lock.
// Messages arrive whole and in the order sent; the receiver names the size
// it expects, and a message of another size (or a desynchronised stream)
// fails on the receiver with both sizes, before any of it is copied.
//
// [Note: shm channel set-up and crash safety] The sender creates the segment
// (lazily, on its first send) and returns without waiting; the receiver, on
// its first receive, waits for the segment to appear with the sender's pid in
// it (a segment of an earlier job with the same name is skipped), maps it and
// removes its name, so the kernel frees it when both processes have exited,
// however they exit. A sender closing a channel on which it sent nothing and
// its receiver never attached removes the name itself; one that sent leaves
// it for the receiver, which still gets the messages in the ring (the name
// outlives the job only if the receiver dies before its first receive). Every wait (receiver for data, sender for a free
// slot, receiver for the segment) checks every 1-16 ms that the peer
// process is alive, that it has not closed or abandoned the channel, and the
// timeout, as the collectives' barrier does (see [Note: shm crash safety] in
// shm_comm.cpp): a peer that dies turns into an error naming it, not a hang.
#include <fcntl.h>
#include <linux/futex.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <string>

#include "shm_comm/shm_common.h"

namespace {

using dsrun_shm::alive;
using dsrun_shm::now_s;
using dsrun_shm::set_err;

constexpr uint64_t kChanMagic = 0x647372756e636831ULL;  // "dsrunch1"
constexpr int64_t kHeaderBytes = 4096;

struct ChanHeader {
  std::atomic<uint64_t> magic;
  int64_t slot_bytes;
  int32_t slots, src, dst, tag;
  std::atomic<int32_t> pid[2];     // sender's, receiver's (0 until it attached)
  std::atomic<int32_t> closed[2];  // the sender / receiver closed or abandoned the channel
  alignas(64) std::atomic<uint64_t> head;  // chunks published by the sender
  alignas(64) std::atomic<uint64_t> tail;  // chunks consumed by the receiver
  // Processes asleep on head's / tail's futex word ([Note: sleeping waits]).
  alignas(64) std::atomic<int32_t> sleepers[2];
};
static_assert(sizeof(ChanHeader) <= kHeaderBytes, "header fits its page");

struct Desc {
  uint64_t msg;    // message number, 1 for the channel's first
  int64_t total;   // message bytes
  int64_t offset;  // of this chunk in the message
  int64_t bytes;   // of this chunk
};

enum Side { SENDER = 0, RECEIVER = 1 };

struct Channel {
  char* base = nullptr;
  size_t bytes = 0;
  std::string name;
  Side side = SENDER;
  int src = 0, dst = 0, tag = 0;
  int peer_pid = 0;  // given by the caller (0: unknown until the peer attached)
  int64_t slot_bytes = 0;
  int slots = 0;
  double timeout_s = 300;
  uint64_t next = 0;      // sender: chunks published; receiver: chunks consumed
  uint64_t msgs = 0;      // messages started
  int64_t send_off = 0;   // sender: bytes of the current message in the ring
  bool in_message = false;
  std::atomic<int> aborting{0};  // set by dsrun_shm_chan_abort from another thread

  ChanHeader* hdr() { return reinterpret_cast<ChanHeader*>(base); }
  Desc* desc(uint64_t chunk) { return reinterpret_cast<Desc*>(base + kHeaderBytes) + chunk % slots; }
  char* slot(uint64_t chunk) { return base + kHeaderBytes + desc_bytes(slots) + (chunk % slots) * slot_bytes; }
  int peer() const { return side == SENDER ? dst : src; }
  int me() const { return side == SENDER ? src : dst; }
  int live_peer_pid() {
    if (!base) return peer_pid;
    const int attached = hdr()->pid[side == SENDER ? RECEIVER : SENDER].load();
    return attached > 0 ? attached : peer_pid;
  }
  static int64_t desc_bytes(int slots) {
    return (static_cast<int64_t>(sizeof(Desc)) * slots + 4095) / 4096 * 4096;
  }
};

size_t segment_bytes(int64_t slot_bytes, int slots) {
  return static_cast<size_t>(kHeaderBytes + Channel::desc_bytes(slots) + slots * slot_bytes);
}

// [Note: sleeping waits] A wait for data (or for a free slot) spins a few
// microseconds, yields a little, then sleeps in the kernel on a futex over the
// low 32 bits of the counter it waits on (head for the receiver, tail for the
// sender), as gloo's receive sleeps in its socket wait. Spinning or yielding
// for long steals the core from the ranks that compute when ranks outnumber
// cores (a pipeline stage waits most of its bubble: 4 ranks on 2 cores ran
// their layers 2-3x slower beside spinning neighbours). When this node's
// ranks (LOCAL_WORLD_SIZE) outnumber the cores this process may run on, the
// wait does not spin or yield at all: the peer it waits for needs a core this
// process holds, and each spin cost ~0.1 ms of CPU per receive (a 10 ms wait
// cost 0.43 ms of CPU with the spin and 1 ms sleeps). The sleeper counts
// itself in `sleepers[side]` before its last look at the counter, and the
// other side wakes the word after advancing it only when someone sleeps;
// both with sequentially consistent order, so either the waker sees the
// sleeper or the sleeper sees the new value (and the futex call itself
// returns at once if the word changed since it was read). A sleep lasts 1 ms
// at first and twice as long each time up to 16 ms (a long wait is not woken
// every millisecond for nothing), so the liveness and timeout checks below
// run at least every 16 ms, and `dsrun_shm_chan_abort` wakes both words.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the futex word is the counter's low half");

uint32_t* futex_word(std::atomic<uint64_t>& counter) { return reinterpret_cast<uint32_t*>(&counter); }

void futex_sleep(std::atomic<uint64_t>& counter, uint32_t seen, long nanoseconds) {
  const timespec most{0, nanoseconds};
  syscall(SYS_futex, futex_word(counter), FUTEX_WAIT, seen, &most, nullptr, 0);
}

void futex_wake(std::atomic<uint64_t>& counter) {
  syscall(SYS_futex, futex_word(counter), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

// Whether this node's ranks outnumber the cores this process may run on
// (see [Note: sleeping waits]); read once.
bool ranks_outnumber_cores() {
  static const bool crowded = [] {
    const char* ranks = getenv("LOCAL_WORLD_SIZE");
    cpu_set_t set;
    if (ranks == nullptr || sched_getaffinity(0, sizeof(set), &set) != 0) return false;
    return atoi(ranks) > CPU_COUNT(&set);
  }();
  return crowded;
}

// Advance `counter` to `value` and wake whoever sleeps on it.
void publish(std::atomic<uint64_t>& counter, std::atomic<int32_t>& sleepers, uint64_t value) {
  counter.store(value, std::memory_order_seq_cst);
  if (sleepers.load(std::memory_order_seq_cst) > 0)
    futex_wake(counter);
}

// Waits until ready() holds: spins, then sleeps on `counter`'s futex word
// when given (see [Note: sleeping waits]), else in 50 us naps. Returns 0, or
// -1 with a message when the peer exited, closed the channel, this process
// aborted it, or time ran out; `doing` says what this rank waited for. See
// [Note: shm channel set-up and crash safety].
template <typename Ready>
int wait_for(Channel& c, Ready ready, const char* doing, char* err, int errlen,
             std::atomic<uint64_t>* counter = nullptr, std::atomic<int32_t>* sleepers = nullptr) {
  const double start = now_s();
  double next_check = start + 1e-3;
  const uint64_t spin = counter != nullptr && ranks_outnumber_cores() ? 0 : 2000;
  const uint64_t yields = spin == 0 ? 0 : 64;
  long sleep_ns = 1000000;
  uint64_t spins = 0;
  while (!ready()) {
    ++spins;
    if (spins < spin) {
#if defined(__x86_64__)
      __builtin_ia32_pause();
#endif
      continue;
    }
    if (spins < spin + yields) {  // fewer cores than ranks is common: let the others run
      sched_yield();
      continue;
    }
    if (counter != nullptr) {
      const uint32_t seen = static_cast<uint32_t>(counter->load(std::memory_order_seq_cst));
      sleepers->fetch_add(1, std::memory_order_seq_cst);
      if (!ready()) futex_sleep(*counter, seen, sleep_ns);
      sleepers->fetch_sub(1, std::memory_order_seq_cst);
      sleep_ns = std::min(2 * sleep_ns, 16000000L);
    } else {
      const timespec nap{0, 50000};
      nanosleep(&nap, nullptr);
    }
    const double t = now_s();
    if (t < next_check) continue;
    next_check = t + 1e-3;
    if (c.aborting.load()) {
      set_err(err, errlen, "shm channel rank %d -> rank %d (tag %d): closed by rank %d while it waited %s", c.src,
              c.dst, c.tag, c.me(), doing);
      return -1;
    }
    const Side peer_side = c.side == SENDER ? RECEIVER : SENDER;
    const int pid = c.live_peer_pid();
    const bool gone = !alive(pid);
    if (gone || (c.base && c.hdr()->closed[peer_side].load(std::memory_order_acquire))) {
      if (ready()) return 0;  // what the peer published before it went is still good
      if (gone)
        set_err(err, errlen, "shm channel rank %d -> rank %d (tag %d): rank %d (pid %d) exited while rank %d waited %s",
                c.src, c.dst, c.tag, c.peer(), pid, c.me(), doing);
      else
        set_err(err, errlen, "shm channel rank %d -> rank %d (tag %d): rank %d closed the channel (or failed) "
                "while rank %d waited %s", c.src, c.dst, c.tag, c.peer(), c.me(), doing);
      return -1;
    }
    if (t - start > c.timeout_s) {
      set_err(err, errlen, "shm channel rank %d -> rank %d (tag %d): rank %d timed out after %.0f s waiting %s "
              "(DSRUN_SHM_TIMEOUT)", c.src, c.dst, c.tag, c.me(), c.timeout_s, doing);
      return -1;
    }
  }
  return 0;
}

void* map_segment(int fd, size_t bytes) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  return p == MAP_FAILED ? nullptr : p;
}

// The sender's side: create and initialise the segment. Returns 0 or -1.
int create(Channel& c, char* err, int errlen) {
  shm_unlink(c.name.c_str());  // a segment left by a crash before its receiver attached
  const int fd = shm_open(c.name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) {
    set_err(err, errlen, "shm_open %s: %s", c.name.c_str(), strerror(errno));
    return -1;
  }
  if (ftruncate(fd, static_cast<off_t>(c.bytes)) != 0) {
    const int e = errno;
    close(fd);
    shm_unlink(c.name.c_str());
    set_err(err, errlen, "ftruncate shm %s to %zu bytes: %s", c.name.c_str(), c.bytes, strerror(e));
    return -1;
  }
  void* p = map_segment(fd, c.bytes);
  close(fd);
  if (!p) {
    shm_unlink(c.name.c_str());
    set_err(err, errlen, "mmap shm %s (%zu bytes): %s", c.name.c_str(), c.bytes, strerror(errno));
    return -1;
  }
  c.base = static_cast<char*>(p);
  ChanHeader* h = c.hdr();
  h->slot_bytes = c.slot_bytes;
  h->slots = c.slots;
  h->src = c.src;
  h->dst = c.dst;
  h->tag = c.tag;
  h->pid[SENDER].store(getpid());
  h->pid[RECEIVER].store(0);
  h->closed[SENDER].store(0);
  h->closed[RECEIVER].store(0);
  h->head.store(0);
  h->tail.store(0);
  h->sleepers[SENDER].store(0);
  h->sleepers[RECEIVER].store(0);
  h->magic.store(kChanMagic, std::memory_order_release);
  return 0;
}

// One try of the receiver's side: 1 when attached, 0 when the segment is not
// (yet) the sender's, -1 on an error that waiting cannot cure.
int try_attach(Channel& c, char* err, int errlen) {
  const int fd = shm_open(c.name.c_str(), O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) {
    if (errno == ENOENT) return 0;
    set_err(err, errlen, "shm_open %s: %s", c.name.c_str(), strerror(errno));
    return -1;
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != c.bytes) {
    close(fd);
    return 0;  // not sized yet, or an older segment of another shape about to be replaced
  }
  void* p = map_segment(fd, c.bytes);
  close(fd);
  if (!p) {
    set_err(err, errlen, "mmap shm %s (%zu bytes): %s", c.name.c_str(), c.bytes, strerror(errno));
    return -1;
  }
  auto* h = static_cast<ChanHeader*>(p);
  const bool ours = h->magic.load(std::memory_order_acquire) == kChanMagic && h->slot_bytes == c.slot_bytes &&
                    h->slots == c.slots && h->src == c.src && h->dst == c.dst && h->tag == c.tag &&
                    (c.peer_pid <= 0 || h->pid[SENDER].load() == c.peer_pid);
  if (!ours) {
    munmap(p, c.bytes);
    return 0;
  }
  c.base = static_cast<char*>(p);
  h->pid[RECEIVER].store(getpid());
  shm_unlink(c.name.c_str());  // see [Note: shm channel set-up and crash safety]
  return 1;
}

}  // namespace

extern "C" {

// Opens this rank's end of the channel src -> dst for `tag`: rank == src
// creates the segment and returns at once; rank == dst waits (up to the
// timeout, checking that peer_pid lives) for the sender to create it.
// Returns nullptr with a message in err on failure.
void* dsrun_shm_chan_open(const char* name, int rank, int src, int dst, int tag, int64_t slot_bytes, int slots,
                          int peer_pid, double timeout_s, char* err, int errlen) {
  if (src == dst || (rank != src && rank != dst) || slot_bytes <= 0 || slot_bytes % 64 || slots < 1) {
    set_err(err, errlen,
            "bad arguments: rank %d, src %d, dst %d (two different ranks, this rank one of them), slot_bytes %lld "
            "(a positive multiple of 64), slots %d (at least 1)",
            rank, src, dst, static_cast<long long>(slot_bytes), slots);
    return nullptr;
  }
  auto* c = new Channel;
  c->name = name;
  c->side = rank == src ? SENDER : RECEIVER;
  c->src = src;
  c->dst = dst;
  c->tag = tag;
  c->peer_pid = peer_pid;
  c->slot_bytes = slot_bytes;
  c->slots = slots;
  c->timeout_s = timeout_s;
  c->bytes = segment_bytes(slot_bytes, slots);
  if (c->side == SENDER) {
    if (create(*c, err, errlen) == 0) return c;
    delete c;
    return nullptr;
  }
  // Until the segment is mapped the waits know the sender's pid from the caller only.
  int state = 0;
  if (wait_for(*c, [&] { return (state = try_attach(*c, err, errlen)) != 0; },
               "for the sender to create the channel", err, errlen) != 0 || state < 0) {
    delete c;
    return nullptr;
  }
  return c;
}

// Makes a wait of this channel on another thread of this process fail soon
// (within about a millisecond) with "closed by rank ..."; see ShmChannel.close.
void dsrun_shm_chan_abort(void* h) {
  auto* c = static_cast<Channel*>(h);
  c->aborting.store(1);
  if (c->base) {  // a wait asleep on either counter looks again now (see [Note: sleeping waits])
    futex_wake(c->hdr()->head);
    futex_wake(c->hdr()->tail);
  }
}

// Marks this side closed (the peer's waits then fail instead of timing out;
// data already in the ring stays readable), removes the name if nothing was
// sent and the receiver never attached, unmaps the segment. No other thread may be inside a call.
void dsrun_shm_chan_close(void* h) {
  auto* c = static_cast<Channel*>(h);
  if (c->base) {
    c->hdr()->closed[c->side].store(1, std::memory_order_release);
    if (c->side == SENDER && c->hdr()->pid[RECEIVER].load() == 0 && c->next == 0) shm_unlink(c->name.c_str());
    munmap(c->base, c->bytes);
  }
  delete c;
}

// Sender: puts the message data[nbytes] into the ring. Returns 1 when all of
// it is in the ring, 0 when blocking is 0 and the ring filled first (call
// again with the same data and nbytes to go on), -1 with a message on error.
int dsrun_shm_chan_send(void* h, const void* data, int64_t nbytes, int blocking, char* err, int errlen) {
  Channel& c = *static_cast<Channel*>(h);
  ChanHeader* hdr = c.hdr();
  if (!c.in_message) {
    c.in_message = true;
    c.send_off = 0;
    ++c.msgs;
  }
  bool first = c.send_off == 0;
  while (first || c.send_off < nbytes) {
    auto space = [&] { return c.next - hdr->tail.load(std::memory_order_acquire) < static_cast<uint64_t>(c.slots); };
    if (!space()) {
      if (!blocking) return 0;
      if (wait_for(c, space, "for the receiver to free a slot", err, errlen, &hdr->tail, &hdr->sleepers[SENDER]) != 0)
        return -1;
    }
    const int64_t n = nbytes - c.send_off < c.slot_bytes ? nbytes - c.send_off : c.slot_bytes;
    memcpy(c.slot(c.next), static_cast<const char*>(data) + c.send_off, n);
    *c.desc(c.next) = Desc{c.msgs, nbytes, c.send_off, n};
    publish(hdr->head, hdr->sleepers[RECEIVER], ++c.next);
    c.send_off += n;
    first = false;
  }
  c.in_message = false;
  return 1;
}

// Receiver: the next message, which must have nbytes bytes, into data.
// Returns 0, or -1 with a message (the channel is then unusable).
int dsrun_shm_chan_recv(void* h, void* data, int64_t nbytes, char* err, int errlen) {
  Channel& c = *static_cast<Channel*>(h);
  ChanHeader* hdr = c.hdr();
  const uint64_t msg = ++c.msgs;
  int64_t off = 0;
  bool first = true;
  while (first || off < nbytes) {
    auto arrived = [&] { return hdr->head.load(std::memory_order_acquire) > c.next; };
    if (!arrived() && wait_for(c, arrived, "for data", err, errlen, &hdr->head, &hdr->sleepers[RECEIVER]) != 0)
      return -1;
    const Desc d = *c.desc(c.next);
    if (d.msg != msg || d.total != nbytes || d.offset != off || d.bytes < 0 || d.bytes > c.slot_bytes ||
        off + d.bytes > nbytes) {
      hdr->closed[RECEIVER].store(1, std::memory_order_release);
      set_err(err, errlen,
              "shm channel rank %d -> rank %d (tag %d): rank %d sent %lld bytes as message #%llu, rank %d expected "
              "%lld bytes as message #%llu; both ranks must send and receive the same tensors (dtype and shape) "
              "in the same order",
              c.src, c.dst, c.tag, c.src, static_cast<long long>(d.total), static_cast<unsigned long long>(d.msg),
              c.dst, static_cast<long long>(nbytes), static_cast<unsigned long long>(msg));
      return -1;
    }
    memcpy(static_cast<char*>(data) + off, c.slot(c.next), d.bytes);
    publish(hdr->tail, hdr->sleepers[SENDER], ++c.next);
    off += d.bytes;
    first = false;
  }
  return 0;
}

}  // extern "C"
