"""The torch range the backend declares (``torch>=2.11,<3``) is checked when it is imported.

Under a torch outside it, ``import smddp.backend`` (and SageMaker's import) raise an ImportError
that names the range, the torch found and what to do, instead of failing later inside torch;
``import smddp`` (which registers the backend whenever torch is there) says the same as a
warning, so that torch stays usable for a numpy job or another backend. The pyproject's torch extra
states the same range.
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
    for ok in (
        "2.11.0+cu130",
        "2.12.1",
        "2.13.0",
        "2.13.0+cpu",
        "2.14.1+cu128",
        "2.16.0.dev20261201",
        "2.99.0",
    ):
        check_torch(ok)
    for old in ("2.10.1", "2.5.0+cu121", "1.13.1", "3.0.0"):
        with pytest.raises(
            UnsupportedTorchError,
            match=rf"needs torch>=2\.11,<3; this process has torch {re.escape(old)}\.",
        ):
            check_torch(old)


def test_the_torch_extra_declares_the_same_range() -> None:
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert meta["project"]["optional-dependencies"]["torch"] == [SUPPORTED]


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )


@pytest.mark.timeout(240)
def test_an_old_torch_gets_one_clear_message() -> None:
    pretend = "import torch; torch.__version__ = '2.10.0+cpu'; "
    proc = _python(pretend + "import smddp.backend")
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "smddp.backend.version.UnsupportedTorchError: smddp's torch backend needs torch>=2.11,<3; "
        "this process has torch 2.10.0+cpu. Install a torch in that range"
    ), proc.stderr

    # The SageMaker import path raises the same error.
    proc = _python(pretend + "import smdistributed.dataparallel.torch.torch_smddp")
    assert proc.returncode == 1 and "needs torch>=2.11,<3" in proc.stderr, proc.stderr

    # ``import smddp`` alone (as a numpy job or the daemon's tools do) keeps torch usable under
    # an unsupported torch: the backend's creator imports smddp.backend, so the same clear error
    # comes when a process group is first made.
    proc = _python(
        pretend + "import smddp; print('torch usable:', torch.ones(2).sum().item()); "
        "smddp._create(None, None)"
    )
    assert "torch usable: 2.0" in proc.stdout, proc.stderr
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "smddp.backend.version.UnsupportedTorchError: smddp's torch backend needs "
        "torch>=2.11,<3; this process has torch 2.10.0+cpu."
    ), proc.stderr


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


PROBE = r"""
import json, torch, torch.distributed as dist
from torch._C import _distributed_c10d as c10d
from smddp.backend.process_group import SmddpProcessGroup

calls = []

class Done(dist.Work):
    def __init__(self, result):
        super().__init__()
        self.result = result
    def wait(self, timeout=None):
        return True
    def get_future(self):
        f = torch.futures.Future()
        f.set_result(self.result)
        return f

def recorder(name):
    def method(self, *args, **kwargs):
        calls.append(name)
        first = args[0]
        return Done(first if isinstance(first, list) else [first])
    return method

# Every collective name either torch has used, recorded instead of run.
NAMES = ["allreduce", "allreduce_coalesced", "broadcast", "all_gather_single", "_allgather_base",
         "all_gather_single_coalesced", "allgather_into_tensor_coalesced", "reduce_scatter_single",
         "_reduce_scatter_base", "reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced",
         "all_to_all_single", "alltoall_base"]

class Probe(dist.ProcessGroup):
    def __init__(self):
        super().__init__(0, 1)
    def getBackendName(self):
        return "probe"
    def getGroupName(self):
        return "probe"
    def setGroupName(self, name):
        pass

for n in NAMES:
    setattr(Probe, n, recorder(n))
pg = Probe()
c10d._register_process_group("probe", pg)
F = torch.ops._c10d_functional
x = torch.ones(4)
ops = {
    "all_reduce": lambda: F.all_reduce(x, "sum", "probe"),
    "all_reduce_coalesced": lambda: F.all_reduce_coalesced([x], "sum", "probe"),
    "all_gather_into_tensor": lambda: F.all_gather_into_tensor(x, 1, "probe"),
    "all_gather_into_tensor_coalesced": lambda: F.all_gather_into_tensor_coalesced([x], 1, "probe"),
    "reduce_scatter_tensor": lambda: F.reduce_scatter_tensor(x, "sum", 1, "probe"),
    "reduce_scatter_tensor_coalesced": lambda: F.reduce_scatter_tensor_coalesced([x], "sum", 1, "probe"),
    "all_to_all_single": lambda: F.all_to_all_single(x, [4], [4], "probe"),
    "broadcast": lambda: F.broadcast(x, 0, "probe"),
}
reached = {}
for op, call in ops.items():
    calls.clear()
    try:
        for t in (call() if op.endswith("coalesced") else [call()]):
            F.wait_tensor(t)
        reached[op] = [c for c in calls]
    except Exception as exc:
        reached[op] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
print(json.dumps({"reached": reached,
                  "defined": [n for n in NAMES if n in vars(SmddpProcessGroup)]}))
"""


@pytest.mark.timeout(240)
def test_functional_collectives_reach_a_method_the_backend_defines() -> None:
    """torch's C++ functional collectives (DTensor, FSDP2, torch.compile) call into a Python
    ProcessGroup under names that changed in 2.13; under this torch each reaches Python, under
    a name SmddpProcessGroup defines (2.11 reaches the old names, 2.13 the new ones)."""
    import json

    proc = _python(PROBE)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for op, names in got["reached"].items():
        assert isinstance(names, list) and len(names) == 1, f"{op}: {names}"
        assert names[0] in got["defined"], f"{op} reaches {names[0]}, which smddp does not define"
