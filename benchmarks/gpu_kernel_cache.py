"""Builds (or checks) the prepared kernel cache the GPU check's daemons read before compiling.

``python -m benchmarks.gpu_kernel_cache [--arch sm_90] [--worlds 2,3,4,8] [--check]``

Every module GPU ops of those world sizes can ask for (``gpu_kernels.module_keys``, the code
the daemon's ``_prepare`` uses) is compiled for ``--arch`` by NVRTC with the daemon's own
options (``gpu_runtime.compile_module``: CuPy's NVRTC bindings, no GPU needed), in parallel
threads, into one zip archive ``benchmarks/kernel_cache/<arch>-cuda<major>.zip`` whose
members are named by ``gpu_runtime.prepared_entry`` (kernel name and a digest of its source
and options). The archive is deterministic (sorted members, fixed dates), so rebuilding
from unchanged kernels changes no byte. A daemon started with ``SMDDP_KERNEL_CACHE`` naming
the folder loads these cubins instead of compiling (0.3 s each, ~500 of them for the
check's worlds); a member missing or stale is compiled as before.

``--check`` builds nothing: it lists the keys the archive lacks (exit 1 if any), what the
test and the check's environment stage report.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

FOLDER = Path(__file__).resolve().parent / "kernel_cache"
ARCH = "sm_90"  # the H100 and H200
WORLDS = (2, 3, 4, 8)
CUDA_MAJOR = 13  # the lent machine's torch (cu130), CuPy (cupy-cuda13x) and NVRTC
MANIFEST = "MANIFEST.json"
# Fixed member dates: the same kernels give the same archive bytes.
_DATE = (2020, 1, 1, 0, 0, 0)


def archive_path(folder: Path = FOLDER, arch: str = ARCH, cuda_major: int = CUDA_MAJOR) -> Path:
    """Where the archive of ``arch`` and ``cuda_major`` lies."""
    from smddp.server.gpu_runtime import archive_name

    return folder / archive_name(arch, cuda_major)


def missing(
    worlds: tuple[int, ...] = WORLDS,
    folder: Path = FOLDER,
    arch: str = ARCH,
    cuda_major: int = CUDA_MAJOR,
) -> list[tuple[int, int, int, int]]:
    """The keys of ``worlds`` whose current cubin (by source digest) the archive lacks."""
    from smddp.server import gpu_kernels
    from smddp.server.gpu_runtime import PreparedKernels, prepared_entry

    have = PreparedKernels([str(folder)]).members(arch, cuda_major)
    return [k for k in gpu_kernels.module_keys(worlds) if prepared_entry(k, arch) not in have]


def build(
    worlds: tuple[int, ...], folder: Path, arch: str, threads: int
) -> tuple[Path, int, float]:
    """Compiles every key of ``worlds`` for ``arch`` and writes the archive; returns its path,
    the number of modules and the seconds the compiles took.

    Raises:
        CudaCallError: NVRTC refused a module.
        ImportError: CuPy (NVRTC's bindings) is not installed here.
    """
    import cupy

    from smddp.server import gpu_kernels
    from smddp.server.gpu_runtime import NVRTC_OPTIONS, compile_module, prepared_entry

    keys = gpu_kernels.module_keys(worlds)
    major, minor = cupy.cuda.nvrtc.getVersion()
    start = time.monotonic()
    with ThreadPoolExecutor(max(1, threads)) as pool:
        cubins = list(pool.map(lambda k: compile_module(cupy, *k, arch=arch), keys))
    took = time.monotonic() - start
    folder.mkdir(parents=True, exist_ok=True)
    path = archive_path(folder, arch, major)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
        entries = sorted(zip((prepared_entry(k, arch) for k in keys), cubins))
        for name, cubin in entries:
            z.writestr(zipfile.ZipInfo(name, _DATE), cubin, zipfile.ZIP_DEFLATED, 9)
        manifest = {
            "arch": arch,
            "nvrtc": f"{major}.{minor}",
            "options": list(NVRTC_OPTIONS),
            "worlds": list(worlds),
            "modules": len(keys),
            "built_by": "python -m benchmarks.gpu_kernel_cache",
        }
        z.writestr(zipfile.ZipInfo(MANIFEST, _DATE), json.dumps(manifest, indent=1) + "\n")
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(buf.getvalue())
    os.replace(tmp, path)
    return path, len(keys), took


def main(argv: list[str] | None = None) -> int:
    """Builds the archive, or with ``--check`` reports what it lacks."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default=ARCH, help=f"GPU architecture (default {ARCH})")
    parser.add_argument(
        "--worlds", default=",".join(map(str, WORLDS)), help="world sizes (default 2,3,4,8)"
    )
    parser.add_argument("--folder", default=str(FOLDER), help="where the archive goes")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--check", action="store_true", help="report missing keys, build none")
    args = parser.parse_args(argv)
    worlds = tuple(int(w) for w in args.worlds.split(","))
    folder = Path(args.folder)
    if args.check:
        lacking = missing(worlds, folder, args.arch)
        from smddp.server import gpu_kernels

        total = len(gpu_kernels.module_keys(worlds))
        print(
            f"kernel cache {archive_path(folder, args.arch)}: {total - len(lacking)} of "
            f"{total} modules of worlds {args.worlds} for {args.arch} current"
        )
        for key in lacking[:20]:
            print(f"  missing or stale: {gpu_kernels.kernel_name(*key, False)}")
        return 1 if lacking else 0
    path, n, took = build(worlds, folder, args.arch, args.threads)
    size = path.stat().st_size
    print(
        f"kernel cache: {n} modules for {args.arch} compiled in {took:.1f} s "
        f"({args.threads} threads) into {path} ({size / 1024:.0f} KiB)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
