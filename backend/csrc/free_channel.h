// Close before free, the rank's side: a channel to smddpd on which the allocator hook asks for
// a segment to be unmapped before the segment is returned to the driver.
//
// Plain C ABI and POSIX only (no torch, no CUDA, no Python): segment_hook.cpp calls
// smddp_fc_segment_free from inside torch's caching allocator, and tests load this file alone
// (built with the system compiler) through ctypes and drive the same entry point.
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// What smddp_fc_segment_free did.
enum {
  SMDDP_FC_NOT_MAPPED = 0,  // never exported to smddpd: nothing was sent
  SMDDP_FC_CLOSED = 1,      // smddpd unmapped it before answering
  SMDDP_FC_DEFERRED = 2,    // smddpd answered, some mapping's work was still running: unmapped later
  SMDDP_FC_TIMEOUT = 3,     // no answer within the bound: freed anyway (logged)
  SMDDP_FC_NO_CHANNEL = 4,  // no channel, or it broke (logged once)
};

// Adopts ``fd``, a data-socket connection already attached with MSG_FREE_ATTACH, as the
// channel (closing any previous one); ``wait_ms`` bounds each wait for an answer. It may be
// called again (the process's daemon restarted, the channel broke): watched segments stay
// watched, and the next failure is logged again.
void smddp_fc_open(int fd, uint32_t wait_ms);
// Closes the channel; later frees of watched segments return SMDDP_FC_NO_CHANNEL at once.
void smddp_fc_close(void);
// 1 while a channel is open and no free has found it broken, else 0. Takes no lock (an op may
// ask while a free waits for smddpd), so it cannot see a peer that left without a free since.
int smddp_fc_is_open(void);
// Like smddp_fc_is_open, but also looks at the socket (a poll that does not block, after the
// channel's lock): a channel whose smddpd closed it or exited is dropped (not logged: the
// caller reopens and says so) and 0 is returned. Late answers waiting there are discarded.
int smddp_fc_check(void);
// A segment at ``base`` has been exported to smddpd: its free must be announced.
void smddp_fc_watch(uint64_t base);
// The tracker's entry point: the segment at ``base`` (``nbytes`` long) is about to be freed.
// Blocks until smddpd has unmapped it, or at most the channel's wait_ms.
int smddp_fc_segment_free(uint64_t base, uint64_t nbytes);
// Counters: requests sent, closed, deferred, timed out, failed, segments watched now, and
// channels opened (smddp_fc_open calls).
void smddp_fc_stats(uint64_t out[7]);

#ifdef __cplusplus
}
#endif
