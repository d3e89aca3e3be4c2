"""The ranks' side of test_recv_any_source.py: ``dist.recv`` / ``dist.irecv`` with no source.

Each ``*_main(rank, world_size)`` runs on every rank of a world (``smddp_world.run_world``)
and returns what it saw: the senders that ``recv`` returned and the values received, or the
error an op raised; the test asserts on them. Every message carries its sender and its
number in its values, so a message received twice, lost, or put in the wrong tensor shows.
Importable by the spawned ranks, hence a module of its own.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

N = 16  # elements of a small message
# A message longer than the daemon's 4 MiB chunk (float32): its receive has more than one chunk.
BIG = (4 << 20) // 4 + 1000


def message(sender: int, k: int, n: int = N) -> torch.Tensor:
    """Message #k of ``sender``: its values say both."""
    return torch.arange(n, dtype=torch.float32) + (1000.0 * sender + 100_000.0 * k)


def origin(t: torch.Tensor) -> tuple[int, int]:
    """The (sender, k) of a tensor filled by ``message``, or (-1, -1) if it is not one."""
    head = float(t.flatten()[0])
    k, rest = divmod(head, 100_000.0)
    sender = int(rest // 1000.0)
    if not torch.equal(t.flatten(), message(sender, int(k), t.numel())):
        return -1, -1
    return sender, int(k)


def _junk(n: int = N) -> torch.Tensor:
    return torch.full((n,), -7.0)


def in_turn_main(rank: int, world_size: int) -> dict[str, Any]:
    """Each rank in turn receives from any source, from every other rank one after the other.

    The receiver lets the next sender go (a plain send to it) only once it has the previous
    message, so the senders come in a known order: rank+1, rank+2, ... And before that,
    a send posted before its receive (isend, then a barrier, then recv) is taken too.
    """
    seen: dict[str, Any] = {"turns": [], "early": None}
    go = torch.zeros(1)
    for receiver in range(world_size):
        others = [(receiver + i) % world_size for i in range(1, world_size)]
        if rank == receiver:
            got = []
            for i, sender in enumerate(others):
                if i:
                    dist.send(go, dst=sender)
                out = _junk()
                src = dist.recv(out)
                got.append((src, origin(out)))
            seen["turns"].append(got)
        elif rank in others:
            i = others.index(rank)
            if i:
                dist.recv(go, src=receiver)
            dist.send(message(rank, receiver), dst=receiver)
    # A send that the daemon holds before any receive is posted.
    early = dist.isend(message(rank, 50), dst=0) if rank == world_size - 1 else None
    dist.barrier()
    if rank == 0:
        out = _junk()
        seen["early"] = (dist.recv(out), origin(out))
    if early is not None:
        early.wait()
    dist.barrier()
    return seen


def irecv_main(rank: int, world_size: int) -> dict[str, Any]:
    """irecv with no source, posted before anyone sends, then ``_source_rank()``; and a
    receive into a tensor that is not contiguous (staged, copied back)."""
    seen: dict[str, Any] = {}
    # The group's first collective on one node maps the control region, which waits for the
    # ops in flight before it (a pending receive too): have it done before the irecv.
    dist.barrier()
    if rank == 0:
        out = _junk()
        work = dist.irecv(out)
        dist.barrier()  # the receive is posted before the send is
        work.wait()
        seen["irecv"] = (work._source_rank(), origin(out))
        strided = torch.full((N, 2), -7.0).t()  # (2, N), not contiguous
        src = dist.recv(strided[0])
        seen["strided"] = (src, origin(strided[0].clone()))
    else:
        dist.barrier()
        if rank == world_size - 1:
            dist.send(message(rank, 1), dst=0)
            dist.send(message(rank, 2), dst=0)
    dist.barrier()
    return seen


def tags_main(rank: int, world_size: int) -> dict[str, Any]:
    """Tags select: a receive from any source takes the first send with its tag and leaves
    the others; messages of one sender come in its order; a receive from any source then
    one from a named rank take that rank's messages in turn."""
    seen: dict[str, Any] = {}
    sends = []
    if rank == 1:
        sends.append(dist.isend(message(1, 0), dst=0, tag=5))
    if rank == 2:
        sends.append(dist.isend(message(2, 0), dst=0, tag=7))
    dist.barrier()  # both sends are at the daemon before either receive
    if rank == 0:
        out7, out5 = _junk(), _junk()
        seen["tag7"] = (dist.recv(out7, tag=7), origin(out7))
        seen["tag5"] = (dist.recv(out5, tag=5), origin(out5))
    for s in sends:
        s.wait()
    dist.barrier()
    # In order per sender, and mixed with a named receive.
    if rank == 1:
        for k in range(1, 5):
            dist.send(message(1, k), dst=0, tag=3)
    if rank == 0:
        outs = [_junk() for _ in range(4)]
        works = [
            dist.irecv(outs[0], tag=3),
            dist.irecv(outs[1], src=1, tag=3),
            dist.irecv(outs[2], tag=3),
            dist.irecv(outs[3], src=1, tag=3),
        ]
        for w in works:
            w.wait()
        seen["order"] = [(works[i]._source_rank(), origin(o)) for i, o in enumerate(outs)]
    dist.barrier()
    return seen


RACE_MESSAGES = 6


def race_main(rank: int, world_size: int) -> dict[str, Any]:
    """Every other rank sends RACE_MESSAGES messages to rank 0 at once; rank 0 receives
    them all from any source, alternating recv and irecv."""
    seen: dict[str, Any] = {}
    if rank == 0:
        got = []
        for i in range(RACE_MESSAGES * (world_size - 1)):
            out = _junk()
            if i % 2:
                work = dist.irecv(out)
                work.wait()
                src = work._source_rank()
            else:
                src = dist.recv(out)
            got.append((src, origin(out)))
        seen["got"] = got
    else:
        works = [dist.isend(message(rank, k), dst=0) for k in range(RACE_MESSAGES)]
        for w in works:
            w.wait()
    dist.barrier()
    return seen


def chunked_main(rank: int, world_size: int) -> dict[str, Any]:
    """Messages of more than one chunk: rank 0 posts a receive from any source, a named
    receive from rank 1 behind it, and another from any source. Rank 1 sends a large
    message then a small one; rank 2 sends its large one once rank 0 has the first
    (before, the first receive could take it, and the named one would then meet rank 1's
    large message: a mismatch, rightly). So the named receive must take rank 1's second
    message, numbered after the one that the receive from any source took."""
    seen: dict[str, Any] = {}
    go = torch.zeros(1)
    if rank == 0:
        first, small, second = _junk(BIG), _junk(), _junk(BIG)
        works = [dist.irecv(first), dist.irecv(small, src=1), dist.irecv(second)]
        works[0].wait()
        dist.send(go, dst=2)
        for w in works[1:]:
            w.wait()
        seen["got"] = [
            (works[0]._source_rank(), origin(first)),
            (works[1]._source_rank(), origin(small)),
            (works[2]._source_rank(), origin(second)),
        ]
    elif rank == 1:
        dist.send(message(1, 0, BIG), dst=0)
        dist.send(message(1, 1), dst=0)
    elif rank == 2:
        dist.recv(go, src=0)
        dist.send(message(2, 0, BIG), dst=0)
    dist.barrier()
    return seen


def mismatch_main(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 1 sends 5 elements; rank 0 receives 7 from any source: both ranks hear why."""
    try:
        if rank == 0:
            dist.recv(torch.zeros(7))
        else:
            dist.send(torch.ones(5), dst=0)
            dist.barrier()  # the group fails: the eager send already returned
        return {"error": None}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def timeout_main(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 1 sends with tag 4; rank 0 receives from any source with tag 3: nobody sends
    that, and the receive times out saying so."""
    try:
        if rank == 0:
            dist.recv(torch.zeros(N), tag=3)
        else:
            dist.send(message(1, 0), dst=0, tag=4)
            dist.recv(torch.zeros(N), src=0)  # fails with the group
        return {"error": None}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
