"""The daemons' own rendezvous, for jobs without a store (non-torch clients).

Numpy ranks of the example (``examples/numpy_allreduce.py --root``) on two loopback daemons
meet through node0's Peer service, learn which ranks share a node, and run their collectives
across the nodes with correct results. Then the refusals: a rank with another token, a world
size that disagrees, ranks that never come (named at the timeout), and a root that is no
daemon — each a clear error, and the daemons serve on.
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from smddp.client import rendezvous
from smddp.client.communicator import daemon_info
from smddp.client.errors import ConnectError

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "numpy_allreduce.py"
RUN_TIMEOUT_S = 90


def _run_example(nodes: list[Any], node_of_rank: list[int], root: str) -> list[str]:
    token = secrets.token_hex(16)
    procs = []
    for rank, n in enumerate(node_of_rank):
        cmd = [
            sys.executable, str(EXAMPLE), "--rank", str(rank), "--world-size", str(len(node_of_rank)),
            "--job-id", "numpy-rdzv", "--job-token", token, "--size", "300000",
            "--socket", nodes[n].daemon.socket, "--root", root,
        ]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=RUN_TIMEOUT_S)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for rank, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {rank} exited with {p.returncode}:\n{out}"
    return outputs


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_numpy_ranks_meet_through_the_daemons_and_run_across_nodes(loopback_nodes):
    nodes = loopback_nodes(2)
    root = daemon_info(nodes[0].daemon.socket).peer_address
    outputs = _run_example(nodes, [0, 1, 0, 1], root)
    for rank, out in enumerate(outputs):
        assert f"rank {rank}: the job spans 2 node(s)" in out, out
        assert f"rank {rank}: all_reduce(SUM) of 300000 x float32 ok" in out, out
        assert f"rank {rank}: all_gather and barrier ok" in out, out


def _meet(results: dict[int, Any], socket: str, rank: int, **kwargs: Any) -> None:
    try:
        results[rank] = rendezvous(socket_path=socket, rank=rank, **kwargs)
    except ConnectError as exc:
        results[rank] = exc


# Its waits add up to about 10 s; with other work on the machine one run took 85 s.
@pytest.mark.timeout(180)
def test_rendezvous_refusals_name_the_cause(loopback_nodes):
    nodes = loopback_nodes(2)
    root = daemon_info(nodes[0].daemon.socket).peer_address
    token = secrets.token_bytes(16)
    job = {
        "job_id": "rdzv-bad",
        "job_token": token,
        "world_size": 3,
        "root": root,
        "timeout_s": 3.0,
    }

    # Rank 0 waits at the root; a rank with another token is refused at once and rank 0 keeps
    # waiting; ranks 1 and 2 never come, and rank 0 is told so, by name.
    results: dict[int, Any] = {}
    waiting = threading.Thread(target=_meet, args=(results, nodes[0].daemon.socket, 0), kwargs=job)
    waiting.start()
    with pytest.raises(ConnectError, match="rank 1 has the wrong job token"):
        rendezvous(
            **{**job, "job_token": secrets.token_bytes(16)},
            rank=1,
            socket_path=nodes[1].daemon.socket,
        )
    waiting.join(30)
    error = results[0]
    assert isinstance(error, ConnectError), error
    assert re.search(
        r"rendezvous of job rdzv-bad: ranks 1-2 did not arrive within 3 s \(1 of 3 ranks came\)",
        str(error),
    ), error

    # A rank with another world size: the meeting cannot complete, so the rank already waiting
    # (with a 60 s timeout) is told at once, with the same message, and so is a rank that comes
    # later; the job's next attempt, after the failed meeting's timeout, would meet afresh.
    sizes = {**job, "job_id": "rdzv-sizes", "timeout_s": 60.0}
    results = {}
    waiting = threading.Thread(
        target=_meet, args=(results, nodes[0].daemon.socket, 0), kwargs=sizes
    )
    waiting.start()
    # Let rank 0 reach the root first; should rank 2 get there before it, both are still told
    # at once (the message then names rank 0), which the pattern allows.
    time.sleep(0.5)
    mismatch = r"rendezvous of job rdzv-sizes: rank [02] says the world size is [34], earlier ranks said [34]"
    started = time.monotonic()
    with pytest.raises(ConnectError, match=mismatch):
        rendezvous(**{**sizes, "world_size": 4}, rank=2, socket_path=nodes[1].daemon.socket)
    waiting.join(10)
    assert not waiting.is_alive(), "rank 0 still waits after the world sizes disagreed"
    assert time.monotonic() - started < 10
    assert isinstance(results[0], ConnectError) and re.search(mismatch, str(results[0])), results[0]
    with pytest.raises(ConnectError, match=mismatch):
        rendezvous(**sizes, rank=1, socket_path=nodes[1].daemon.socket)

    # A root where no daemon answers: the forwarding daemon says which address it tried.
    with pytest.raises(ConnectError, match=r"the root's daemon at 127\.0\.0\.1:9: "):
        rendezvous(
            "rdzv-noroot",
            token,
            0,
            2,
            root="127.0.0.1:9",
            socket_path=nodes[1].daemon.socket,
            timeout_s=2.0,
        )
    # A bad token length and a job id with a slash never reach the root.
    with pytest.raises(ConnectError, match="job_token must have 16-1024 bytes"):
        rendezvous("rdzv-short", b"x", 0, 2, root=root, socket_path=nodes[1].daemon.socket)
    with pytest.raises(ConnectError, match="job_id must be"):
        rendezvous("a/b", token, 0, 2, root=root, socket_path=nodes[1].daemon.socket)

    # After all that, a job meets normally on the same daemons.
    good = {
        "job_id": "rdzv-good",
        "job_token": token,
        "world_size": 2,
        "root": root,
        "timeout_s": 30.0,
    }
    results = {}
    threads = [
        threading.Thread(target=_meet, args=(results, nodes[r].daemon.socket, r), kwargs=good)
        for r in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(40)
    layouts = [[(n.node_id, n.peer_address, list(n.ranks)) for n in results[r]] for r in range(2)]
    node1 = daemon_info(nodes[1].daemon.socket).peer_address
    assert layouts[0] == layouts[1] == [("node0", root, [0]), ("node1", node1, [1])], layouts
