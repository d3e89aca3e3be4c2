#!/usr/bin/env bash
# Runs mypy (pyproject.toml's [tool.mypy]) over the package's own source files, in place.
#
# Why a tree of links: pyproject's package-dir maps server/ to smddp.server, client/ to
# smddp.client, protos/smddp/v1 to smddp.v1 and so on, and the editable install reaches them
# through an import hook that mypy cannot follow. So this script mirrors package-dir as
# symlinks under build/typecheck/ (ignored by git, rebuilt on every run so that it never goes
# stale), checks that tree, and writes every path in mypy's report back as the real file's path
# (server/daemon.py, not build/typecheck/smddp/server/daemon.py), one a developer can open.
# Extra arguments go to mypy.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python - "$@" <<'PY'
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

root = Path.cwd()
tree = root / "build" / "typecheck"
package_dir = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"][
    "package-dir"
]
shutil.rmtree(tree, ignore_errors=True)
for package, source in package_dir.items():
    target = tree.joinpath(*package.split("."))
    target.mkdir(parents=True, exist_ok=True)
    # Every entry of the source folder, except a sub-folder that package-dir maps itself.
    for entry in sorted((root / source).iterdir()):
        if entry.name == "__pycache__" or f"{package}.{entry.name}" in package_dir:
            continue
        if entry.is_dir() or entry.suffix in (".py", ".pyi"):
            (target / entry.name).symlink_to(entry)
tops = sorted({package.split(".")[0] for package in package_dir})
proc = subprocess.Popen(
    [sys.executable, "-m", "mypy", "--config-file", "pyproject.toml", *sys.argv[1:],
     *(str(tree / top) for top in tops)],
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
)
assert proc.stdout is not None
prefix = str(tree.relative_to(root)) + os.sep
for line in proc.stdout:
    path, sep, rest = line.partition(":")
    if sep and path.startswith(prefix):
        line = os.path.relpath(os.path.realpath(path), root) + sep + rest
    sys.stdout.write(line)
sys.exit(proc.wait())
PY
