"""The CI rule of ``ci_skips``: under ``CI=true`` every skip outside ``tests/gpu`` fails.

A scratch suite in tmp_path skips in each way pytest knows (a mark, ``pytest.skip`` in a test and
in a fixture, ``importorskip``, a module-level skip), beside a test that passes, an expected
failure and a skip in ``tests/gpu``; a real pytest run of it, with the plugin, with and without
``CI=true``, must give exactly these outcomes.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

SCRATCH = {
    "tests/test_ways.py": """
import pytest

@pytest.fixture
def gone():
    pytest.skip("the fixture found nothing")

def test_passes():
    assert True

@pytest.mark.skip(reason="marked skip")
def test_marked():
    pass

@pytest.mark.skipif(True, reason="a skipif that holds")
def test_skipif():
    pass

def test_skip_call():
    pytest.skip("skipped in the test")

def test_fixture_skip(gone):
    pass

def test_importorskip():
    pytest.importorskip("no_such_module_smddp")

@pytest.mark.xfail(reason="known", strict=True)
def test_xfail():
    raise AssertionError
""",
    "tests/test_module_skip.py": """
import pytest
pytest.skip("the whole module", allow_module_level=True)
def test_never():
    pass
""",
    "tests/test_module_importorskip.py": """
import pytest
pytest.importorskip("no_such_module_smddp_either")
def test_never():
    pass
""",
    "tests/gpu/test_gpu_skip.py": """
import pytest
def test_needs_gpu():
    pytest.skip("no GPU here")
""",
}


def _run(tmp_path: Path, ci: str | None, *args: str) -> subprocess.CompletedProcess[str]:
    for name, text in SCRATCH.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_ADDOPTS")}
    env["PYTHONPATH"] = str(HERE)
    if ci is not None:
        env["CI"] = ci
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "ci_skips", "-p", "no:cacheprovider", "-rA", "-q",
         "--rootdir", str(tmp_path), "--junitxml", str(tmp_path / "junit.xml"), *args,
         str(tmp_path / "tests")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def _outcomes(tmp_path: Path) -> dict[str, str]:
    """{test or module: passed | failed | error | skipped | xfail} from the run's JUnit XML."""
    found = {}
    for case in ET.parse(tmp_path / "junit.xml").iter("testcase"):
        classname, name = case.get("classname"), case.get("name")
        name = (f"{classname}.{name}" if classname else name).removeprefix("tests.")
        skipped = case.find("skipped")
        if case.find("failure") is not None:
            found[name] = "failed"
        elif case.find("error") is not None:
            found[name] = "error"
        elif skipped is not None:
            found[name] = "xfail" if skipped.get("type") == "pytest.xfail" else "skipped"
        else:
            found[name] = "passed"
    return found


@pytest.mark.timeout(150)
def test_under_ci_every_skip_outside_tests_gpu_fails(tmp_path: Path) -> None:
    # A module that skips is a collection error: as in CI, pytest stops before running tests.
    proc = _run(tmp_path, "true")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Interrupted: 2 errors during collection" in out, out
    assert re.search(
        r"ERROR tests/test_module_skip\.py - skipped under CI=true.*the whole module", out
    ), out

    proc = _run(tmp_path, "true", "--continue-on-collection-errors")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    got = _outcomes(tmp_path)
    assert got == {
        "test_ways.test_passes": "passed",
        "test_ways.test_marked": "error",  # marks are evaluated in setup
        "test_ways.test_skipif": "error",
        "test_ways.test_skip_call": "failed",
        "test_ways.test_fixture_skip": "error",  # failed in setup
        "test_ways.test_importorskip": "failed",
        "test_ways.test_xfail": "xfail",
        "test_module_skip": "error",
        "test_module_importorskip": "error",
        "gpu.test_gpu_skip.test_needs_gpu": "skipped",
    }, out
    # Each failure carries the skip's reason.
    for reason in ("marked skip", "a skipif that holds", "skipped in the test",
                   "the fixture found nothing", "no_such_module_smddp", "the whole module",
                   "no_such_module_smddp_either"):  # fmt: skip
        assert re.search(rf"skipped under CI=true.*{reason}", out), (reason, out)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("ci", [None, "false"])
def test_without_ci_skips_stay_skips(tmp_path: Path, ci: str | None) -> None:
    proc = _run(tmp_path, ci)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    got = _outcomes(tmp_path)
    assert got == {
        "test_ways.test_passes": "passed",
        "test_ways.test_marked": "skipped",
        "test_ways.test_skipif": "skipped",
        "test_ways.test_skip_call": "skipped",
        "test_ways.test_fixture_skip": "skipped",
        "test_ways.test_importorskip": "skipped",
        "test_ways.test_xfail": "xfail",
        "test_module_skip": "skipped",
        "test_module_importorskip": "skipped",
        "gpu.test_gpu_skip.test_needs_gpu": "skipped",
    }, out
