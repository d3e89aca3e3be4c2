"""The GPU check's stages, each run by ``benchmarks/gpu_check.py`` as its own process under
its own cap: ``python -m benchmarks.gpu_check_stages STAGE``.

- ``env``: versions (Python, torch, CUDA, CuPy, NVRTC, grpcio, protobuf), whether smddp's
  backend takes this torch, the prepared kernel cache's coverage, and whether a fresh tensor
  can be exported by CUDA IPC (smddp's own exporter) -> ``env.txt``;
- ``smoke``: one daemon, 2 ranks, a checked all_reduce and broadcast on GPU tensors;
- ``probes`` (after a failed smoke): the GPU path's pieces one at a time, each in a child
  process under its own short limit, so a hang names itself: IPC mapping across processes
  (the child maps the rank's allocation and copies within it), a cross-process event (the
  child's stream waits on the rank's event), and the host-flag wait (``cuStreamWaitValue32``
  on pinned host memory, the daemon's gate) -> ``probes.txt``;
- ``seed``: ``benchmarks/gpu_seed.py`` (the SageMaker-style script) under torchrun, 2 ranks
  on 1 node, then 2 "nodes" (two daemons with distinct SMDDP_NODE_IDs over loopback, one
  torchrun per node) -> ``seed.txt``;
- ``speed``: ``benchmarks/gpu_speed.py`` for W = 2 and 4 -> ``speed.md``, ``speed.json``.

Each writes its verdict (``gpu_check_common.write_verdict``) for the summary line. On the
fake GPU (``--fake-gpu``) they run the same code with small sizes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from benchmarks.gpu_check_common import (
    REPO,
    Daemon,
    Gpu,
    deadline,
    fake_gpu,
    free_port,
    kernel_sources,
    quick,
    rank_env,
    run_ranks,
    scratch,
    start_daemon,
    write_verdict,
)

OUT_ENV = "SMDDP_CHECK_OUT"
SMOKE_MARK = "SMOKE_RESULT "
SEED_MARK = "SEED_RESULT "


def out_file(name: str) -> Path:
    """A result file directly in OUT (at most 8 in all: gpu_check.py owns the list)."""
    return Path(os.environ.get(OUT_ENV) or scratch()) / name


def left_s() -> float:
    """Seconds until the stage's cap."""
    return deadline() - time.time()


# -- env -------------------------------------------------------------------------------------


def stage_env() -> int:
    lines: list[str] = []
    problems: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    import importlib.metadata as md

    say(f"python {sys.version.split()[0]} at {sys.executable}")
    import torch

    say(f"torch {torch.__version__} (CUDA {torch.version.cuda})")
    try:
        from smddp.backend.version import check_torch

        check_torch()
        say("smddp's backend takes this torch")
    except Exception as exc:
        problems.append(f"smddp's backend refuses torch {torch.__version__}: {exc}")
    for dist in ("grpcio", "grpcio-health-checking", "protobuf", "numpy", "ml-dtypes"):
        try:
            say(f"{dist} {md.version(dist)}")
        except md.PackageNotFoundError:
            problems.append(f"{dist} is not installed")
    import smddp

    say(f"smddp from {Path(smddp.__file__).parent}")
    if fake_gpu():
        say("GPU: the FAKE GPU of the dry run (tests/gpu/fake_device.py); no CUDA here")
    else:
        if not torch.cuda.is_available():
            problems.append("torch sees no GPU")
        else:
            n = torch.cuda.device_count()
            names = ", ".join(torch.cuda.get_device_name(i) for i in range(n))
            cc = torch.cuda.get_device_capability(0)
            say(f"GPUs: {n}: {names}; compute capability {cc[0]}.{cc[1]}")
        try:
            import cupy

            say(
                f"cupy {cupy.__version__}, CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()}, "
                f"driver {cupy.cuda.runtime.driverGetVersion()}, NVRTC "
                f"{'.'.join(map(str, cupy.cuda.nvrtc.getVersion()))}"
            )
            with open("/proc/self/maps") as maps:
                libs = sorted({x.split()[-1] for x in maps if "libnvrtc" in x})
            say(f"NVRTC library: {', '.join(libs) or '(not loaded yet)'}")
        except Exception as exc:
            problems.append(f"CuPy or NVRTC unusable: {type(exc).__name__}: {exc}")
    # The prepared kernels: what the daemons will load instead of compiling.
    from benchmarks import gpu_kernel_cache as kc
    from smddp.server import gpu_kernels

    total = len(gpu_kernels.module_keys(kc.WORLDS))
    lacking = kc.missing()
    say(
        f"prepared kernel cache {kc.archive_path()}: {total - len(lacking)} of {total} modules "
        f"(worlds {kc.WORLDS}, {kc.ARCH}) current; the rest compile on first use, in parallel"
    )
    say(f"SMDDP_KERNEL_CACHE={os.environ.get('SMDDP_KERNEL_CACHE', '')}")
    # A fresh tensor exported by CUDA IPC, as every GPU op does.
    try:
        from smddp.backend.cuda import device_api
        from smddp.client.cuda_ipc import IpcExporter

        gpu = Gpu(0)
        t = gpu.empty(1 << 20, torch.float32)
        api = device_api()
        exporter = IpcExporter() if api.driver is None else IpcExporter(lambda: api.driver)
        buf = exporter.export(t.data_ptr(), 4 << 20, gpu.index, "the environment check")
        say(f"CUDA IPC export of a fresh 4 MiB tensor: a handle of {len(buf.ipc_handle)} bytes, ok")
    except Exception as exc:
        problems.append(f"a fresh tensor cannot be exported by CUDA IPC: {exc}")
    for p in problems:
        say(f"PROBLEM: {p}")
    out_file("env.txt").write_text("\n".join(lines) + "\n")
    if problems:
        write_verdict("env", "FAIL", problems[0])
        return 1
    write_verdict("env", "PASS", f"kernel cache {total - len(lacking)}/{total}")
    return 0


# -- smoke -----------------------------------------------------------------------------------


def smoke_rank() -> None:
    """One rank of the smoke op: all_reduce and broadcast on GPU tensors, checked."""
    import torch
    import torch.distributed as dist

    import smddp  # noqa: F401  (registers the backend)

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    gpu = Gpu(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("smddp")
    out: dict[str, Any] = {"rank": rank}
    n = 1 << 16
    x = gpu.tensor(torch.arange(n, dtype=torch.float32) + rank)
    t0 = time.perf_counter()
    dist.all_reduce(x)
    gpu.sync()
    out["all_reduce_s"] = time.perf_counter() - t0
    want = torch.arange(n, dtype=torch.float32) * world + sum(range(world))
    out["all_reduce_ok"] = bool(torch.equal(x.cpu(), want))
    y = gpu.tensor(torch.full((n,), float(rank + 7)))
    t0 = time.perf_counter()
    dist.broadcast(y, src=1)
    gpu.sync()
    out["broadcast_s"] = time.perf_counter() - t0
    out["broadcast_ok"] = bool(torch.equal(y.cpu(), torch.full((n,), 8.0)))
    dist.destroy_process_group()
    print(SMOKE_MARK + json.dumps(out), flush=True)


def stage_smoke() -> int:
    d = start_daemon("smoke")
    try:
        port = free_port()
        cmd = [sys.executable, "-m", "benchmarks.gpu_check_stages", "smoke-rank"]
        run = run_ranks([cmd, cmd], [rank_env(r, 2, port, d) for r in range(2)], left_s() - 3)
    finally:
        d.stop()
    results = run.results(SMOKE_MARK)
    if not run.ok or not all(r for r in results):
        print(run.why(), flush=True)
        print(f"--- smddpd log\n{d.log()[-3000:]}", flush=True)
        first = next((x for x in run.why().splitlines() if "Error" in x), run.why()[:200])
        write_verdict("smoke", "FAIL", f"ranks did not finish: {first.strip()[:200]}")
        return 1
    bad = [
        f"rank {r['rank']} {what} wrong"
        for r in results
        for what in ("all_reduce", "broadcast")
        if not r[f"{what}_ok"]
    ]
    timing = ", ".join(
        f"{what} {max(r[f'{what}_s'] for r in results) * 1e3:.0f} ms"
        for what in ("all_reduce", "broadcast")
    )
    print(f"smoke: {timing} (first ops: handles opened, kernels loaded)", flush=True)
    if bad:
        write_verdict("smoke", "FAIL", "; ".join(bad))
        return 1
    write_verdict("smoke", "PASS", f"2 ranks, checked all_reduce and broadcast ({timing})")
    return 0


# -- probes ----------------------------------------------------------------------------------


def _runtime() -> Any:
    """The daemon's runtime: CuPy's, or on the fake GPU the tests' blocking fake."""
    if fake_gpu():
        from benchmarks.gpu_check_fake import _fakes

        return _fakes().ipc_queued_runtime()
    from smddp.server.gpu_runtime import CupyRuntime

    return CupyRuntime()


def _wait_done(rt: Any, event: Any, timeout_s: float) -> float | None:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if rt.event_done(event, 0):
            return time.monotonic() - start
        time.sleep(0.001)
    return None


def probe_child(what: str, handle_hex: str, nbytes: int, offset: int) -> None:
    """The daemon's side of one probe (a process of its own, as the daemon is)."""
    rt = _runtime()
    stream = rt.new_stream(0)
    done = rt.new_event(0)
    if what == "ipc":
        base = rt.open_memory(bytes.fromhex(handle_hex), 0)
        address, half = base + offset, nbytes // 2
        rt.copy(stream, 0, address + half, address, half)
        rt.record_event(done, stream, 0)
        took = _wait_done(rt, done, 10)
        rt.close_memory(base, 0)
        if took is None:
            raise SystemExit("a copy within the mapped allocation did not finish within 10 s")
        print(
            f"PROBE mapped the rank's {nbytes} bytes and copied within them in {took * 1e3:.1f} ms"
        )
    elif what == "event":
        event = rt.open_event(bytes.fromhex(handle_hex), 0)
        rt.wait_event(stream, event, 0)
        rt.record_event(done, stream, 0)
        took = _wait_done(rt, done, 10)
        if took is None:
            raise SystemExit("the stream never passed the rank's event (10 s)")
        print(f"PROBE the stream passed the rank's event after {took * 1e3:.1f} ms")
    elif what == "flag":
        flag = rt.new_flag(0)
        rt.wait_flag(stream, flag, 1, 0)
        rt.record_event(done, stream, 0)
        time.sleep(0.3)
        early = rt.event_done(done, 0)
        rt.set_flag(flag, 1)
        took = _wait_done(rt, done, 10)
        if early:
            raise SystemExit("the stream passed cuStreamWaitValue32 before the flag was set")
        if took is None:
            raise SystemExit("the stream did not pass cuStreamWaitValue32 within 10 s of the set")
        print(f"PROBE host-flag wait released {took * 1e3:.2f} ms after the host wrote the flag")
    else:
        raise SystemExit(f"unknown probe {what}")


def stage_probes() -> int:
    import torch

    from smddp.backend.cuda import device_api
    from smddp.client.cuda_ipc import IpcExporter

    lines: list[str] = []
    failed: list[str] = []
    gpu = Gpu(0)
    api = device_api()

    def child(what: str, handle: bytes = b"", nbytes: int = 0, offset: int = 0) -> tuple[bool, str]:
        cmd = [sys.executable, "-m", "benchmarks.gpu_check_stages", "probe-child", what]
        cmd += [handle.hex() or "-", str(nbytes), str(offset)]
        limit = max(5.0, min(20.0, left_s() - 5))
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=limit)
        except subprocess.TimeoutExpired as exc:
            return False, f"HUNG: no answer within {limit:.0f} s ({str(exc.stdout or '')[-300:]})"
        text = (done.stdout + done.stderr).strip()
        return done.returncode == 0, text[-600:]

    def record(name: str, ok: bool, text: str) -> None:
        line = f"{name}: {'ok' if ok else 'FAILED'}: {text}"
        print(line, flush=True)
        lines.append(line)
        if not ok:
            failed.append(name)

    # 1. IPC mapping across processes: the child copies the first half into the second.
    n = 1 << 18
    t = gpu.tensor(torch.arange(n, dtype=torch.int32))
    gpu.sync()
    exporter = IpcExporter() if api.driver is None else IpcExporter(lambda: api.driver)
    buf = exporter.export(t.data_ptr(), n * 4, gpu.index, "the IPC probe")
    ok, text = child("ipc", buf.ipc_handle, n * 4, buf.offset)
    if ok:
        gpu.sync()
        host = t.cpu()
        ok = bool(torch.equal(host[n // 2 :], torch.arange(n // 2, dtype=torch.int32)))
        text += "" if ok else "; the rank does not see the child's copy"
    record("IPC mapping across processes", ok, text)
    # 2. A cross-process event: recorded by the rank after ~50 ms of GPU work.
    event = api.event(gpu.index)
    if gpu.fake is None:
        torch.cuda._sleep(50_000_000)  # ~25-50 ms of GPU clock cycles
    event.record(api.current_stream(gpu.index))
    ok, text = child("event", event.ipc_handle())
    record("cross-process event", ok, text)
    # 3. The host-flag wait of the daemon's gate.
    ok, text = child("flag")
    record("host-flag wait (cuStreamWaitValue32 on host memory)", ok, text)
    out_file("probes.txt").write_text("\n".join(lines) + "\n")
    if failed:
        write_verdict("probes", "FAIL", "failed: " + ", ".join(failed))
        return 1
    write_verdict("probes", "PASS", "IPC mapping, cross-process event, host-flag wait all ok")
    return 0


# -- seed ------------------------------------------------------------------------------------


def _torchrun(
    nnodes: int, node_rank: int, nproc: int, port: int, daemon: Daemon, node_id: str, ckpt: Path
) -> tuple[list[str], dict[str, str]]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        f"--node-rank={node_rank}",
        f"--nproc-per-node={nproc}",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
        # Else torchrun makes /tmp/torchelastic_* for its logs and never removes it.
        f"--log-dir={scratch() / f'torchrun-logs-{node_rank}'}",
        str(REPO / "benchmarks" / "gpu_seed.py"),
        "--epochs",
        "2" if fake_gpu() or quick() else "3",
        "--model-dir",
        str(ckpt),
        "--samples",
        "512" if fake_gpu() else "2048",
    ]
    env = dict(
        os.environ,
        SMDDP_SOCKET=daemon.socket,
        SMDDP_EMBEDDED="0",
        SMDDP_NODE_ID=node_id,
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="2",
    )
    return cmd, env


def _seed_verdict(run: Any, what: str, lines: list[str], ckpt: Path) -> tuple[str, str]:
    results = [r for text in run.outputs for r in _seed_results(text)]
    if not run.ok or len(results) != 2:
        why = run.why(2500)
        lines.append(f"{what}: FAILED\n{why}")
        # The exception's own line (e.g. "smddp.client.errors.UnsupportedError: ..."), not
        # torchrun's report of its child.
        causes = re.findall(r"\b(\w+(?:Error|Exception): .+)", why)
        causes = [c for c in causes if not c.startswith("ChildFailedError")]
        cause = causes[0] if causes else (why.strip().splitlines() or ["no output"])[-1]
        return "FAIL", cause[:240]
    same = all(r["identical"] for r in results)
    learned = all(r["loss_last"] < r["loss_first"] for r in results)
    saved = (ckpt / "model.pt").exists()
    step = max(r["step_s"] for r in results)
    text = (
        f"2 ranks trained {results[0]['steps']} steps, loss {results[0]['loss_first']:.3f} -> "
        f"{results[0]['loss_last']:.3f}, parameters {'identical' if same else 'DIFFER'}, "
        f"checkpoint {'saved' if saved else 'MISSING'}, {step * 1e3:.1f} ms/step"
    )
    lines.append(f"{what}: {text}")
    return ("PASS" if same and learned and saved else "FAIL"), text


def _seed_results(text: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        at = line.find(SEED_MARK)
        if at >= 0:
            out.append(json.loads(line[at + len(SEED_MARK) :]))
    return out


def stage_seed() -> int:
    lines: list[str] = []
    verdicts: dict[str, tuple[str, str]] = {}
    half = (left_s() - 10) / 2
    # 1 node: one daemon, one torchrun of 2 ranks (both on GPU local_rank % device_count).
    d = start_daemon("seed-1node", node_id="node0")
    try:
        ckpt = scratch() / "seed-1node"
        cmd, env = _torchrun(1, 0, 2, free_port(), d, "node0", ckpt)
        run = run_ranks([cmd], [env], half)
        verdicts["1 node"] = _seed_verdict(run, "1 node x 2 ranks", lines, ckpt)
    finally:
        d.stop()
    print(lines[-1], flush=True)
    if verdicts["1 node"][0] != "PASS":
        lines.append(f"--- smddpd log (1 node)\n{d.log()[-2000:]}")
    # 2 "nodes": two daemons, distinct SMDDP_NODE_IDs, one torchrun per node, 1 rank each.
    daemons = []
    try:
        daemons = [start_daemon(f"seed-node{i}", node_id=f"node{i}") for i in range(2)]
        ckpt = scratch() / "seed-2nodes"
        port = free_port()
        pairs = [_torchrun(2, i, 1, port, daemons[i], f"node{i}", ckpt) for i in range(2)]
        run = run_ranks([c for c, _ in pairs], [e for _, e in pairs], max(10.0, left_s() - 5))
        verdicts["2 nodes"] = _seed_verdict(run, "2 nodes x 1 rank", lines, ckpt)
    except RuntimeError as exc:
        verdicts["2 nodes"] = ("FAIL", str(exc).splitlines()[0])
    finally:
        for daemon in daemons:
            daemon.stop()
    print(lines[-1], flush=True)
    sources = kernel_sources(d.log())
    if sources:
        lines.append(f"kernels of the 1-node daemon: {sources}")
    out_file("seed.txt").write_text("\n".join(lines) + "\n")
    verdict = "PASS" if all(v == "PASS" for v, _ in verdicts.values()) else "FAIL"
    detail = "; ".join(f"{k}: {v} ({t})" for k, (v, t) in verdicts.items())
    write_verdict("seed", verdict, detail, nodes={k: v for k, (v, _) in verdicts.items()})
    return 0 if verdict == "PASS" else 1


# -- speed -----------------------------------------------------------------------------------


def stage_speed() -> int:
    from benchmarks import gpu_speed

    return gpu_speed.drive(out_file("speed.md"), out_file("speed.json"))


STAGES = {
    "env": stage_env,
    "smoke": stage_smoke,
    "probes": stage_probes,
    "seed": stage_seed,
    "speed": stage_speed,
}


def main(argv: list[str]) -> int:
    """``STAGE``, or a stage's helper: ``smoke-rank``, ``probe-child WHAT HANDLE NBYTES OFFSET``."""
    if argv[0] == "smoke-rank":
        smoke_rank()
        return 0
    if argv[0] == "probe-child":
        probe_child(argv[1], "" if argv[2] == "-" else argv[2], int(argv[3]), int(argv[4]))
        return 0
    stage = argv[0]
    try:
        return STAGES[stage]()
    except Exception as exc:
        traceback.print_exc()
        write_verdict(stage, "FAIL", f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
