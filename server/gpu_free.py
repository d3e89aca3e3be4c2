"""The free channel, smddpd's side: a rank's allocator asks for a segment to be unmapped
before it frees it (close before free).

A rank that carries GPU tensors opens a second data-socket connection and attaches it with
``MSG_FREE_ATTACH`` (the AttachRequest of one of its attached sessions, no memfd; the
connection's process must be the session's). From then on its C++ hook on torch's caching
allocator (``backend/csrc/``) sends one ``SegmentFree`` per exported segment it is about to
return to the driver, from inside the allocator, and waits a bounded time for the
``SegmentFreeReply``:
this module answers it once ``GpuOps.close_before_free`` has unmapped the segment in every
session of that process. The channel's loss is not the rank's: its communicators carry on
(frees are then reported after the fact, with the rank's next op).
"""

from __future__ import annotations

import logging
import socket

from google.protobuf.message import DecodeError

from smddp.core.wire import MSG_FREE, MSG_FREE_REPLY, pack
from smddp.server.gpu_supply import DaemonGpu
from smddp.v1 import smddp_pb2 as pb

log = logging.getLogger(__name__)

# The share of the rank's wait that smddpd spends waiting for its streams: the rest is for
# the answer to arrive before the rank gives up (and frees anyway).
WAIT_SHARE = 0.8
# Longest wait smddpd grants one request, whatever the rank asks (seconds).
MAX_WAIT_S = 10.0
MAX_REQUEST_BYTES = 4096


def answer(gpu: DaemonGpu, pid: int, req: pb.SegmentFree) -> pb.SegmentFreeReply:
    """Unmaps the segment of ``req`` in process ``pid``'s sessions (in the daemon's GPU ops,
    ``gpu``); the reply to send."""
    reply = pb.SegmentFreeReply(seq=req.seq)
    ops = gpu.active()
    if ops is None:
        return reply  # no GPU op has run here: nothing is mapped
    wait_s = min(MAX_WAIT_S, req.wait_ms / 1000.0 * WAIT_SHARE)
    reply.closed, reply.deferred = ops.close_before_free(pid, req.alloc_base, wait_s)
    if reply.deferred:
        log.info(
            "pid %d frees GPU segment 0x%x while smddpd's work on it is still queued: "
            "%d mapping(s) unmapped once it is done",
            pid,
            req.alloc_base,
            reply.deferred,
        )
    return reply


def serve(gpu: DaemonGpu, conn: socket.socket, pid: int, label: str) -> None:
    """Answers ``conn``'s SegmentFree requests until it closes (in the connection's thread).

    Args:
        gpu: the daemon's GPU side, whose ops (once a GPU op made them) hold the mappings.
        conn: the attached free channel.
        pid: its process, as the kernel names it (SO_PEERCRED).
        label: the session it attached with, for messages (not the session: the channel
            must not keep a departed one alive).
    """
    buf = bytearray(MAX_REQUEST_BYTES)
    while True:
        try:
            n, _anc, flags, _addr = conn.recvmsg_into([buf])
        except OSError:
            return
        if not n:
            return
        if flags & socket.MSG_TRUNC or buf[0] != MSG_FREE:
            log.warning(
                "%s: closed its free channel: unexpected message (type %d, %d bytes)",
                label,
                buf[0],
                n,
            )
            return
        try:
            req = pb.SegmentFree.FromString(bytes(buf[1:n]))
        except DecodeError:
            log.warning("%s: closed its free channel: undecodable SegmentFree", label)
            return
        reply = answer(gpu, pid, req)
        try:
            conn.sendall(pack(MSG_FREE_REPLY, reply.SerializeToString()))
        except OSError:
            return
