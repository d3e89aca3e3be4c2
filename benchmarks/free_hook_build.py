"""How long the first GPU op of a process waits for the close-before-free hook to be built.

Prints, in seconds: a cold build (an empty cache), a warm load (a cache hit: the digest
computed, the library found and loaded), and RANKS processes starting their build at the same
moment on one empty cache, with how many of them ran the compiler (the file lock beside the
output makes it one).

With a CUDA build of torch this is exactly what a rank does (``cuda_free_hook.build_hook``:
compiled and linked against torch's libc10_cuda, then loaded). With a CPU wheel (as here,
without a GPU) it compiles the same sources with the same flags against torch's c10/cuda
headers and the CUDA toolkit's, and links them without libc10_cuda (a shared library may
leave names unresolved); the warm load then loads the channel's own library, since the hook's
cannot resolve torch's allocator without a CUDA torch.

    .venv/bin/python benchmarks/free_hook_build.py [--ranks 4]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from smddp.backend import cuda_free_hook


def _cuda_include() -> str:
    """The CUDA toolkit's include folder: build_hook's choice, else CUDA_HOME's, else
    /usr/local/cuda's (a CPU wheel's cpp_extension looks for no toolkit)."""
    from torch.utils import cpp_extension

    for home in (cpp_extension.CUDA_HOME, os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        found = cuda_free_hook._cuda_headers(home)
        if found is not None:
            return found
    sys.exit("no cuda_runtime_api.h (set CUDA_HOME): the hook cannot be built here")


def _build_args() -> tuple[list[str], list[str], list[str], list[str]]:
    """include_dirs, library_dirs, libraries, defines: those of build_hook where torch has
    CUDA, else the same without libc10_cuda (and the define a CPU wheel's headers need)."""
    import torch
    from torch.utils import cpp_extension

    includes = [*cpp_extension.include_paths(), _cuda_include()]
    if torch.version.cuda:
        lib_dirs = [os.path.join(os.path.dirname(torch.__file__), "lib")]
        return includes, lib_dirs, ["c10_cuda", "c10"], []
    torch_include = Path(torch.__file__).parent / "include"
    defines = []
    if not (torch_include / "c10/cuda/impl/cuda_cmake_macros.h").exists():
        defines.append("C10_CUDA_NO_CMAKE_CONFIGURE_FILE")
    return includes, [], [], defines


_ONE_BUILD = """
import json, sys, time
from pathlib import Path
from smddp.backend import cuda_free_hook
print("ready", flush=True)
sys.stdin.readline()  # "go": every process is imported and waiting
args = json.loads(sys.argv[1])
t = time.monotonic()
cuda_free_hook.compile_library(cuda_free_hook.HOOK_SOURCES, Path(sys.argv[2]), *args)
print(time.monotonic() - t, flush=True)
"""


def _at_once(ranks: int, args: object, caches: list[Path], cxx: str, tmp: Path) -> None:
    """Starts ``ranks`` builds at the same moment, rank i on ``caches[i % len(caches)]``;
    prints their times and how often the compiler ran."""
    count = tmp / f"compiles-{len(caches)}"
    wrapper = tmp / f"cxx-{len(caches)}"
    wrapper.write_text(f'#!/bin/sh\necho x >> "{count}"\nexec "{shutil.which(cxx) or cxx}" "$@"\n')
    wrapper.chmod(0o755)
    env = dict(os.environ, CXX=str(wrapper))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _ONE_BUILD, json.dumps(args), str(caches[i % len(caches)])],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(ranks)
    ]
    for p in procs:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    times = [float(p.communicate(timeout=600)[0]) for p in procs]
    compiles = len(count.read_text().splitlines()) if count.exists() else 0
    where = "one cache (the lock)" if len(caches) == 1 else "a cache each (as without the lock)"
    print(
        f"{ranks} processes building at once, {where}: slowest {max(times):.2f} s, "
        f"fastest {min(times):.2f} s; the compiler ran {compiles} time(s)"
    )


def main() -> None:
    """Runs the three measurements and prints them."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4, help="processes building at once")
    opts = parser.parse_args()
    import torch

    args = _build_args()
    cxx = os.environ.get("CXX") or shutil.which("c++") or "g++"
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    cuda = torch.version.cuda or "none"
    print(f"torch {torch.__version__} (CUDA {cuda}); {version.splitlines()[0]}")
    print(f"cores: {os.cpu_count()}, load average: {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cold"
        start = time.monotonic()
        built = cuda_free_hook.compile_library(cuda_free_hook.HOOK_SOURCES, cache, *args)
        cold = time.monotonic() - start
        print(f"cold build (compile + link, empty cache): {cold:.2f} s")
        channel = cuda_free_hook.compile_library(cuda_free_hook.CHANNEL_SOURCES, cache)
        start = time.monotonic()
        again = cuda_free_hook.compile_library(cuda_free_hook.HOOK_SOURCES, cache, *args)
        ctypes.CDLL(str(again if torch.version.cuda else channel))
        warm = time.monotonic() - start
        assert again == built
        loaded = "the hook" if torch.version.cuda else "the channel's library"
        print(f"warm load (cache hit, digest of the sources, {loaded} loaded): {warm * 1e3:.1f} ms")

        # RANKS processes at once; a CXX wrapper counts the compiler runs.
        _at_once(opts.ranks, args, [Path(tmp) / "shared"], cxx, Path(tmp))
        own = [Path(tmp) / f"own{i}" for i in range(opts.ranks)]
        _at_once(opts.ranks, args, own, cxx, Path(tmp))


if __name__ == "__main__":
    main()
