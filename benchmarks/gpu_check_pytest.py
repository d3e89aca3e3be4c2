"""A pytest plugin of the GPU check's tests stage (``-p benchmarks.gpu_check_pytest``).

- Every test's timeout is capped at ``SMDDP_CHECK_TEST_CAP`` seconds, its own
  ``@pytest.mark.timeout`` included (pytest-timeout reads the closest marker, so the cap goes
  first): one hung test costs that, not the whole stage.
- Each test's start and outcome are printed as they happen (flushed), so a stage cut short
  still says which test it was in.
"""

from __future__ import annotations

import os
import time

import pytest

CAP_ENV = "SMDDP_CHECK_TEST_CAP"
_started: dict[str, float] = {}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Caps each item's timeout marker at the stage's per-test cap."""
    cap = float(os.environ.get(CAP_ENV) or 0)
    if cap <= 0:
        return
    for item in items:
        marker = item.get_closest_marker("timeout")
        own = float(marker.args[0]) if marker is not None and marker.args else cap
        item.add_marker(pytest.mark.timeout(min(own, cap)), append=False)


def pytest_runtest_logstart(nodeid: str, location: tuple[str, int | None, str]) -> None:
    _started[nodeid] = time.monotonic()
    print(f"\ngpu_check test START {nodeid}", flush=True)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" or report.outcome != "passed":
        took = time.monotonic() - _started.get(report.nodeid, time.monotonic())
        print(
            f"\ngpu_check test {report.outcome.upper()} ({report.when}) {report.nodeid} "
            f"after {took:.1f} s",
            flush=True,
        )
