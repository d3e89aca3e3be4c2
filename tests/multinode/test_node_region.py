"""The local phases of ops spanning nodes, in the control region of each node's ranks.

A communicator spanning nodes runs a small all_reduce, broadcast or barrier as two
synchronisations in the region of its ranks on each node, around the node's exchange with
the others, which only the node's lowest rank takes to its daemon (``node_combined``). Two
daemons on loopback are the nodes; the ranks are threads of this process (one a process of
its own where it is killed), each with its own connection, as a rank process has.

Checked here: the results are the bits of the daemon path (``SMDDP_REGION=0``) and of a
reference reduced by node, then by rank; and the failure paths: a rank killed while the
others wait in the region on both nodes, a mismatch found in the region, a mismatch between
a rank in the region and one at the daemon, and a timeout named from the region, each an
error on every rank of both nodes.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from smddp.client import SmddpError, connect
from smddp.client.communicator import Communicator, daemon_info
from smddp.client.config import ClientConfig
from smddp.client.errors import MismatchError, OpTimeoutError, RankFailedError
from smddp.core.wire import node_layout
from smddp.v1 import smddp_pb2 as pb
from smddp.v1 import smddp_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[2]
# node0: ranks 0, 1, 4; node1: ranks 2, 3 (nodes are ordered by their lowest rank)
NODE_OF_RANK = [0, 0, 1, 1, 0]


class World:
    """One job's communicator across the loopback nodes, a thread per rank."""

    def __init__(self, nodes: Sequence[Any], node_of_rank: Sequence[int]) -> None:
        self.nodes = nodes
        self.node_of_rank = list(node_of_rank)
        self.size = len(node_of_rank)
        self.job = "j" + secrets.token_hex(8)
        self.token = secrets.token_bytes(16)
        peers = {n.node_id: daemon_info(n.daemon.socket).peer_address for n in nodes}
        self.layout = node_layout([nodes[i].node_id for i in node_of_rank], peers)
        self.pool = ThreadPoolExecutor(self.size)

    def connect(
        self, rank: int, region: bool = True, timeout_s: float = 60.0, comm_id: str = "0"
    ) -> Communicator:
        node = self.nodes[self.node_of_rank[rank]]
        config = replace(ClientConfig.from_env(), node_id=node.node_id, region=region)
        return connect(
            self.job,
            self.token,
            rank,
            self.size,
            comm_id=comm_id,
            socket_path=node.daemon.socket,
            nodes=self.layout,
            timeout_s=timeout_s,
            config=config,
        )

    def run(self, ranks: Sequence[int], fn: Callable[[int], Any]) -> list[Any]:
        """``fn(rank)`` on each rank's thread; its result or the exception it raised."""

        def guarded(rank: int) -> Any:
            try:
                return fn(rank)
            except Exception as exc:  # the test looks at every rank's error
                return exc

        return list(self.pool.map(guarded, ranks))


@pytest.fixture
def two_nodes(loopback_nodes) -> Any:
    """``two_nodes(timeout_s=60)``: a World of ranks 0, 1 on node0 and 2, 3 on node1, and
    its connected communicators, closed at the end of the test."""
    made: list[Communicator] = []

    def make(timeout_s: float = 60.0) -> tuple[World, list[Communicator]]:
        w = World(loopback_nodes(2), [0, 0, 1, 1])
        comms = w.run(range(4), lambda r: w.connect(r, timeout_s=timeout_s))
        made.extend(comms)
        return w, comms

    yield make
    for comm in made:
        comm.close()


def reference(xs: list[np.ndarray], node_of_rank: list[int], op: str) -> np.ndarray:
    """The daemons' order: each node's ranks in rank order, then the nodes in node order."""
    ufunc = {"sum": np.add, "avg": np.add, "max": np.maximum, "product": np.multiply}[op]
    partials = []
    for node in dict.fromkeys(node_of_rank):
        ranks = [r for r, n in enumerate(node_of_rank) if n == node]
        acc = xs[ranks[0]].copy()
        for r in ranks[1:]:
            ufunc(acc, xs[r], out=acc)
        partials.append(acc)
    total = partials[0].copy()
    for p in partials[1:]:
        ufunc(total, p, out=total)
    if op == "avg":
        np.divide(total, np.asarray(len(xs), dtype=total.dtype), out=total)
    return total


OPS = {"sum": pb.SUM, "avg": pb.AVG, "max": pb.MAX, "product": pb.PRODUCT}


def data_of(rank: int, n: int, dtype: str, op: str) -> np.ndarray:
    rng = np.random.default_rng(rank * 7919 + n)
    if dtype == "int64":
        return rng.integers(-(1 << 40), 1 << 40, n, dtype=np.int64)
    scale = 1.0 if op == "product" else 10.0 ** rng.integers(-3, 4)
    return (rng.standard_normal(n) * scale + (1.0 if op == "product" else 0.0)).astype(dtype)


@pytest.mark.timeout(240)
def test_small_ops_run_in_the_region_and_give_the_daemon_path_s_bits(loopback_nodes) -> None:
    nodes = loopback_nodes(2)
    w = World(nodes, NODE_OF_RANK)
    fast = w.run(range(w.size), lambda r: w.connect(r))
    slow = w.run(range(w.size), lambda r: w.connect(r, region=False, comm_id="daemon"))
    cases = [
        (n, dtype, op)
        for n in (1, 7, 4099, 60_000)  # 60 000 float64: 480 KB, several arena chunks
        for dtype, ops in (("float32", OPS), ("float64", ("sum", "avg")), ("int64", ("sum",)))
        for op in ops
        if not (dtype == "int64" and op == "avg")
    ]

    def rank_main(r: int) -> list[Any]:
        got = []
        for n, dtype, op in cases:
            results = []
            for comm in (fast[r], slow[r]):
                x = data_of(r, n, dtype, op)
                comm.all_reduce(x, OPS[op]).wait()
                results.append(x)
            got.append(results)
        for root in (0, 1, 3):
            results = []
            for comm in (fast[r], slow[r]):
                x = np.full(333, float(r), dtype=np.float32)
                comm.broadcast(x, root).wait()
                results.append(x)
            got.append(results)
        fast[r].barrier().wait()
        return got

    per_rank = w.run(range(w.size), rank_main)
    for r, got in enumerate(per_rank):
        assert not isinstance(got, BaseException), f"rank {r}: {got!r}"
    for i, (n, dtype, op) in enumerate(cases):
        want = reference(
            [data_of(r, n, dtype, op) for r in range(w.size)], NODE_OF_RANK, op
        ).tobytes()
        for r in range(w.size):
            region_bits, daemon_bits = (x.tobytes() for x in per_rank[r][i])
            assert region_bits == daemon_bits == want, f"rank {r}: {n} x {dtype} {op}"
    for k, root in enumerate((0, 1, 3)):
        for r in range(w.size):
            for x in per_rank[r][len(cases) + k]:
                assert (x == root).all(), f"rank {r}: broadcast from {root}"

    # They ran in the region: the daemons counted none of them as ops through the daemon,
    # and each rank's count of ops in the region holds them all.
    for comm in fast:
        assert comm._node_phases and comm._region._shm is not None
    expected = len(cases) + 3 + 1
    for node in nodes:
        with grpc.insecure_channel("unix:" + node.daemon.socket) as channel:
            status = pb_grpc.NodeStub(channel).Status(pb.StatusRequest(), timeout=10)
        (comm_status,) = [c for c in status.comms if c.job_id == w.job and c.comm_id == "0"]
        assert comm_status.ops_completed == expected, comm_status
        assert all(rank.ops_completed == expected for rank in comm_status.ranks), comm_status
    for comm in fast + slow:
        comm.close()


KILLED = """
import json, sys, time
sys.path.insert(0, {repo!r})
from dataclasses import replace
from smddp.client import connect
from smddp.client.config import ClientConfig
from smddp.v1 import smddp_pb2 as pb
spec = json.loads(sys.argv[1])
nodes = [pb.NodeSpec(**n) for n in spec["layout"]]
config = replace(ClientConfig.from_env(), node_id=spec["node_id"])
comm = connect(spec["job"], bytes.fromhex(spec["token"]), spec["rank"], spec["size"],
               socket_path=spec["socket"], nodes=nodes, config=config)
print("connected", flush=True)
time.sleep(600)  # killed while the others wait for it in their all_reduce
"""


def spawn_rank(w: World, rank: int) -> subprocess.Popen[str]:
    node = w.nodes[w.node_of_rank[rank]]
    spec = {
        "job": w.job,
        "token": w.token.hex(),
        "rank": rank,
        "size": w.size,
        "socket": node.daemon.socket,
        "node_id": node.node_id,
        "layout": [
            {"node_id": s.node_id, "peer_address": s.peer_address, "ranks": list(s.ranks)}
            for s in w.layout
        ],
    }
    return subprocess.Popen(
        [sys.executable, "-c", KILLED.format(repo=str(REPO)), json.dumps(spec)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


@pytest.mark.timeout(120)
def test_a_rank_killed_while_both_nodes_wait_in_the_region_fails_every_rank(
    loopback_nodes,
) -> None:
    nodes = loopback_nodes(2)
    w = World(nodes, [0, 0, 1, 1])
    victim = spawn_rank(w, 3)
    try:
        comms = w.run([0, 1, 2], lambda r: w.connect(r))
        assert victim.stdout is not None and victim.stdout.readline().strip() == "connected"
        waited: dict[int, float] = {}

        def rank_main(r: int) -> Any:
            # node0's leader waits at its daemon, node0's other rank in the region for its
            # result; node1's leader waits in the region for rank 3, which never comes.
            try:
                comms[r].all_reduce(np.ones(16, np.float32)).wait()
            finally:
                waited[r] = time.monotonic()
            return "completed"

        running = w.pool.submit(w.run, [0, 1, 2], rank_main)
        time.sleep(1.0)
        assert not running.done()
        killed_at = time.monotonic()
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        results = running.result(timeout=30)
    finally:
        victim.kill()
        victim.wait()
    messages = set()
    for r, got in zip([0, 1, 2], results):
        assert isinstance(got, RankFailedError), f"rank {r}: {got!r}"
        assert "rank 3 (pid" in str(got), f"rank {r}: {got}"
        assert waited[r] - killed_at < 3.0, f"rank {r} raised {waited[r] - killed_at:.1f} s after"
        messages.add(str(got))
    assert len(messages) == 1, messages  # the same error, word for word, on both nodes
    for comm in comms:
        comm.close()


def _raised(results: list[Any], ranks: Sequence[int], kind: type, match: str) -> set[str]:
    texts = set()
    for r, got in zip(ranks, results):
        assert isinstance(got, kind), f"rank {r}: {got!r}"
        assert match in str(got), f"rank {r}: {got}"
        texts.add(str(got))
    return texts


@pytest.mark.timeout(120)
def test_a_mismatch_found_in_the_region_fails_both_nodes(two_nodes) -> None:
    w, comms = two_nodes()

    def rank_main(r: int) -> Any:
        x = np.ones(8, np.float32)
        (comms[r].broadcast(x, 0) if r == 1 else comms[r].all_reduce(x)).wait()

    results = w.run(range(4), rank_main)
    # node0's ranks find it in their region; node1's hear it from node0's daemon.
    _raised(results, range(4), SmddpError, "while rank 1 called broadcast(src=0, 8 x float32)")
    assert isinstance(results[0], MismatchError) and isinstance(results[1], MismatchError)


@pytest.mark.timeout(120)
def test_a_rank_at_the_daemon_while_the_others_are_in_the_region_is_a_mismatch(
    two_nodes,
) -> None:
    w, comms = two_nodes()
    big = 400_000  # 1.6 MB: larger than a region buffer, so rank 1 takes it to the daemon

    def rank_main(r: int) -> Any:
        comms[r].all_reduce(np.ones(big if r == 1 else 8, np.float32)).wait()

    started = time.monotonic()
    results = w.run(range(4), rank_main)
    texts = _raised(
        results,
        range(4),
        SmddpError,
        f"rank 1 called all_reduce(SUM, {big} x float32) as op #1 while rank 0 called "
        "all_reduce(SUM, 8 x float32)",
    )
    assert len(texts) == 1, texts
    assert time.monotonic() - started < 10, "found by the daemon's watchdog, not a timeout"


@pytest.mark.timeout(120)
def test_a_timeout_in_the_region_names_the_missing_rank_on_both_nodes(two_nodes) -> None:
    w, comms = two_nodes(timeout_s=1.0)

    def rank_main(r: int) -> Any:
        comms[r].all_reduce(np.ones(8, np.float32)).wait()

    results = w.run([0, 2, 3], rank_main)  # rank 1 never calls it
    # node0's watchdog finds it in the region; node1's daemon, whose leader waits for node0's
    # data, asks node0 why, and hears the same. Whichever is first, every rank is told.
    for r, got in zip([0, 2, 3], results):
        assert isinstance(got, OpTimeoutError), f"rank {r}: {got!r}"
        text = str(got)
        assert "op #1 all_reduce(SUM, 8 x float32)" in text and "rank 1 " in text, text


@pytest.mark.timeout(120)
def test_the_lowest_rank_takes_its_op_to_the_daemon_before_it_receives(two_nodes) -> None:
    # Rank 1 waits for the all_reduce before it sends; rank 0 receives before it waits. The
    # daemon path let that run (the daemon had rank 0's op), and so must the region: rank 0's
    # recv first takes its all_reduce to the daemon.
    w, comms = two_nodes()

    def rank_main(r: int) -> Any:
        x = np.full(4, float(r + 1), np.float32)
        op = comms[r].all_reduce(x)
        if r == 0:
            got = np.zeros(3, np.float32)
            comms[0].recv(got, 1).wait()
            op.wait()
            return x.tolist(), got.tolist()
        op.wait()
        if r == 1:
            comms[1].send(np.arange(3, dtype=np.float32), 0).wait()
        return x.tolist()

    results = w.run(range(4), rank_main)
    assert results[0] == ([10.0] * 4, [0.0, 1.0, 2.0]), results
    assert results[1:] == [[10.0] * 4] * 3, results


@pytest.mark.timeout(120)
def test_a_rank_elsewhere_that_finished_and_left_does_not_fail_the_op(two_nodes) -> None:
    # node1's lowest rank has its result from the daemon but is slow to hand it on; node0's
    # ranks, done with the op, leave meanwhile, which fails the communicator. Rank 3, waiting
    # for rank 2's result in the region, must still complete the op (its next one fails).
    w, comms = two_nodes()
    engine = comms[2]._engine
    retire = engine.retire_through

    def slow_retire(op: Any) -> None:
        retire(op)
        time.sleep(0.5)  # node0's ranks close in this time

    engine.retire_through = slow_retire  # type: ignore[method-assign]

    def rank_main(r: int) -> Any:
        x = np.full(4, float(r + 1), np.float32)
        comms[r].all_reduce(x).wait()
        if r < 2:
            comms[r].close()
        return x.tolist()

    results = w.run(range(4), rank_main)
    assert results == [[10.0] * 4] * 4, results
    with pytest.raises(RankFailedError, match="has left the communicator"):
        comms[3].all_reduce(np.ones(4, np.float32)).wait()
