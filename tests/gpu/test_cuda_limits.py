"""On a GPU only: CUDA graph capture is refused with a clear error (the fake GPU test checks
the message without one), and an all_reduce past 2^31 elements is exact at both ends."""

from __future__ import annotations

import pytest
from cuda_world import measure, rank_env, requires_gpu

pytestmark = requires_gpu


@pytest.mark.timeout(300)
def test_capture_is_refused_and_a_2_31_element_all_reduce_is_exact(
    daemon, spawn_ranks, tmp_path
) -> None:
    from cuda_ranks import limits_rank

    results = spawn_ranks(
        limits_rank, 2, 2, str(tmp_path / "init"), 0, env=rank_env(daemon.socket), timeout_s=240
    ).join()
    r0 = results[0]
    measure(f"capture refused: {r0['capture'][:160]}")
    measure(
        f"int8 all_reduce of 2^31+17 elements, 2 ranks: "
        f"{'exact' if all(r['big_ok'] for r in results) else 'WRONG'} at both ends, "
        f"{r0['big_s']:.2f} s"
    )
    for r in results:
        assert "cannot run inside CUDA graph capture" in r["capture"], r["capture"]
        assert r["big_ok"], r
