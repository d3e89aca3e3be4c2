"""all_gathers, all_to_alls, reduce_scatters, gathers and scatters on one node read the other
ranks' inputs in place, and broadcasts read and write them (client/peer_memory.py).

Real daemon, ranks in processes of their own (the test process is rank 0): the reads cross
processes as a job's do. Results are compared element for element with what every rank's
input must be; the ranks must decide alike whether they read in place, fall back to the
arenas together, and raise the same error on every rank when a read is refused later.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import secrets
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from smddp.client import connect
from smddp.client.config import ClientConfig
from smddp.client.errors import OpError, RankFailedError
from smddp.client.peer_memory import Probe, reaches, read
from smddp.core.region import S_PID
from smddp.v1 import smddp_pb2 as pb

WORLD = 3
# Element counts whose inputs are larger than a region buffer (1 MiB at this world), so the
# all_gathers run direct; odd sizes, so no chunk or read is a round number.
CASES = [("float32", 300_007), ("float16", 700_001), ("int64", 140_003), ("bool", 1_200_007)]


def _input(dtype: str, n: int, rank: int, round_: int) -> np.ndarray:
    rng = np.random.default_rng(1000 * round_ + rank)
    if dtype == "bool":
        return rng.random(n) < 0.5
    if dtype == "int64":
        return rng.integers(-(1 << 40), 1 << 40, n)
    return (rng.standard_normal(n) * 100).astype(dtype)


def _gathers(comm, rank: int) -> list[str]:
    """Every case twice (the second time with fresh outputs and changed inputs), with direct
    and region all_reduces between them, and two all_gathers started before either is
    waited for. Returns what differed."""
    problems = []
    for round_ in range(2):
        for dtype, n in CASES:
            src = _input(dtype, n, rank, round_)
            outs = [np.zeros(n, dtype) for _ in range(WORLD)]
            comm.all_gather(outs, src).wait()
            for j in range(WORLD):
                if not np.array_equal(outs[j], _input(dtype, n, j, round_)):
                    problems.append(f"rank {rank}: {dtype} x {n}, round {round_}: block {j}")
            big = np.full(400_000, float(rank), np.float32)
            comm.all_reduce(big).wait()  # direct
            small = np.full(5, float(rank), np.float64)
            comm.all_reduce(small).wait()  # in the region
            if big[0] != sum(range(WORLD)) or small[0] != sum(range(WORLD)):
                problems.append(f"rank {rank}: all_reduce after {dtype}")
    a, b = _input("float32", 300_007, rank, 5), _input("float32", 400_009, rank, 6)
    outs_a = [np.zeros(a.size, np.float32) for _ in range(WORLD)]
    outs_b = [np.zeros(b.size, np.float32) for _ in range(WORLD)]
    ha, hb = comm.all_gather(outs_a, a), comm.all_gather(outs_b, b)
    hb.wait()
    ha.wait()
    for j in range(WORLD):
        if not np.array_equal(outs_a[j], _input("float32", 300_007, j, 5)):
            problems.append(f"rank {rank}: the first of two open all_gathers, block {j}")
        if not np.array_equal(outs_b[j], _input("float32", 400_009, j, 6)):
            problems.append(f"rank {rank}: the second of two open all_gathers, block {j}")
    return problems


def _split(s: int, d: int, round_: int) -> int:
    """How many elements rank s sends rank d: uneven, some blocks empty."""
    return (s * 7 + d * 3 + round_ * 5) % 4 * 60_001


def _block(s: int, d: int, round_: int, dtype: str) -> np.ndarray:
    return _input(dtype, _split(s, d, round_), 100 * s + d, round_)


def _all_to_alls(comm, rank: int) -> list[str]:
    """Uneven all_to_alls (the first one of the communicator's ops that reads in place, so
    the ranks vote), one whose outputs lie over its inputs, and one right behind an
    all_gather that has not run yet (which decides instead, when it comes first)."""
    problems = []
    for round_, dtype in enumerate(["float32", "int64", "float16", "bool"]):
        ins = [_block(rank, d, round_, dtype) for d in range(WORLD)]
        outs = [np.zeros(_split(s, rank, round_), dtype) for s in range(WORLD)]
        comm.all_to_all(outs, ins).wait()
        for s in range(WORLD):
            if not np.array_equal(outs[s], _block(s, rank, round_, dtype)):
                problems.append(f"rank {rank}: all_to_all {dtype}: block from {s}")
    n = 90_001
    both = np.concatenate([_input("float32", n, 10 * rank + d, 9) for d in range(WORLD)])
    views = [both[d * n : (d + 1) * n] for d in range(WORLD)]
    comm.all_to_all(views, views).wait()  # in place, as all_to_all_single(t, t)
    for s in range(WORLD):
        if not np.array_equal(views[s], _input("float32", n, 10 * s + rank, 9)):
            problems.append(f"rank {rank}: all_to_all over its own input: block from {s}")
    src = _input("float32", 300_007, rank, 7)
    gathered = [np.zeros(src.size, np.float32) for _ in range(WORLD)]
    pending = comm.all_gather(gathered, src)
    ins = [np.full(1000, 10 * rank + d, np.int64) for d in range(WORLD)]
    outs = [np.zeros(1000, np.int64) for _ in range(WORLD)]
    comm.all_to_all(outs, ins).wait()
    pending.wait()
    if [int(o[0]) for o in outs] != [10 * s + rank for s in range(WORLD)]:
        problems.append(f"rank {rank}: all_to_all behind an all_gather")
    if not all(np.array_equal(gathered[j], _input("float32", 300_007, j, 7)) for j in range(WORLD)):
        problems.append(f"rank {rank}: the all_gather in front of an all_to_all")
    return problems


RS_CASES = [
    ("float32", pb.SUM),
    ("float32", pb.AVG),
    ("float64", pb.SUM),
    ("float16", pb.SUM),
    ("int64", pb.PRODUCT),
    ("int64", pb.MAX),
]


def _reduce_scatters(comm, rank: int, token: bytes) -> list[str]:
    """Bitwise what the daemon gives (a second communicator of the same ranks that does not
    read in place), in chunks of 24 KiB, including one whose output is its own input block."""
    daemon = connect(
        comm.session.job_id,
        token,
        rank,
        WORLD,
        comm_id="through-the-daemon",
        socket_path=comm.config.socket,
        config=ClientConfig(socket=comm.config.socket, single_copy=False),
    )
    problems = []
    n = 300_007
    for round_, (dtype, op) in enumerate(RS_CASES):
        ins = [_input(dtype, n, 10 * rank + d, round_) for d in range(WORLD)]
        if op == pb.PRODUCT:
            ins = [x % 3 + 1 for x in ins]  # no overflow to hide a wrong order
        got, want = np.zeros(n, dtype), np.zeros(n, dtype)
        comm.reduce_scatter(got, ins, op).wait()
        daemon.reduce_scatter(want, ins, op).wait()
        if got.tobytes() != want.tobytes():
            problems.append(
                f"rank {rank}: reduce_scatter {dtype} op {op} differs from the daemon's"
            )
    both = np.concatenate([_input("float32", n, 10 * rank + d, 8) for d in range(WORLD)])
    blocks = [both[d * n : (d + 1) * n] for d in range(WORLD)]
    want = np.zeros(n, np.float32)
    daemon.reduce_scatter(want, [b.copy() for b in blocks]).wait()
    comm.reduce_scatter(blocks[rank], blocks).wait()  # the output is its own input block
    if blocks[rank].tobytes() != want.tobytes():
        problems.append(f"rank {rank}: reduce_scatter into its own input block")
    daemon.close()
    return problems


def _rooted(comm, rank: int) -> list[str]:
    """Large gathers, scatters and broadcasts from every root, one scatter whose root's
    output is one of its inputs."""
    problems = []
    n = 300_007
    for round_, (dtype, root) in enumerate([("float32", 0), ("int64", 1), ("float16", 2)]):
        src = _input(dtype, n, rank, round_)
        outs = [np.zeros(n, dtype) for _ in range(WORLD)] if rank == root else None
        comm.gather(outs, src, root).wait()
        if outs is not None and not all(
            np.array_equal(outs[j], _input(dtype, n, j, round_)) for j in range(WORLD)
        ):
            problems.append(f"rank {rank}: gather {dtype} to {root}")
        ins = [_input(dtype, n, 10 + d, round_) for d in range(WORLD)] if rank == root else None
        out = np.zeros(n, dtype)
        comm.scatter(out, ins, root).wait()
        if not np.array_equal(out, _input(dtype, n, 10 + rank, round_)):
            problems.append(f"rank {rank}: scatter {dtype} from {root}")
    # Broadcasts from every root, of sizes that split unevenly among the ranks (the root
    # writes the last n // WORLD elements into every other rank, which reads the rest).
    for round_, (dtype, root, size) in enumerate(
        [("float32", 0, n), ("int64", 1, 150_001), ("float16", 2, 700_003), ("bool", 1, 1_200_007)]
    ):
        data = _input(dtype, size, 30 + root, round_) if rank == root else np.zeros(size, dtype)
        comm.broadcast(data, root).wait()
        if data.tobytes() != _input(dtype, size, 30 + root, round_).tobytes():
            problems.append(f"rank {rank}: broadcast {dtype} x {size} from {root}")
    ins = [_input("float32", n, 20 + d, 9) for d in range(WORLD)]
    out = ins[1] if rank == 0 else np.zeros(n, np.float32)
    comm.scatter(out, ins if rank == 0 else None, 0).wait()
    if not np.array_equal(out, _input("float32", n, 20 + rank, 9)):
        problems.append(f"rank {rank}: a scatter whose root's output is one of its inputs")
    return problems


def _rank(
    socket_path: str, job: str, token: bytes, rank: int, single_copy: bool, script: str, q
) -> None:
    chunk = 24 << 10 if script == "reduce_scatters" else None
    config = ClientConfig(socket=socket_path, single_copy=single_copy, direct_chunk_bytes=chunk)
    comm = connect(job, token, rank, WORLD, socket_path=socket_path, config=config)
    if script == "reduce_scatters":
        problems = _reduce_scatters(comm, rank, token)
    else:
        scripts = {"gathers": _gathers, "all_to_alls": _all_to_alls, "rooted": _rooted}
        problems = scripts[script](comm, rank)
    q.put((rank, comm._direct.in_place, problems))
    comm.close()


def _run(
    d, single_copy: dict[int, bool], script: str = "gathers"
) -> dict[int, tuple[bool, list[str]]]:
    job, token = f"single-copy-{secrets.token_hex(4)}", secrets.token_bytes(16)
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    procs = [
        ctx.Process(
            target=_rank, args=(d.socket, job, token, r, single_copy.get(r, True), script, q)
        )
        for r in range(1, WORLD)
    ]
    for p in procs:
        p.start()
    _rank(d.socket, job, token, 0, single_copy.get(0, True), script, q)
    results = {}
    for _ in range(WORLD):
        rank, in_place, problems = q.get(timeout=120)
        results[rank] = (in_place, problems)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    return results


@pytest.mark.timeout(240)
@pytest.mark.parametrize("script", ["gathers", "all_to_alls", "reduce_scatters", "rooted"])
def test_ops_read_in_place_across_processes(start_daemon, script: str) -> None:
    results = _run(start_daemon(), {}, script)
    assert {r: in_place for r, (in_place, _) in results.items()} == {0: True, 1: True, 2: True}
    assert [p for _, problems in results.values() for p in problems] == []


@pytest.mark.timeout(240)
@pytest.mark.parametrize("script", ["gathers", "all_to_alls", "reduce_scatters", "rooted"])
def test_one_rank_turning_it_off_keeps_every_rank_off(start_daemon, script: str) -> None:
    """The all_gathers run through the arenas, the all_to_alls through the daemon."""
    results = _run(start_daemon(), {2: False}, script)
    assert {r: in_place for r, (in_place, _) in results.items()} == {0: False, 1: False, 2: False}
    assert [p for _, problems in results.values() for p in problems] == []


def _every_rank(d, target) -> tuple:
    """Starts ``target(socket, job, token, rank, queue)`` as every rank of a new job, each in
    a process of its own; returns the queue and the processes."""
    job, token = f"single-copy-{secrets.token_hex(4)}", secrets.token_bytes(16)
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(d.socket, job, token, r, q)) for r in range(WORLD)]
    for p in procs:
        p.start()
    return q, procs


def _split_disagrees(socket_path: str, job: str, token: bytes, rank: int, q) -> None:
    comm = connect(job, token, rank, WORLD, socket_path=socket_path)
    ins = [np.ones(10, np.float32) for _ in range(WORLD)]
    outs = [np.zeros(11 if (rank, s) == (2, 0) else 10, np.float32) for s in range(WORLD)]
    try:
        comm.all_to_all(outs, ins).wait()
        q.put((rank, None, None))
    except OpError as exc:
        q.put((rank, type(exc).__name__, str(exc)))


@pytest.mark.timeout(120)
def test_split_sizes_that_disagree_fail_every_rank_alike(start_daemon) -> None:
    q, procs = _every_rank(start_daemon(), _split_disagrees)
    outcomes = sorted(q.get(timeout=60) for _ in range(WORLD))
    for p in procs:
        p.join(30)
    assert {kind for _, kind, _ in outcomes} == {"OpError"}, outcomes
    assert len({message for _, _, message in outcomes}) == 1, outcomes
    assert (
        "all_to_all: rank 0 sends 10 elements to rank 2 but rank 2 expects 11 from rank 0 "
        "(input and output split sizes disagree)" in outcomes[0][2]
    )


def _drops_privileges(op: str, socket_path: str, job: str, token: bytes, rank: int, q) -> None:
    """all_gather: rank 2 drops to another user, and then may not read rank 0. broadcast:
    the root, rank 0, drops, and then may not write into the others (whom root's processes
    may still read)."""
    comm = connect(job, token, rank, WORLD, socket_path=socket_path)
    src = np.full(400_000, rank, np.float32)
    outs = [np.zeros(src.size, np.float32) for _ in range(WORLD)]
    comm.all_gather(outs, src).wait()
    if rank == (WORLD - 1 if op == "all_gather" else 0):
        os.setresuid(65534, 65534, 65534)
    q.put("ready")
    started = time.monotonic()
    try:
        if op == "all_gather":
            comm.all_gather(outs, src).wait()
        else:
            comm.broadcast(src, 0).wait()
        q.put((rank, None, None))
    except OpError as exc:
        # Every rank at once, not at the group's timeout.
        q.put((rank, type(exc).__name__, str(exc), time.monotonic() - started < 5))


@pytest.mark.timeout(120)
@pytest.mark.skipif(os.geteuid() != 0, reason="changes a rank's user: needs root")
@pytest.mark.parametrize(
    ("op", "refused"),
    [
        ("all_gather", "rank 2 could not read rank 0's all_gather input in place in op #2"),
        ("broadcast", "rank 0 could not write rank 1's broadcast output in place in op #2"),
    ],
)
def test_a_copy_refused_later_fails_the_op_on_every_rank(
    start_daemon, op: str, refused: str
) -> None:
    q, procs = _every_rank(start_daemon(), functools.partial(_drops_privileges, op))
    got = [q.get(timeout=60) for _ in range(2 * WORLD)]
    assert got.count("ready") == WORLD
    outcomes = sorted(x for x in got if x != "ready")
    for p in procs:
        p.join(30)
    kinds = {outcome[1] for outcome in outcomes}
    messages = {outcome[2] for outcome in outcomes}
    assert kinds == {"OpError"}, outcomes
    assert all(outcome[3] for outcome in outcomes), outcomes
    assert len(messages) == 1, outcomes
    (message,) = messages
    assert refused in message
    assert "Operation not permitted" in message and "SMDDP_SINGLE_COPY=0" in message


def test_a_probe_reaches_only_the_process_that_holds_it() -> None:
    probe = Probe()
    assert reaches(os.getpid(), probe.address, probe.value)
    assert not reaches(os.getpid(), probe.address, probe.value + 1)
    assert not reaches(os.getpid(), 0, probe.value)
    assert not reaches(0, probe.address, probe.value)
    # Another process at the same pid number (another pid namespace, a reused pid) does not
    # hold this process's value there.
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert not reaches(other.pid, probe.address, probe.value)
    finally:
        other.kill()
        other.wait()
    with pytest.raises(OSError):
        read(other.pid, np.zeros(1, np.int64), probe.address)  # gone: ESRCH


def test_read_copies_a_range_in_calls_of_at_most_read_bytes() -> None:
    src = np.arange(3_000_001, dtype=np.int16)  # ~6 MB: several calls, the last one short
    dst = np.zeros_like(src)
    read(os.getpid(), dst, src.ctypes.data)
    assert np.array_equal(dst, src)
    assert pb.INVALID  # the error kind a refused read carries


def _loops(socket_path: str, job: str, token: bytes, rank: int, op: str, ready) -> None:
    comm = connect(job, token, rank, WORLD, socket_path=socket_path)
    n = 2_000_000  # 8 MB per rank: each op takes a while, so the kill lands inside one
    src = np.ones(n, np.float32)
    outs = [np.zeros(n, np.float32) for _ in range(WORLD)]
    comm.all_gather(outs, src).wait()
    ready.set()
    while True:
        _loop_op(comm, op, outs, src)


def _loop_op(comm, op: str, outs: list[np.ndarray], src: np.ndarray) -> None:
    if op == "all_gather":
        comm.all_gather(outs, src).wait()
    elif op == "all_to_all":
        comm.all_to_all(outs, [src] * WORLD).wait()
    else:  # rank 1 writes into rank 2's memory, and rank 0 reads from rank 1
        comm.broadcast(src, 1).wait()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("op", ["all_gather", "all_to_all", "broadcast"])
def test_a_rank_killed_while_the_others_read_it_fails_them_fast(start_daemon, op: str) -> None:
    d = start_daemon()
    job, token = f"single-copy-{secrets.token_hex(4)}", secrets.token_bytes(16)
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    victim = ctx.Process(target=_loops, args=(d.socket, job, token, 2, op, ready))
    victim.start()
    comms = [connect(job, token, r, WORLD, socket_path=d.socket) for r in range(2)]
    n = 2_000_000
    srcs = [np.ones(n, np.float32) for _ in range(2)]
    outs = [[np.zeros(n, np.float32) for _ in range(WORLD)] for _ in range(2)]
    errors: list[BaseException | None] = [None, None]
    killed: list[float] = []

    def loop(r: int) -> None:
        try:
            comms[r].all_gather(outs[r], srcs[r]).wait()  # as the victim's first op
            while True:
                _loop_op(comms[r], op, outs[r], srcs[r])
                if ready.is_set() and not killed and r == 0:
                    killed.append(time.monotonic())
                    victim.kill()
        except OpError as exc:
            errors[r] = exc

    threads = [threading.Thread(target=loop, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a rank hung after rank 2 died"
    assert killed and time.monotonic() - killed[0] < 5
    assert all(isinstance(e, RankFailedError) for e in errors), errors
    assert len({str(e) for e in errors}) == 1, errors
    assert f"rank 2 (pid {victim.pid}," in str(errors[0])
    victim.join(10)


@pytest.mark.timeout(60)
def test_reads_go_only_to_the_process_each_rank_reached(start_daemon) -> None:
    """Any rank can write the region, its pid word too: once the ranks have decided, a pid
    word pointing at another process must not take the others' reads there."""
    d = start_daemon()
    job, token = f"single-copy-{secrets.token_hex(4)}", secrets.token_bytes(16)
    comms = [connect(job, token, r, 2, socket_path=d.socket) for r in range(2)]
    srcs = [np.full(400_000, r + 1, np.float32) for r in range(2)]
    outs = [[np.zeros(400_000, np.float32) for _ in range(2)] for _ in range(2)]

    def both() -> None:
        handles = [comms[r].all_gather(outs[r], srcs[r]) for r in range(2)]
        for h in handles:
            h.wait()

    both()
    assert all(c._direct.in_place for c in comms)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        shm = comms[1]._region.shm
        shm.q[shm.base + S_PID] = other.pid  # rank 1's pid word now names another process
        for r in range(2):
            for out in outs[r]:
                out.fill(0)
        both()
    finally:
        other.kill()
        other.wait()
    assert all(np.array_equal(outs[r][j], srcs[j]) for r in range(2) for j in range(2))
    for c in comms:
        c.close()
