"""The README's commands, and those of the pages under docs/, run as written.

Shell blocks that a reader is meant to run carry a marker on the line before them:
``<!-- test: run -->`` (any user) or ``<!-- test: run as root -->``. Each is run here with bash
(``-euo pipefail``), with a timeout: the quick start in the checkout itself (it runs
scripts/setup.sh, which installs this checkout), the others in a temporary copy of the
checkout that shares its ``.venv``, since they write files (the example's checkpoint). The block
for root runs in a private mount and network namespace with a tmpfs on /run, so that its
``/run/smddp`` socket and default ports are its own. Every shell block, marked or not, must
name the venv's programs (``.venv/bin/...``) or another explicit path, never a bare
``python``/``torchrun``/``pip``/``smddpd``/``smddpctl``. The README's sections that grew long
live as pages under docs/ (linked from it): their blocks are read, checked and run the same way.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
# The README and the pages it links to: where a reader finds commands to run.
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]
MARKER = re.compile(r"^(?P<indent>\s*)<!-- test: (?P<how>run|run as root) -->\s*$")
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>\S*)\s*$")
# python3 is the system's (it makes the venvs); python, pip and the rest exist only in a venv.
BARE = {"python", "torchrun", "pip", "smddpd", "smddpctl"}
RUN_TIMEOUT_S = 900


def shell_blocks() -> list[tuple[str | None, tuple[Path, int], str]]:
    """Every ```sh block of the README and of the pages under docs/: (marker or None,
    (page, line number), dedented text)."""
    blocks = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        where = page.relative_to(REPO)
        i = 0
        while i < len(lines):
            fence = FENCE.match(lines[i])
            if fence and fence.group("lang") == "sh":
                marker = MARKER.match(lines[i - 1]) if i else None
                start = i + 1
                j = start
                while not FENCE.match(lines[j]):
                    j += 1
                text = textwrap.dedent("\n".join(lines[start:j])) + "\n"
                blocks.append((marker.group("how") if marker else None, (where, start), text))
                i = j
            i += 1
    return blocks


def _marked(word: str) -> str:
    (text,) = [t for how, _, t in shell_blocks() if how and word in t]
    return text


def _commands(line: str) -> list[str]:
    """The first word of each command on a shell line, after env assignments and sudo."""
    line = line.split(" #", 1)[0]
    words = []
    for part in re.split(r"&&|\|\||;|\||&|\$\(", line):
        tokens = [t for t in part.strip().split() if not re.match(r"^[A-Z_]+=", t)]
        while tokens and tokens[0] in ("sudo", "do", "then", "exec", "time"):
            tokens = tokens[1:]
        if tokens:
            words.append(tokens[0])
    return words


def test_the_marked_blocks_are_there() -> None:
    marked = [t for how, _, t in shell_blocks() if how]
    assert any("scripts/setup.sh" in t and "train_digits.py" in t for t in marked), "quick start"
    assert any("/run/smddp/smddpd.sock" in t for t in marked), "system daemon"
    assert any("numpy_allreduce.py" in t for t in marked), "numpy example"
    assert any("~/smddp-env" in t for t in marked), "install"
    assert any("train_elastic.py" in t for t in marked), "elastic example"


def test_no_block_runs_a_bare_program() -> None:
    bare = [
        f"{where}:{start + n}: {line.strip()}"
        for _, (where, start), text in shell_blocks()
        for n, line in enumerate(text.splitlines())
        if line.strip() and not line.lstrip().startswith("#") and BARE & set(_commands(line))
    ]
    assert bare == [], "commands that need an active venv:\n" + "\n".join(bare)


LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _headings(page: Path) -> list[str]:
    """The Markdown headings of a page, outside its fenced blocks (whose "#" lines are comments)."""
    headings, fenced = [], False
    for line in page.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            headings.append(line.lstrip("#"))
    return headings


def test_every_docs_page_is_linked_from_the_readme() -> None:
    text = README.read_text()
    unlinked = [p.name for p in PAGES[1:] if f"](docs/{p.name})" not in text]
    assert unlinked == [], f"pages under docs/ that the README does not link to: {unlinked}"


def test_links_between_the_pages_resolve() -> None:
    # A section moved to another page keeps its links working: every relative link names a
    # file that exists and, with a #fragment, a heading of it.
    broken = []
    for page in PAGES:
        for m in LINK.finditer(page.read_text()):
            target = m.group("target")
            if re.match(r"^[a-z]+:", target):
                continue  # http(s), mailto: not checked here
            path, _, fragment = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
                continue
            if fragment and dest.suffix == ".md":
                anchors = {_anchor(h) for h in _headings(dest)}
                if fragment not in anchors:
                    broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert broken == [], "links that lead nowhere:\n" + "\n".join(broken)


def _run(script: str, cwd: Path, env: dict[str, str], prefix: list[str] | None = None) -> str:
    # The block goes beside TMPDIR (the test's own folder), never into the checkout.
    path = Path(env["TMPDIR"]) / "readme-block.sh"
    path.write_text(script)
    proc = subprocess.run(
        [*(prefix or []), "bash", "-euo", "pipefail", str(path)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{script}\n{out[-6000:]}"
    return out


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    """A copy of the checkout (without .git or the venv), whose .venv is the checkout's."""
    dest = tmp_path / "smddp"
    ignore = shutil.ignore_patterns(
        ".git",
        ".venv",
        "model",
        "build",
        "dist",
        "__pycache__",
        ".pytest_cache",
        ".ruff_cache",
        "*.egg-info",
    )
    shutil.copytree(REPO, dest, ignore=ignore, symlinks=True)
    (dest / ".venv").symlink_to(REPO / ".venv")
    return dest


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMDDP_")}
    env["TMPDIR"] = str(tmp_path)
    return env


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_quick_start(tmp_path: Path) -> None:
    # In the checkout itself: scripts/setup.sh installs the checkout it is in (here, again).
    had_model = (REPO / "model").exists()
    try:
        out = _run(_marked("scripts/setup.sh"), REPO, _env(tmp_path))
    finally:
        if not had_model:
            shutil.rmtree(REPO / "model", ignore_errors=True)
    assert "started an embedded daemon for this job" in out, out[-3000:]
    accuracy = [float(a) for a in re.findall(r"final accuracy: (\d\.\d+)", out)]  # rank 0 tests
    assert len(accuracy) == 1 and accuracy[0] > 0.9, out[-3000:]
    assert "rank 0 saved checkpoint to" in out


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_install_block(copy: Path, tmp_path: Path) -> None:
    # Top to bottom in one new venv, as a user runs it from a checkout: torch, then smddp with
    # the torch and examples extras (built from the checkout, not editable), then the example.
    # HOME is the test's folder, so ~/smddp-env is made (and removed) there.
    env = _env(tmp_path)
    env["HOME"] = str(tmp_path)
    out = _run(_marked("~/smddp-env/bin/pip install '.[torch,examples]'"), copy, env)
    assert "started an embedded daemon for this job" in out, out[-3000:]
    accuracy = [float(a) for a in re.findall(r"final accuracy: (\d\.\d+)", out)]
    assert len(accuracy) == 1 and accuracy[0] > 0.9, out[-3000:]
    venv = tmp_path / "smddp-env"
    installed = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import smddp, sklearn; print(smddp.__file__)"],
        cwd=copy,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    # The installed package, even from the checkout's root (nothing there is called smddp).
    assert installed.startswith(str(venv)), installed


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_numpy_example(copy: Path, tmp_path: Path) -> None:
    out = _run(_marked("numpy_allreduce.py"), copy, _env(tmp_path))
    for rank in (0, 1):
        assert f"rank {rank}: all_reduce(SUM) of 1048576 x float32 ok" in out, out
        assert f"rank {rank}: all_gather and barrier ok" in out, out


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_elastic_example(copy: Path, tmp_path: Path) -> None:
    # docs/failures.md: rank 2 of 4 SIGKILLs itself, the other three shrink and finish.
    out = _run(_marked("train_elastic.py"), copy, _env(tmp_path))
    assert "launcher: ranks [2] were killed; ranks [] failed; the others finished" in out, out
    for rank in range(3):
        assert f"rank {rank}: trained 40 steps on 3 ranks" in out, out[-3000:]
    assert re.search(r"^launcher: kill -> first step on the shrunk group: [\d.]+ s", out, re.M), out


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare"
)
def test_system_daemon(copy: Path, tmp_path: Path) -> None:
    # Its own /run (the socket) and network (default ports), so that nothing else on this
    # machine is touched or in the way.
    isolate = [
        "unshare",
        "--mount",
        "--net",
        "--propagation",
        "private",
        "sh",
        "-c",
        'ip link set lo up && mount -t tmpfs tmpfs /run && exec "$@"',
        "isolate",
    ]
    out = _run(_marked("/run/smddp/smddpd.sock"), copy, _env(tmp_path), prefix=isolate)
    assert "smddpd serving on /run/smddp/smddpd.sock" in out, out[-3000:]
    assert "smddp: using the smddpd that answers at /run/smddp/smddpd.sock" in out, out[-3000:]
    assert "started an embedded daemon" not in out, out[-3000:]
    assert len(re.findall(r"final accuracy: 0\.9\d+", out)) == 1, out[-3000:]
    # smddpctl metrics: the job's ops, as the system daemon counted them.
    assert re.search(r"^all_reduce\s+float32\s+\d+\s", out, re.M), out[-3000:]
