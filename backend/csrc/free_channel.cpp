// The free channel (see free_channel.h). Why it looks the way it does:
//
// * It runs inside torch's caching allocator (CUDACachingAllocator::release_block calls the
//   trace trackers with SEGMENT_FREE just before cudaFree, holding the per-device allocator
//   mutex). torch's header says the GIL may be held by the thread in the allocator, so this
//   code never touches Python, and it makes no CUDA call (which could re-enter the allocator).
//   Its own mutex is taken only here and by the Python-side calls below, which never hold it
//   while calling into the allocator: no lock-order cycle.
// * It never blocks the allocator for ever: each answer is awaited with poll() for at most
//   wait_ms; past that the free goes ahead with a log line (the old after-the-fact path, in
//   which smddpd unmaps at the rank's next op, still covers it). A channel that broke (smddpd
//   gone) is dropped and logged once, and later frees do not wait at all, until the rank's
//   Python side opens a new one (backend/cuda_free_hook.py: at its next GPU op, or when a new
//   group attaches to a restarted smddpd; smddp_fc_is_open and smddp_fc_check tell it when).
// * Messages are the data socket's: one SOCK_SEQPACKET message, a type byte and a protobuf
//   (SegmentFree / SegmentFreeReply in protos/smddp/v1/smddp.proto), encoded by hand: the
//   request has only fixed64 fields. Each request carries a sequence number, so an answer
//   that arrives after its wait gave up is recognised and dropped.
#include "free_channel.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <mutex>
#include <unordered_set>

namespace {

// core/wire.py: MSG_FREE, MSG_FREE_REPLY.
constexpr unsigned char kMsgFree = 8;
constexpr unsigned char kMsgFreeReply = 9;

std::mutex mu;
int channel = -1;
// channel >= 0, readable without mu: smddp_fc_is_open runs on every GPU op, and must not wait
// behind a free that is waiting for smddpd.
std::atomic<int> channel_open{0};
uint32_t wait_budget_ms = 1000;
uint64_t next_seq = 0;
bool broke_logged = false;
std::unordered_set<uint64_t> watched;
uint64_t n_sent = 0, n_closed = 0, n_deferred = 0, n_timeouts = 0, n_failed = 0, n_opens = 0;

// One line on stderr; write(2) directly: no stdio locks, no Python logging (the GIL).
void log_line(const char* text) {
  ssize_t unused = write(2, text, strlen(text));
  (void)unused;
}

int64_t now_ms() {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t(ts.tv_sec) * 1000 + ts.tv_nsec / 1000000;
}

void put_fixed64(unsigned char* p, unsigned char tag, uint64_t v) {
  p[0] = tag;
  for (int i = 0; i < 8; i++) p[1 + i] = (unsigned char)(v >> (8 * i));
}

bool get_varint(const unsigned char*& p, const unsigned char* end, uint64_t& v) {
  v = 0;
  for (int shift = 0; p < end && shift < 64; shift += 7) {
    unsigned char b = *p++;
    v |= uint64_t(b & 0x7F) << shift;
    if (!(b & 0x80)) return true;
  }
  return false;
}

// SegmentFreeReply: seq (1, fixed64), closed (2, varint), deferred (3, varint), error (4).
bool parse_reply(const unsigned char* p, const unsigned char* end, uint64_t& seq,
                 uint64_t& closed, uint64_t& deferred) {
  seq = closed = deferred = 0;
  while (p < end) {
    uint64_t key;
    if (!get_varint(p, end, key)) return false;
    uint64_t field = key >> 3, type = key & 7, v = 0;
    if (type == 1) {
      if (end - p < 8) return false;
      for (int i = 0; i < 8; i++) v |= uint64_t(p[i]) << (8 * i);
      p += 8;
    } else if (type == 0) {
      if (!get_varint(p, end, v)) return false;
    } else if (type == 2) {
      uint64_t len;
      if (!get_varint(p, end, len) || uint64_t(end - p) < len) return false;
      p += len;
      continue;
    } else if (type == 5) {
      if (end - p < 4) return false;
      p += 4;
      continue;
    } else {
      return false;
    }
    if (field == 1) seq = v;
    if (field == 2) closed = v;
    if (field == 3) deferred = v;
  }
  return true;
}

// Closes the channel (mu held).
void shut_channel() {
  if (channel >= 0) close(channel);
  channel = -1;
  channel_open.store(0, std::memory_order_relaxed);
}

// A free found the channel broken: drop it (mu held).
void drop_channel(const char* why) {
  shut_channel();
  n_failed++;
  if (!broke_logged) {
    broke_logged = true;
    char line[256];
    snprintf(line, sizeof line,
             "smddp: the free channel to smddpd broke (%s); GPU memory freed from now on is "
             "unmapped by smddpd at the rank's next op instead of before the free\n",
             why);
    log_line(line);
  }
}

}  // namespace

extern "C" void smddp_fc_open(int fd, uint32_t wait_ms) {
  std::lock_guard<std::mutex> lock(mu);
  shut_channel();
  channel = fd;
  channel_open.store(fd >= 0 ? 1 : 0, std::memory_order_relaxed);
  wait_budget_ms = wait_ms;
  broke_logged = false;
  n_opens++;
}

extern "C" void smddp_fc_close(void) {
  std::lock_guard<std::mutex> lock(mu);
  shut_channel();
}

extern "C" int smddp_fc_is_open(void) { return channel_open.load(std::memory_order_relaxed); }

extern "C" int smddp_fc_check(void) {
  std::lock_guard<std::mutex> lock(mu);
  if (channel < 0) return 0;
  unsigned char buf[512];
  for (;;) {
    struct pollfd pfd = {channel, POLLIN, 0};
    int ready = poll(&pfd, 1, 0);
    if (ready < 0 && errno == EINTR) continue;
    if (ready < 0 || (pfd.revents & (POLLERR | POLLNVAL))) break;
    if (ready == 0) return 1;  // nothing waiting, peer still there
    // Readable: a late answer (no request is in flight while mu is held), or the peer's end.
    ssize_t n = recv(channel, buf, sizeof buf, MSG_DONTWAIT);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) return 1;
    if (n <= 0) break;
  }
  shut_channel();
  return 0;
}

extern "C" void smddp_fc_watch(uint64_t base) {
  std::lock_guard<std::mutex> lock(mu);
  watched.insert(base);
}

extern "C" void smddp_fc_stats(uint64_t out[7]) {
  std::lock_guard<std::mutex> lock(mu);
  out[0] = n_sent;
  out[1] = n_closed;
  out[2] = n_deferred;
  out[3] = n_timeouts;
  out[4] = n_failed;
  out[5] = watched.size();
  out[6] = n_opens;
}

extern "C" int smddp_fc_segment_free(uint64_t base, uint64_t nbytes) {
  std::lock_guard<std::mutex> lock(mu);
  if (watched.erase(base) == 0) return SMDDP_FC_NOT_MAPPED;
  if (channel < 0) {
    n_failed++;
    return SMDDP_FC_NO_CHANNEL;
  }
  uint64_t seq = ++next_seq;
  unsigned char req[1 + 4 * 9];
  req[0] = kMsgFree;
  put_fixed64(req + 1, 0x09, base);      // alloc_base = 1
  put_fixed64(req + 10, 0x11, nbytes);   // nbytes = 2
  put_fixed64(req + 19, 0x19, seq);      // seq = 3
  put_fixed64(req + 28, 0x21, wait_budget_ms);  // wait_ms = 4
  ssize_t sent;
  do {
    sent = send(channel, req, sizeof req, MSG_NOSIGNAL);
  } while (sent < 0 && errno == EINTR);
  if (sent != (ssize_t)sizeof req) {
    drop_channel(sent < 0 ? strerror(errno) : "short send");
    return SMDDP_FC_NO_CHANNEL;
  }
  n_sent++;
  const int64_t deadline = now_ms() + wait_budget_ms;
  unsigned char buf[512];
  for (;;) {
    int64_t left = deadline - now_ms();
    if (left <= 0) break;
    struct pollfd pfd = {channel, POLLIN, 0};
    int ready = poll(&pfd, 1, int(left));
    if (ready < 0 && errno == EINTR) continue;
    if (ready < 0) {
      drop_channel(strerror(errno));
      return SMDDP_FC_NO_CHANNEL;
    }
    if (ready == 0) break;
    ssize_t n = recv(channel, buf, sizeof buf, MSG_DONTWAIT);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n <= 0) {
      drop_channel(n == 0 ? "smddpd closed it" : strerror(errno));
      return SMDDP_FC_NO_CHANNEL;
    }
    uint64_t got_seq, closed, deferred;
    if (buf[0] != kMsgFreeReply || !parse_reply(buf + 1, buf + n, got_seq, closed, deferred)) {
      drop_channel("an answer that is not a SegmentFreeReply");
      return SMDDP_FC_NO_CHANNEL;
    }
    if (got_seq != seq) continue;  // the late answer to a request whose wait gave up
    if (deferred) {
      n_deferred++;
      return SMDDP_FC_DEFERRED;
    }
    n_closed++;
    return SMDDP_FC_CLOSED;
  }
  n_timeouts++;
  char line[256];
  snprintf(line, sizeof line,
           "smddp: smddpd did not confirm unmapping GPU segment 0x%llx (%llu bytes) within "
           "%u ms; freeing it anyway (it is unmapped at the rank's next op)\n",
           (unsigned long long)base, (unsigned long long)nbytes, wait_budget_ms);
  log_line(line);
  return SMDDP_FC_TIMEOUT;
}
