"""Every collective across nodes, against references the ranks compute themselves.

One process group per layout runs the whole matrix (``rank_main.collectives``): all_reduce
with every reduce op of the dtype, broadcast, reduce, all_gather (list and into a tensor,
both layouts), reduce_scatter (list and tensor), all_to_all (list, single even and uneven
splits, some blocks empty), gather, scatter, send/recv between every pair (within and
across nodes), batch_isend_irecv and barrier; in float32, bfloat16, int64 and bool, at 7
elements and at sizes that cross the 512 KiB chunk (SMDDP_ARENA_BYTES=1048576).

Most layouts run on loopback daemons (fast, unprivileged); a subset runs on daemons in
network namespaces, where the peer traffic crosses veth links and a bridge.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

pytest.importorskip("torch")

ALL_DTYPES = ["float32", "bfloat16", "int64", "bool"]
CHUNKED_ENV = {"SMDDP_ARENA_BYTES": str(1 << 20)}  # the daemon's chunk becomes 512 KiB
SECTIONS = {
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "gather",
    "scatter",
    "send_recv",
    "batch_isend_irecv",
    "barrier",
}

# name (nodes x ranks per node, or ranks per node joined by +): the node of each rank. Nodes
# of 1, 2 and 3 ranks at 2 and 3 nodes; uneven counts; and ranks interleaved across nodes
# (nodes are ordered by their lowest rank; reductions go by node, then by rank).
LOOPBACK_LAYOUTS = {
    "2x1": [0, 1],
    "2x2": [0, 0, 1, 1],
    "2x3": [0, 0, 0, 1, 1, 1],
    "1+3": [0, 1, 1, 1],
    "3x1": [0, 1, 2],
    "3x2": [0, 0, 1, 1, 2, 2],
    "3x3": [0, 0, 0, 1, 1, 1, 2, 2, 2],
    "3+1+2-interleaved": [0, 0, 1, 2, 2, 0],  # node0: ranks 0, 1, 5; node1: 2; node2: 3, 4
}
NETNS_LAYOUTS = {
    "2x2": [0, 0, 1, 1],
    "1+2+3": [0, 1, 1, 2, 2, 2],
}


def check_reports(reports: list[dict[str, Any]], layout: str) -> None:
    """No rank saw a wrong result, every rank ran the same checks, and results that every
    rank holds are the same bits everywhere."""
    failures = [f"rank {r}: {f}" for r, rep in enumerate(reports) for f in rep["failures"]]
    assert not failures, f"{layout}: {len(failures)} wrong results:\n" + "\n".join(failures[:40])
    seen = set().union(*(rep["counts"] for rep in reports))
    assert seen == SECTIONS, f"{layout}: sections run {sorted(seen)}"
    for section in ("all_reduce", "broadcast", "all_gather"):
        digests = {rep["hashes"][section] for rep in reports}
        assert len(digests) == 1, f"{layout}: ranks hold different {section} results"


def run_matrix(launch_world, nodes, node_of_rank, layout, dtypes, timeout_s=150.0) -> None:
    spec = {"dtypes": dtypes, "large": os.environ.get("MN_LARGE", "1") == "1"}
    reports = launch_world(
        "collectives", nodes, node_of_rank, spec, env=CHUNKED_ENV, timeout_s=timeout_s
    ).join()
    check_reports(reports, layout)
    print(f"{layout}: rank 0 took {reports[0]['total_s']:.1f} s: {reports[0]['seconds']}")


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("layout", list(LOOPBACK_LAYOUTS))
def test_collectives_loopback(layout, loopback_nodes, launch_world):
    node_of_rank = LOOPBACK_LAYOUTS[layout]
    nodes = loopback_nodes(max(node_of_rank) + 1)
    run_matrix(launch_world, nodes, node_of_rank, layout, ALL_DTYPES)


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("layout", list(NETNS_LAYOUTS))
def test_collectives_netns(layout, netns_nodes, launch_world):
    node_of_rank = NETNS_LAYOUTS[layout]
    nodes = netns_nodes(max(node_of_rank) + 1)
    for node in nodes:  # the daemons' peers meet on the namespaces' links, not on loopback
        assert f"peers {node.address}:" in node.daemon.log(), node.daemon.log()
    dtypes = ALL_DTYPES if len(node_of_rank) <= 4 else ["float32", "bool"]
    run_matrix(launch_world, nodes, node_of_rank, layout, dtypes)
