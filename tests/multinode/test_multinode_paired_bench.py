"""benchmarks.multinode_paired: smddp and gloo in the same processes across namespace nodes.

One launch of 2 nodes x 1 rank on links shaped to 200 Mbit/s, two cases: both backends'
figures come back for every case, the fraction of the link's bound is computed from the rate,
and the files land where ``--out`` says. The figures themselves are not judged (a loaded CI
machine); the benchmark is what prints them.
"""

from __future__ import annotations

import json

import pytest
from conftest import netns_skip_reason

from benchmarks.multinode_paired import bound_s, main, parse_cases, parse_rate


def test_the_bound_is_the_link_s() -> None:
    rate = parse_rate("1gbit")
    assert rate == 1e9
    mib16 = 16 << 20
    assert bound_s("all_reduce", mib16, 2, 1, rate) == pytest.approx(mib16 / 125e6)
    assert bound_s("all_reduce", mib16, 4, 1, rate) == pytest.approx(1.5 * mib16 / 125e6)
    assert bound_s("broadcast", mib16, 8, 2, rate) == pytest.approx(mib16 / 125e6)
    # all_gather: every other node's ranks' blocks come in over one node's link.
    assert bound_s("all_gather", 1 << 20, 4, 2, rate) == pytest.approx(3 * 2 * (1 << 20) / 125e6)
    assert bound_s("all_reduce", 4, 4, 1, rate) == 0.0
    assert bound_s("all_reduce", mib16, 4, 1, None) == 0.0
    assert parse_cases("all_reduce:4,all_gather:1MiB,barrier") == [
        ("all_reduce", 4),
        ("all_gather", 1 << 20),
        ("barrier", 0),
    ]
    with pytest.raises(ValueError, match="unknown op 'alltoall'"):
        parse_cases("alltoall:4")


@pytest.mark.netns
@pytest.mark.timeout(600)
def test_one_launch_times_both_backends(tmp_path, capsys) -> None:
    reason = netns_skip_reason()
    if reason:
        pytest.skip(reason)
    code = main(
        [
            "--nodes", "2", "--ranks-per-node", "1", "--rate", "200mbit",
            "--cases", "all_reduce:4,all_reduce:1MiB", "--out", str(tmp_path),
        ]
    )  # fmt: skip
    out = capsys.readouterr()
    assert code == 0, out.err[-4000:]
    doc = json.loads((tmp_path / "multinode-paired.json").read_text())
    assert doc["errors"] == []
    (run,) = doc["runs"]
    assert (run["nodes"], run["ranks_per_node"]) == (2, 1)
    small, large = run["rows"]
    for row in (small, large):
        for b in ("smddp", "gloo"):
            assert row[f"{b}_s"] > 0 and row[f"{b}_cpu_s"] > 0, row
        assert row["gloo_over_smddp"] == pytest.approx(row["gloo_s"] / row["smddp_s"])
    assert small["bound_s"] == 0 and small["smddp_of_bound"] is None
    # 1 MiB over 200 Mbit/s: 2(N-1)/N x S/B = 42 ms; no backend beats the link.
    assert large["bound_s"] == pytest.approx((1 << 20) / 25e6)
    for b in ("smddp", "gloo"):
        assert 0 < large[f"{b}_of_bound"] <= 1.05, large
    table = (tmp_path / "multinode-paired.md").read_text()
    assert "| all_reduce 1 MiB |" in table and "2 nodes x 1 ranks per node" in table
    assert table in out.out
