"""Tests of the collectives benchmark (``python -m benchmarks.collectives``).

The end-to-end tests run the real command in a subprocess with ``--quick`` and read its JSON;
the rest test the size parsing, statistics and ratios on synthetic measurements. Without
``--out``, the benchmarks write into a new temporary folder, never into docs/benchmarks.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
# The benchmark lives in the repository, not in the installed package.
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.collectives import worker
from benchmarks.collectives.errors import BackendUnavailable
from benchmarks.collectives.launch import RunResult
from benchmarks.collectives.results import add_ratios, rows_from_run
from benchmarks.collectives.sizes import (
    format_size,
    parse_size,
    scaled_count,
    size_ladder,
)
from benchmarks.collectives.worker import Measurement

QUICK_TIMEOUT_S = 120
QUICK_SIZES = {4, 64 << 10, 1 << 20}
SIZED_OPS = ("all_reduce", "all_gather", "broadcast", "reduce_scatter")
ROW_FIELDS = [
    "backend",
    "op",
    "world_size",
    "size",
    "bytes",
    "iters",
    "warmup",
    "median_us",
    "p10_us",
    "p90_us",
    "min_us",
    "max_us",
    "mean_us",
    "algbw_gbps",
    "busbw_gbps",
    "memcpy_gbps",
    "ratio",
    "ratio_kind",
    "busbw_ratio",
    "latency_ratio",
]


def _run_quick(tmp_path: Path, *extra: str) -> tuple[subprocess.CompletedProcess[str], Any]:
    out = tmp_path / "bench.json"
    # --out: the table and plot go beside the JSON, not into a temporary folder in /tmp.
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.collectives",
            "--quick",
            "--json",
            str(out),
            "--out",
            str(tmp_path),
            *extra,
        ],  # fmt: skip
        check=False,  # the exit status is part of what the tests check
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=QUICK_TIMEOUT_S,
    )
    doc = json.loads(out.read_text()) if out.exists() else None
    return proc, doc


def _check_rows(doc: Any, backend: str) -> list[dict[str, Any]]:
    rows = [r for r in doc["rows"] if r["backend"] == backend]
    for row in rows:
        assert set(ROW_FIELDS) <= set(row), row
        assert row["world_size"] == 2 and row["iters"] == 3
        for key in ("median_us", "p10_us", "p90_us", "min_us", "max_us", "mean_us"):
            assert row[key] > 0, (key, row)
        assert row["min_us"] <= row["p10_us"] <= row["median_us"] <= row["p90_us"] <= row["max_us"]
        if row["op"] == "barrier":
            assert row["busbw_gbps"] is None and row["bytes"] == 0
        else:
            assert row["bytes"] >= row["size"]
            assert row["algbw_gbps"] > 0 and row["busbw_gbps"] > 0 and row["memcpy_gbps"] > 0
    got = {(r["op"], r["size"]) for r in rows}
    want = {(op, size) for op in SIZED_OPS for size in QUICK_SIZES} | {("barrier", 0)}
    assert got == want
    return rows


@pytest.mark.timeout(QUICK_TIMEOUT_S + 30)
def test_quick_gloo(tmp_path: Path) -> None:
    proc, doc = _run_quick(tmp_path, "--backends", "gloo")
    assert proc.returncode == 0, proc.stderr
    assert doc is not None and doc["errors"] == []
    rows = _check_rows(doc, "gloo")
    assert all(r["ratio"] is None for r in rows)  # gloo is the baseline
    assert {m["size"] for m in doc["memcpy"]} == QUICK_SIZES
    assert all(m["gbps"] > 0 for m in doc["memcpy"])
    assert "== all_reduce, world size 2 ==" in proc.stdout
    assert "[gloo n=2] all_reduce" in proc.stderr  # progress goes to stderr


@pytest.mark.timeout(QUICK_TIMEOUT_S + 30)
def test_quick_smddp_against_gloo(tmp_path: Path) -> None:
    proc, doc = _run_quick(tmp_path, "--backends", "gloo,smddp")
    assert proc.returncode == 0, proc.stderr
    assert doc is not None and doc["errors"] == []
    _check_rows(doc, "gloo")
    gloo = {(r["op"], r["size"]): r for r in doc["rows"] if r["backend"] == "gloo"}
    for row in _check_rows(doc, "smddp"):
        assert row["baseline"] == "gloo"
        base = gloo[(row["op"], row["size"])]
        # The ratios are exactly those of the two medians measured in the same run.
        assert row["latency_ratio"] == pytest.approx(row["median_us"] / base["median_us"])
        small = row["op"] == "barrier" or row["size"] < 64 << 10
        assert row["ratio_kind"] == ("latency" if small else "busbw")
        if small:
            assert row["ratio"] == pytest.approx(row["latency_ratio"])
        else:
            assert row["busbw_ratio"] == pytest.approx(row["busbw_gbps"] / base["busbw_gbps"])
            assert row["ratio"] == pytest.approx(row["busbw_ratio"])


@pytest.mark.timeout(60)
def test_unavailable_backend_is_one_clear_line(tmp_path: Path) -> None:
    proc, doc = _run_quick(tmp_path, "--backends", "gloo,nosuch", "--ops", "barrier")
    assert proc.returncode == 1
    assert "backend 'nosuch' is not registered" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert [e["backend"] for e in doc["errors"]] == ["nosuch"]
    assert [r["backend"] for r in doc["rows"]] == ["gloo"]  # the other backend still ran


@pytest.mark.timeout(30)
def test_failing_plugin_import_names_the_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(worker.PLUGIN_MODULES, "smddp", "no_such_module_for_bench_test")
    with pytest.raises(BackendUnavailable) as err:
        worker.load_backend("smddp")
    assert "backend 'smddp' is unavailable: `import no_such_module_for_bench_test` failed" in str(
        err.value
    )


@pytest.mark.timeout(10)
def test_sizes() -> None:
    assert [parse_size(s) for s in ("4", "4B", "64KiB", "1MiB", "1M", "2GiB", "1KB")] == [
        4,
        4,
        64 << 10,
        1 << 20,
        1 << 20,
        2 << 30,
        1000,
    ]
    with pytest.raises(ValueError):
        parse_size("1 parsec")
    assert size_ladder(4, 256 << 20, 4)[-1] == 256 << 20
    assert len(size_ladder(4, 256 << 20, 4)) == 14
    assert size_ladder(1 << 20, 5 << 20, 2) == [1 << 20, 2 << 20, 4 << 20]
    assert format_size(64 << 10) == "64 KiB" and format_size(6) == "6 B"
    assert scaled_count(50, 4, 2 << 30, 3) == 50
    assert scaled_count(50, 256 << 20, 2 << 30, 3) == 8
    assert scaled_count(50, 4 << 30, 2 << 30, 3) == 3
    assert scaled_count(2, 4 << 30, 2 << 30, 3) == 2  # never more than asked for


def _run(backend: str, world: int, samples: dict[int, list[float]]) -> RunResult:
    """A run that measured all_reduce at 1 MiB and 4 B, and a barrier, with ``samples``."""
    measurements = {
        rank: [
            Measurement("all_reduce", 1 << 20, 1 << 20, 1, tuple(samples[rank])),
            Measurement("all_reduce", 4, 4, 1, tuple(samples[rank])),
            Measurement("barrier", 0, 0, 1, tuple(samples[rank])),
        ]
        for rank in range(world)
    }
    return RunResult(backend, world, measurements)


@pytest.mark.timeout(10)
def test_rows_use_slowest_rank_and_nccl_tests_bandwidth() -> None:
    run = _run("gloo", 2, {0: [1e-3, 1e-3, 3e-3], 1: [2e-3, 1e-3, 1e-3]})
    rows = rows_from_run(run, {1 << 20: 10.0, 4: 0.01})
    ar = rows[0]
    # Per-iteration maxima are 2, 1, 3 ms: median 2 ms.
    assert ar.median_us == pytest.approx(2000) and ar.min_us == pytest.approx(1000)
    assert ar.algbw_gbps == pytest.approx((1 << 20) / 2e-3 / 1e9)
    assert ar.busbw_gbps == pytest.approx(ar.algbw_gbps * 2 * (2 - 1) / 2)
    assert ar.memcpy_gbps == 10.0
    assert rows[2].op == "barrier" and rows[2].busbw_gbps is None


@pytest.mark.timeout(10)
def test_ratios_against_baseline() -> None:
    gloo = rows_from_run(_run("gloo", 4, {r: [2e-3] * 3 for r in range(4)}), {})
    smddp = rows_from_run(_run("smddp", 4, {r: [1e-3] * 3 for r in range(4)}), {})
    rows = gloo + smddp
    add_ratios(rows, "gloo")
    assert all(r.ratio is None for r in gloo)
    big, tiny, barrier = smddp
    assert (big.ratio_kind, big.ratio) == ("busbw", pytest.approx(2.0))
    assert (tiny.ratio_kind, tiny.ratio) == ("latency", pytest.approx(0.5))
    assert (barrier.ratio_kind, barrier.ratio) == ("latency", pytest.approx(0.5))
    assert barrier.busbw_ratio is None and big.latency_ratio == pytest.approx(0.5)


@pytest.mark.timeout(60)
def test_plot_writes_png(tmp_path: Path) -> None:
    from benchmarks.collectives.plot import write_plot

    rows = rows_from_run(_run("gloo", 2, {0: [1e-3] * 3, 1: [1e-3] * 3}), {})
    write_plot(str(tmp_path / "busbw.png"), rows, {4: 0.01, 1 << 20: 10.0})
    assert (tmp_path / "busbw.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _paired(*args: str | Path) -> None:
    """Runs the paired benchmark from the repository root; fails the test if it fails."""
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.collectives.paired", *map(str, args)],
        check=False,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=QUICK_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.timeout(QUICK_TIMEOUT_S + 30)
def test_paired_times_both_backends_and_ddp_s_own_share(tmp_path: Path) -> None:
    """The paired benchmark (the README's Speed table) at w=2, one case, a few DDP steps: every
    figure is there, the DDP table has its three rows, the JSON the same figures, the plot a
    PNG; from the JSON alone it writes the same table again."""
    out, md, png = tmp_path / "paired.json", tmp_path / "paired.md", tmp_path / "paired.png"
    _paired(
        *("--world-sizes", "2", "--cases", "all_reduce:4", "--ddp-steps", "2"),
        *("--json", out, "--markdown", md, "--plot", png),
    )
    (run,) = json.loads(out.read_text())["results"]
    case = run["cases"]["all_reduce:4"]
    assert case["smddp"] > 0 and case["gloo"] > 0, case
    # CPU per call, both ranks together: at least some of each op's wall time on one rank.
    cpu = run["cpu"]["all_reduce:4"]
    assert cpu["smddp"] > 0 and cpu["gloo"] > 0, cpu
    assert run["cores"] >= 1
    ddp = run["ddp"]
    assert set(ddp) == {"smddp", "gloo", "no communication"}, ddp
    for figures in ddp.values():
        assert figures["step_s"] > 0 and figures["no_sync_s"] > 0, figures
        assert figures["step_cpu_s"] > 0 and figures["no_sync_cpu_s"] > 0, figures
    table = md.read_text()
    assert "| all_reduce 4 B | " in table, table
    assert table.count("| all_reduce 4 B | ") == 2, table  # times, then CPU
    assert "CPU time per call, all ranks together" in table, table
    for row in ("| smddp | ", "| gloo | ", "| no communication | "):
        assert row in table, table
    assert "beyond it smddp's communication takes" in table, table
    assert "CPU per rank that a synchronised step adds to its no_sync step" in table, table
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    again, again_png = tmp_path / "again.md", tmp_path / "again.png"
    _paired("--from-json", out, "--markdown", again, "--plot", again_png)
    assert again.read_text() == table
    assert again_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _docs_benchmarks() -> dict[str, str]:
    """The tracked figures: file name -> digest of its bytes."""
    folder = REPO / "docs" / "benchmarks"
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}


def _announced(stderr: str, tmp: Path) -> Path:
    """The new temporary folder the benchmark printed (TMPDIR is ``tmp``)."""
    found = re.search(r"^results in (\S+) \(a new temporary folder; --out DIR", stderr, re.M)
    assert found, stderr
    folder = Path(found[1])
    assert folder.parent == tmp, (folder, stderr)
    return folder


@pytest.mark.timeout(QUICK_TIMEOUT_S + 30)
def test_paired_without_out_writes_a_new_temporary_folder_and_with_out_there(
    tmp_path: Path,
) -> None:
    """Without --out the paired benchmark (the README's command) writes paired.json, .md and
    .png into a new temporary folder and prints it; docs/benchmarks keeps its bytes. With --out
    (here from that JSON), the table and the plot go into that folder."""
    docs = _docs_benchmarks()
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.collectives.paired", "--world-sizes", "2",
         "--cases", "all_reduce:4", "--ddp-steps", "0"],
        check=False, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp)},
        capture_output=True, text=True, timeout=QUICK_TIMEOUT_S,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    folder = _announced(proc.stderr, tmp)
    assert sorted(p.name for p in folder.iterdir()) == ["paired.json", "paired.md", "paired.png"]
    (run,) = json.loads((folder / "paired.json").read_text())["results"]
    assert run["cases"]["all_reduce:4"]["smddp"] > 0, run
    assert "| all_reduce 4 B | " in (folder / "paired.md").read_text()
    assert (folder / "paired.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert _docs_benchmarks() == docs

    chosen = tmp_path / "chosen"
    _paired("--from-json", folder / "paired.json", "--out", chosen)
    assert sorted(p.name for p in chosen.iterdir()) == ["paired.md", "paired.png"]
    assert (chosen / "paired.md").read_text() == (folder / "paired.md").read_text()
    assert sorted(p.name for p in tmp.iterdir()) == [folder.name]  # no second temporary folder


@pytest.mark.timeout(QUICK_TIMEOUT_S + 30)
def test_collectives_without_out_writes_a_new_temporary_folder(tmp_path: Path) -> None:
    """``python -m benchmarks.collectives`` without --out: collectives.json, .txt (the table it
    printed) and .png in a new temporary folder, printed; docs/benchmarks keeps its bytes."""
    docs = _docs_benchmarks()
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.collectives", "--quick", "--backends", "gloo",
         "--ops", "all_reduce", "--max-bytes", "64KiB"],
        check=False, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp)},
        capture_output=True, text=True, timeout=QUICK_TIMEOUT_S,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    folder = _announced(proc.stderr, tmp)
    names = ["collectives.json", "collectives.png", "collectives.txt"]
    assert sorted(p.name for p in folder.iterdir()) == names
    doc = json.loads((folder / "collectives.json").read_text())
    assert doc["errors"] == [] and {r["op"] for r in doc["rows"]} == {"all_reduce"}, doc
    assert (folder / "collectives.txt").read_text() == proc.stdout
    assert (folder / "collectives.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert _docs_benchmarks() == docs
