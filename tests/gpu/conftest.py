"""Under SMDDP_REQUIRE_GPU=1 a GPU test that cannot run fails (with the reason), never skips."""

from __future__ import annotations

import pytest
from cuda_world import REASON, REQUIRED


@pytest.fixture(autouse=True)
def _gpu_required(request: pytest.FixtureRequest) -> None:
    if REQUIRED and REASON is not None and request.node.get_closest_marker("gpu"):
        pytest.fail(f"SMDDP_REQUIRE_GPU=1, but the GPU tests cannot run here: {REASON}")


# The measurements of the GPU path's hazards (issue 17) run first, so that a GPU check cut
# short by its time limit on a lent machine still has them.
FIRST = ("test_cuda_limits.py", "test_cuda_memory.py", "test_cuda_rank_exit.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Puts the tests of ``FIRST`` ahead of the others, keeping each group's own order."""
    items.sort(key=lambda item: item.path.name not in FIRST)
