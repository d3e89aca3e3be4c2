"""The paired benchmark's peers: Open MPI under mpirun and DeepSpeed's SHM all_reduce.

The test runs the real command with ``--mpirun`` (each world size's ranks started by Open MPI's
mpirun, smddp, gloo, MPI and DeepSpeed in the same processes) on two tiny cases with
``--quick``, and reads its JSON and table. scripts/setup_dev.sh installs Open MPI, mpi4py and
DeepSpeed and builds DeepSpeed's op; where mpirun or mpi4py is missing the test skips, which
under CI=true fails (tests/ci_skips.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 150
MPI, DEEPSPEED = "Open MPI", "DeepSpeed SHM"
# A time as the table writes it: "3.36 µs", "30.6 µs", "169 µs", "1.02 ms".
_TIME = r"\d+(?:\.\d+)? (?:µs|ms)"


def _shm_files() -> set[str]:
    shm = Path("/dev/shm")
    return {p.name for p in shm.glob("deepspeed_allreduce_buffer_*")} if shm.is_dir() else set()


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_paired_under_mpirun_times_open_mpi_and_deepspeed(tmp_path: Path) -> None:
    """At w=2 under mpirun: Open MPI has figures for all_reduce and barrier, DeepSpeed's op for
    all_reduce only; every row names its best peer and smddp's ratio to it; the floors line is
    printed; DeepSpeed's shared-memory files are gone afterwards."""
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun (Open MPI) is not installed; scripts/setup_dev.sh installs it")
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        pytest.skip("mpi4py is not installed; scripts/setup_dev.sh installs it")
    before = _shm_files()
    out, md = tmp_path / "paired.json", tmp_path / "paired.md"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.collectives.paired", "--mpirun", "--world-sizes", "2",
         "--cases", "all_reduce:4,barrier:0", "--ddp-steps", "0", "--quick", "--no-plot",
         "--json", str(out), "--markdown", str(md)],
        check=False, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (run,) = json.loads(out.read_text())["results"]
    assert run["world"] == 2
    assert run["peers"] == {MPI: None, DEEPSPEED: None}, run["peers"]
    ar, barrier = run["cases"]["all_reduce:4"], run["cases"]["barrier:0"]
    for backend in ("smddp", "gloo", MPI, DEEPSPEED):
        assert ar[backend] > 0, (backend, ar)
    assert set(barrier) == {"smddp", "gloo", MPI}, barrier  # DeepSpeed: all_reduce only
    assert barrier[MPI] > 0, barrier
    floors = run["floors"]
    assert floors["handoff_spin_s"] > 0 and floors["handoff_futex_s"] > 0, floors
    assert floors["dispatch_s"] > 0 and floors["memcpy_s"]["4"] > 0, floors

    table = md.read_text()
    assert table in proc.stdout, proc.stdout  # printed as written
    head = table.splitlines()[0]
    assert head == (
        f"| op | w=2 smddp | w=2 gloo | w=2 {MPI} | w=2 {DEEPSPEED} | gloo/smddp | "
        "smddp/best peer |"
    ), head
    times_table = table.split("\n\n")[0].splitlines()  # then: the notes, the CPU table...
    rows = {
        line.split(" | ")[0][2:]: line.strip("| \n").split(" | ")[1:]
        for line in times_table
        if line.startswith(("| all_reduce 4 B | ", "| barrier | "))
    }
    assert set(rows) == {"all_reduce 4 B", "barrier"}, times_table
    best = {"all_reduce 4 B": ("gloo", MPI, DEEPSPEED), "barrier": ("gloo", MPI)}
    for label, cells in rows.items():
        smddp, gloo, mpi, ds, vs_gloo, vs_best = cells
        for cell in (smddp, gloo, mpi):
            assert re.fullmatch(_TIME, cell), (label, cells)
        assert re.fullmatch(_TIME if label == "all_reduce 4 B" else "–", ds), (label, cells)
        assert re.fullmatch(r"\d+\.\d\d", vs_gloo), (label, cells)
        ratio = re.fullmatch(r"(\d+\.\d\d) \((.+)\)", vs_best)
        assert ratio and ratio[2] in best[label], (label, cells)
        key = "all_reduce:4" if label == "all_reduce 4 B" else "barrier:0"
        times = run["cases"][key]
        # The best peer is the fastest one measured, and the ratio smddp's time over its.
        assert ratio[2] == min(best[label], key=lambda b: times[b]), (label, times)
        assert float(ratio[1]) == pytest.approx(times["smddp"] / times[ratio[2]], abs=0.006)
    assert "Floors at w=2, measured in the same job: a word handed between two processes" in table
    assert "torch's dispatch of a 4-byte dist.all_reduce into a Python ProcessGroup" in table
    assert "single-core memcpy 4 B " in table
    assert _shm_files() <= before, _shm_files() - before
