"""Ranks that call different collectives as the same op: every rank gets SmddpMismatchError.

Three torch ranks on a system daemon. Each case runs in a group of its own (a failed group
stays failed): the first two ops agree, the third does not. Every rank must get the same
message, naming each group of ranks and what it called, and no rank's tensor may change.
"""

from __future__ import annotations

import re
import time
from typing import Any

import pytest

WORLD = 3
N = 4096
# 2 MiB of float32, past the region's buffer (1 MiB at 3 ranks): all_reduce runs "direct"
# (ranks reduce from each other's arenas)
DIRECT_N = 1 << 19
JOB = r"job j[0-9a-f]{16} comm [^:]+"

# case: (what each rank calls as op #3, the message after "job J comm C: ")
CASES: dict[str, str] = {
    "kind": (
        r"rank 1 called broadcast\(src=1, 4096 x float32\) as op #3 "
        r"while ranks 0, 2 called all_reduce\(SUM, 4096 x float32\)"
    ),
    "dtype": (
        r"rank 1 called all_reduce\(SUM, 4096 x float64\) as op #3 "
        r"while ranks 0, 2 called all_reduce\(SUM, 4096 x float32\)"
    ),
    "count": (
        r"rank 2 called all_reduce\(SUM, 4097 x float32\) as op #3 "
        r"while ranks 0-1 called all_reduce\(SUM, 4096 x float32\)"
    ),
    "root": (
        r"rank 0 called broadcast\(src=0, 4096 x float32\) as op #3 "
        r"while ranks 1-2 called broadcast\(src=2, 4096 x float32\)"
    ),
    "reduce op": (
        r"rank 2 called all_reduce\(MAX, 4096 x float32\) as op #3 "
        r"while ranks 0-1 called all_reduce\(SUM, 4096 x float32\)"
    ),
    "direct count": (
        r"rank 0 called all_reduce\(SUM, 524289 x float32\) as op #3 "
        r"while ranks 1-2 called all_reduce\(SUM, 524288 x float32\)"
    ),
}


def mismatch_rank(rank: int, world: int, init_file: str) -> dict[str, Any]:
    """Runs every case; returns per case the error's class, message and whether outputs held."""
    import torch
    import torch.distributed as dist

    import smddp  # noqa: F401  (registers the backend)
    from smddp.backend.errors import SmddpMismatchError

    dist.init_process_group("smddp", init_method=f"file://{init_file}", rank=rank, world_size=world)

    def third_op(case: str, t: torch.Tensor, group: Any) -> None:
        if case == "kind":
            dist.broadcast(t, src=1, group=group) if rank == 1 else dist.all_reduce(t, group=group)
        elif case == "dtype":
            dist.all_reduce(t.double() if rank == 1 else t, group=group)
        elif case == "count":
            dist.all_reduce(torch.ones(N + 1) if rank == 2 else t, group=group)
        elif case == "root":
            dist.broadcast(t, src=0 if rank == 0 else 2, group=group)
        elif case == "reduce op":
            dist.all_reduce(
                t, op=dist.ReduceOp.MAX if rank == 2 else dist.ReduceOp.SUM, group=group
            )
        elif case == "direct count":
            dist.all_reduce(t, group=group)

    out: dict[str, Any] = {}
    for case in CASES:
        group = dist.new_group(backend="smddp")
        agreed = DIRECT_N if case == "direct count" else N
        for _ in range(2):  # ops #1 and #2 agree
            x = torch.ones(agreed)
            dist.all_reduce(x, group=group)
            assert torch.equal(x, torch.full((agreed,), float(world))), case
        n = agreed + 1 if case == "direct count" and rank == 0 else agreed
        t = torch.arange(n, dtype=torch.float32) + 1000 * rank
        before = t.clone()
        start = time.monotonic()
        try:
            third_op(case, t, group)
        except Exception as exc:
            out[case] = {
                "type": type(exc).__name__,
                "mismatch": isinstance(exc, SmddpMismatchError),
                "dist_backend_error": isinstance(exc, dist.DistBackendError),
                "message": str(exc),
                "unchanged": torch.equal(t, before),
                "seconds": time.monotonic() - start,
            }
        else:
            out[case] = {"type": None, "message": "", "unchanged": torch.equal(t, before)}
        # The group stays failed with the same cause, at once.
        try:
            dist.all_reduce(torch.ones(4), group=group)
            out[case]["after"] = None
        except dist.DistBackendError as exc:
            out[case]["after"] = str(exc)
        dist.destroy_process_group(group)

    # The default group never saw a mismatch and still works.
    x = torch.full((N,), float(rank))
    dist.all_reduce(x)
    assert torch.equal(x, torch.full((N,), float(sum(range(world)))))
    dist.destroy_process_group()
    return out


@pytest.mark.timeout(120)
def test_mismatched_ops_fail_every_rank_naming_each_call(
    system_daemon, rank_env, spawn_ranks, tmp_path
):
    env = rank_env(system_daemon.socket)
    results = spawn_ranks(mismatch_rank, WORLD, WORLD, str(tmp_path / "init"), env=env).join()

    for case, expected in CASES.items():
        messages = {r[case]["message"] for r in results}
        assert len(messages) == 1, f"{case}: ranks got different messages: {messages}"
        message = messages.pop()
        assert re.fullmatch(f"{JOB}: {expected}", message), f"{case}: {message!r}"
        for rank, r in enumerate(results):
            got = r[case]
            assert got["type"] == "SmddpMismatchError", f"{case} rank {rank}: {got}"
            assert got["mismatch"] and got["dist_backend_error"], f"{case} rank {rank}: {got}"
            assert got["unchanged"], f"{case} rank {rank}: the tensor was written on a mismatch"
            assert got["seconds"] < 5, f"{case} rank {rank}: the error took {got['seconds']:.1f} s"
            assert got["after"] == message, f"{case} rank {rank}: the next op said {got['after']!r}"
    print("\n".join(f"{case}: {results[0][case]['message']}" for case in CASES))
