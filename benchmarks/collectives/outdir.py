"""Where a benchmark's result files go: the folder ``--out`` names, else a new temporary one.

A run without ``--out`` must not touch the figures kept in the repository: the tracked files
under ``docs/benchmarks/`` are refreshed only when a run is asked to (``--out docs/benchmarks``).
A file's own flag (``--json PATH``, ``--plot PATH``, ...) still sends that one file elsewhere.
The temporary folder is made only when a file goes there, and its path is printed.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

OUT_HELP = (
    "folder for the result files, made if missing (default: a new temporary folder, printed); "
    "--out docs/benchmarks refreshes the figures kept in the repository"
)


def matplotlib_installed() -> bool:
    """True where the optional plot can be drawn."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


class OutFolder:
    """The result folder of one run: ``--out``'s, or a temporary one made on first use."""

    def __init__(self, out: str | None, prefix: str) -> None:
        """
        Args:
            out: ``--out``'s value, or None for a new temporary folder.
            prefix: the temporary folder's name prefix, e.g. ``smddp-bench-paired-``.
        """
        self._out = out
        self._prefix = prefix
        self._folder: Path | None = None
        self.written: list[str] = []

    def folder(self) -> Path:
        """The folder, made now if it does not exist yet."""
        if self._folder is None:
            if self._out is None:
                self._folder = Path(tempfile.mkdtemp(prefix=self._prefix))
            else:
                self._folder = Path(self._out)
                self._folder.mkdir(parents=True, exist_ok=True)
        return self._folder

    def path(self, name: str, explicit: str | None = None) -> str:
        """Where the file ``name`` goes: ``explicit`` (its own flag) if given, else the folder."""
        path = explicit if explicit else str(self.folder() / name)
        self.written.append(path)
        return path

    def announce(self) -> None:
        """Prints (to stderr) where this run's files went."""
        if not self.written:
            return
        folder = str(self._folder) if self._folder is not None else None
        # A file in the folder by its name; one that its own flag sent elsewhere by its path.
        names = ", ".join(
            p[len(folder) + 1 :] if folder and p.startswith(folder + "/") else p
            for p in self.written
        )
        if self._out is None and folder is not None:
            print(
                f"results in {folder} (a new temporary folder; --out DIR writes them "
                f"elsewhere, --out docs/benchmarks refreshes the figures kept in the "
                f"repository): {names}",
                file=sys.stderr,
                flush=True,
            )
        elif folder is not None:
            print(f"results in {folder}: {names}", file=sys.stderr, flush=True)
        else:
            print(f"wrote {names}", file=sys.stderr, flush=True)
