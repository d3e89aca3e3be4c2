"""Under SMDDP_REQUIRE_GPU=1 a GPU test that cannot run fails (with the reason), never skips."""

from __future__ import annotations

import pytest
from cuda_world import REASON, REQUIRED


@pytest.fixture(autouse=True)
def _gpu_required(request: pytest.FixtureRequest) -> None:
    if REQUIRED and REASON is not None and request.node.get_closest_marker("gpu"):
        pytest.fail(f"SMDDP_REQUIRE_GPU=1, but the GPU tests cannot run here: {REASON}")
