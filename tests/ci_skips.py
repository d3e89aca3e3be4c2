"""Under ``CI=true`` a skipped test outside ``tests/gpu`` is a failed test.

A skip on the CI machine means that something CI installs did not work (a package that does not
import, a namespace that cannot be made, a user that cannot run the client), and a green run
would hide it. So there every skip, whether it comes from a mark, ``pytest.skip`` in a test or a
fixture, ``pytest.importorskip`` or a module-level skip at collection, is turned into a failure
that carries the skip's reason. Only ``tests/gpu`` may skip: CI has no GPU.

Loaded by ``tests/conftest.py``; ``tests/test_ci_skips.py`` runs it against a scratch suite.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ENV_CI = "CI"
# The one folder (under any folder named "tests") whose tests may skip under CI.
ALLOWED = ("tests", "gpu")


def enforced() -> bool:
    """True when skips must fail: ``CI`` is ``true`` (any case), as CI services set it."""
    return os.environ.get(ENV_CI, "").strip().lower() == "true"


def skip_allowed(path: Path | str) -> bool:
    """True for files inside a ``tests/gpu`` folder."""
    parts = Path(path).resolve().parts
    return any(parts[i : i + 2] == ALLOWED for i in range(len(parts) - 1))


def _reason(longrepr: object) -> str:
    # A skip's longrepr is (file, line counted from 1, "Skipped: reason"); else, as it prints.
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        path, line, reason = longrepr
        return f"{reason} ({path}:{line})"
    return str(longrepr)


def _message(reason: str) -> str:
    return (
        f"skipped under {ENV_CI}=true, where only tests/gpu may skip (install or fix what the "
        f"skip names): {reason}"
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> object:
    """Turns a test's skip (in setup, call or teardown) into a failure under CI."""
    outcome = yield
    report = outcome.get_result()
    if (
        report.skipped
        and not hasattr(report, "wasxfail")  # an expected failure is not a skip
        and enforced()
        and not skip_allowed(item.path)
    ):
        report.outcome = "failed"
        report.longrepr = _message(_reason(report.longrepr))


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> object:
    """Turns a module-level skip (``allow_module_level``, ``importorskip``) into an error."""
    outcome = yield
    report = outcome.get_result()
    path = getattr(collector, "path", None)
    if report.skipped and enforced() and path is not None and not skip_allowed(path):
        report.outcome = "failed"
        report.longrepr = _message(_reason(report.longrepr))
