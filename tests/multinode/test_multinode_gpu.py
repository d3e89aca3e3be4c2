"""GPU tensors in a communicator spanning nodes, through real daemons (issue 27).

Two loopback smddpds with distinct node ids, each on the fake GPU runtime
(tests/server/gpu_fakes.py:ipc_queued_runtime, given to them by tests/gpu/fake_smddpd.py:
streams that run in order and block, the generated kernels interpreted), and 2 x 2 rank
processes whose "GPU" is the fake device of tests/gpu/fake_device.py. Every collective
(all_reduce with every reduce op, broadcast, reduce, all_gather, gather, scatter,
reduce_scatter, all_to_all, send/recv within and across nodes, barrier) in every dtype runs on
CPU tensors and on GPU tensors with the same inputs: the GPU path (the client's GPU request,
the daemon's combine on the GPU, the staging through pinned host memory, the exchange, the
copies back) must give the host path's bits. Small chunks (SMDDP_ARENA_BYTES) make the larger
ops cross several of them.

DDP is not run here: on the fake device DDP's buckets are plain CPU tensors (its reducer
allocates them), so it would take the host path; the GPU check runs DDP on a real GPU.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
FAKE_RUNTIME = f"{HERE.parent / 'server' / 'gpu_fakes.py'}:ipc_queued_runtime"
FAKE_SMDDPD = HERE.parent / "gpu" / "fake_smddpd.py"  # smddpd given FAKE_RUNTIME
DTYPES = ["float16", "bfloat16", "float32", "float64", "int8", "uint8", "int16", "int32",
          "int64", "bool"]  # fmt: skip


@pytest.mark.timeout(400)
def test_every_collective_on_gpu_tensors_across_two_nodes_is_the_host_path(
    loopback_nodes, launch_world
) -> None:
    # The GPU ops (the fake runtime's import: seconds on a loaded machine, during which the
    # daemons' peer heartbeats can lapse) are made at the start, not by the first GPU op.
    nodes = loopback_nodes(
        2, args=("--gpu-warm", "start"), command=(sys.executable, str(FAKE_SMDDPD), FAKE_RUNTIME)
    )
    for node in nodes:
        deadline = time.monotonic() + 120
        while "--gpu-warm start: GPU ops ready in" not in node.daemon.log():
            assert time.monotonic() < deadline, node.daemon.log()
            time.sleep(0.1)
    # Every dtype at 7 elements; float32 and bfloat16 also past a chunk (20001 elements:
    # several chunks of every kind); one float32 all_reduce and broadcast of 100003.
    spec = {
        "fake_gpu": True,  # rank_main gives each rank's backend the fake device
        "dtypes": DTYPES,
        "small": 7,
        "chunked": {"float32": [20001], "bfloat16": [20001]},
        "large": 100_003,
    }
    env = {
        "SMDDP_ARENA_BYTES": str(1 << 18),  # chunks of 64 KiB
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    results = launch_world(
        "gpu_collectives", nodes, [0, 0, 1, 1], spec, env=env, timeout_s=360
    ).join()
    problems = [f"rank {r}: {f}" for r, rep in enumerate(results) for f in rep["failures"]]
    logs = "\n".join(f"--- smddpd {n.node_id}:\n{n.daemon.log()[-3000:]}" for n in nodes)
    assert not problems, "\n".join(problems[:40]) + "\n" + logs
    sections = {"all_reduce", "broadcast", "reduce", "gather", "scatter", "all_gather",
                "reduce_scatter", "all_to_all", "send_recv", "barrier", "large"}  # fmt: skip
    # (reduce and gather results are checked where they land: on the roots, ranks 0 and 3)
    assert set().union(*(rep["counts"] for rep in results)) == sections
    for r, rep in enumerate(results):
        assert set(rep["counts"]) >= sections - {"reduce", "gather"}, (r, rep["counts"])
        # The GPU path ran: allocations exported, the rank's stream waited on the daemon's
        # done events (each check first synchronizes, which fails the rank's checks unless
        # the daemon recorded every done event its stream waited on).
        assert rep["exports"] > 100 and sum(rep["done_waits"]) > 200, rep
    for node in nodes:
        assert "runs GPU ops on the TEST runtime" in node.daemon.log()
