"""Checks deploy/docker/Dockerfile without a container engine: it copies everything the
distribution is built from, the image runs smddpd as the user the Kubernetes manifests expect,
and the daemon's install never brings torch."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib
import yaml

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
DAEMONSET = REPO / "deploy" / "kubernetes" / "base" / "daemonset.yaml"


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    result = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            result.append((word.upper(), rest.strip()))
    return result


def _build_stage_copies() -> list[str]:
    """Sources of the COPY instructions in the first (build) stage."""
    sources: list[str] = []
    stage = 0
    for word, args in _instructions():
        if word == "FROM":
            stage += 1
        elif word == "COPY" and stage == 1 and not args.startswith("--from"):
            sources += args.split()[:-1]
    return sources


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_base_image_is_python_slim() -> None:
    images = [args.split()[0] for word, args in _instructions() if word == "FROM"]
    assert images and all(image == "python:3.11-slim" for image in images)


def test_build_stage_copies_every_package_dir() -> None:
    copied = {source.rstrip("/").split("/")[0] for source in _build_stage_copies()}
    assert "pyproject.toml" in copied
    package_roots = {
        path.split("/")[0] for path in _pyproject()["tool"]["setuptools"]["package-dir"].values()
    }
    assert package_roots <= copied, f"not copied: {package_roots - copied}"


def test_runs_smddpd_as_the_manifests_user() -> None:
    instructions = _instructions()
    users = [args for word, args in instructions if word == "USER"]
    assert users, "the image runs as root"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) != 0, "USER must be numeric so runAsNonRoot can check it"
    entrypoint = [json.loads(args) for word, args in instructions if word == "ENTRYPOINT"]
    assert entrypoint[-1] == ["smddpd"]
    assert "smddpd" in _pyproject()["project"]["scripts"]
    daemonset = yaml.safe_load(DAEMONSET.read_text())
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    assert container["securityContext"]["runAsUser"] == int(uid)
    assert container["securityContext"]["runAsGroup"] == int(gid)
    assert f"--gid {gid}" in DOCKERFILE.read_text()
    assert "--socket-group=smddp" in container["args"]
    assert re.search(r"groupadd .*--gid \d+ smddp", " ".join(a for _, a in instructions))


def test_install_excludes_torch() -> None:
    runs = " ".join(args for word, args in _instructions() if word == "RUN")
    installs = re.findall(r"pip install[^;&]*", runs)
    assert installs
    assert not any("torch" in line for line in installs)
    assert "find_spec('torch')" in runs, "the build should prove torch is absent"
    assert "torch" not in " ".join(_pyproject()["project"]["dependencies"])


@pytest.mark.slow
def test_wheel_builds_from_the_copied_files(tmp_path: Path) -> None:
    """Build the wheel from only what the Dockerfile copies, as its build stage does."""
    context = tmp_path / "src"
    context.mkdir()
    for source in _build_stage_copies():
        for path in REPO.glob(source.rstrip("/")):
            target = context / path.relative_to(REPO)
            if path.is_dir():
                shutil.copytree(path, target, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy2(path, target)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--wheel-dir",
            str(tmp_path / "wheels"),
            str(context),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (wheel,) = (tmp_path / "wheels").glob("smddp-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        metadata = next(zf.read(n).decode() for n in names if n.endswith(".dist-info/METADATA"))
    assert "smddp/server/__main__.py" in names
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    unconditional = [line for line in requires if "extra ==" not in line]
    assert unconditional and not any("torch" in line for line in unconditional)
