"""The torch range the backend declares (``torch>=2.11,<3``) is checked when it is imported.

Under a torch outside it, ``import smddp.backend`` (and SageMaker's import) raise an ImportError
that names the range, the torch found and what to do, instead of failing later inside torch;
``import smddp`` (which registers the backend whenever torch is there) says the same as a
warning, so that torch stays usable for a numpy job or another backend. The pyproject's torch extra states the same range.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from smddp.backend.version import SUPPORTED, UnsupportedTorchError, check_torch

REPO = Path(__file__).resolve().parents[2]


def test_versions_inside_and_outside_the_range() -> None:
    for ok in ("2.11.0+cu130", "2.12.1", "2.13.0", "2.13.0+cpu", "2.14.1+cu128", "2.16.0.dev20261201", "2.99.0"):
        check_torch(ok)
    for old in ("2.10.1", "2.5.0+cu121", "1.13.1", "3.0.0"):
        with pytest.raises(UnsupportedTorchError, match=rf"needs torch>=2\.11,<3; this process has torch {re.escape(old)}\."):
            check_torch(old)


def test_the_torch_extra_declares_the_same_range() -> None:
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert meta["project"]["optional-dependencies"]["torch"] == [SUPPORTED]


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.timeout(240)
def test_an_old_torch_gets_one_clear_message() -> None:
    pretend = "import torch; torch.__version__ = '2.10.0+cpu'; "
    proc = _python(pretend + "import smddp.backend")
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("smddp.backend.version.UnsupportedTorchError: smddp's torch backend needs torch>=2.11,<3; "
                           "this process has torch 2.10.0+cpu. Install a torch in that range"), proc.stderr

    # The SageMaker import path raises the same error.
    proc = _python(pretend + "import smdistributed.dataparallel.torch.torch_smddp")
    assert proc.returncode == 1 and "needs torch>=2.11,<3" in proc.stderr, proc.stderr

    # ``import smddp`` alone (as a numpy job or the daemon's tools do) keeps torch usable under
    # an unsupported torch: the backend's creator imports smddp.backend, so the same clear error
    # comes when a process group is first made.
    proc = _python(pretend + "import smddp; print('torch usable:', torch.ones(2).sum().item()); "
                   "smddp._create(None, None)")
    assert "torch usable: 2.0" in proc.stdout, proc.stderr
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("smddp.backend.version.UnsupportedTorchError: smddp's torch backend needs "
                           "torch>=2.11,<3; this process has torch 2.10.0+cpu."), proc.stderr


@pytest.mark.timeout(240)
def test_a_torch_without_either_name_of_an_op_is_refused_naming_it() -> None:
    """A torch inside the range whose ProcessGroup has neither the 2.13 name nor the older one
    of a renamed op (a development build between the two) is refused, naming the op's names."""
    hide = (
        "import torch.distributed as dist\n"
        "for n in ('all_gather_single', '_allgather_base'):\n"
        "    if hasattr(dist.ProcessGroup, n): delattr(dist.ProcessGroup, n)\n"
        "import smddp.backend\n"
    )
    proc = _python(hide)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert "lacks all_gather_single or _allgather_base (a development build" in last, proc.stderr
