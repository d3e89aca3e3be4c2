"""examples/train_digits.py across two namespace nodes, one torchrun per node, no daemon.

Each node is a network namespace with a host name of its own (a UTS namespace), so smddp
finds the layout exactly as on real hosts: node identity from the host name, the first
rank of each node starts an embedded smddpd, and that daemon advertises the node's address
on the route toward MASTER_ADDR. Nothing smddp-specific is configured except a socket path
where no daemon answers (a system daemon on this host must not be picked up).
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "train_digits.py"
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
NPROC_PER_NODE = 2
RUN_TIMEOUT_S = 150


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_train_digits_on_two_namespace_nodes(netns_cluster, tmp_path):
    cluster = netns_cluster(2)
    endpoint = f"{cluster.addresses[0]}:{20000 + secrets.randbelow(20000)}"
    run_id = f"digits-{secrets.token_hex(4)}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMDDP_")}
    procs = []
    for i, addr in enumerate(cluster.addresses):
        node_env = dict(env, SMDDP_SOCKET=str(tmp_path / f"no-daemon-{i}.sock"))
        torchrun = [
            TORCHRUN, "--nnodes", "2", "--nproc-per-node", str(NPROC_PER_NODE),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
            # The host name resolves to no address of the namespace, so torchrun can guess
            # neither which node hosts the rendezvous store nor its own address: say both.
            "--rdzv-conf", f"is_host={int(i == 0)}", "--local-addr", addr,
            "--max-restarts", "0", "--tee", "3", "--log-dir", str(tmp_path / f"logs{i}"),
            str(SCRIPT), "--model-dir", str(tmp_path / "model"),
        ]  # fmt: skip
        # A host name per node, as real nodes have: smddp's default node identity.
        cmd = [
            *cluster.prefix(i),
            "unshare",
            "--uts",
            "sh",
            "-c",
            f'hostname smddp-node{i} && exec "$@"',
            "sh",
            *torchrun,
        ]
        procs.append(
            subprocess.Popen(
                cmd,
                env=node_env,
                cwd=tmp_path,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=RUN_TIMEOUT_S)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            outs.append(p.communicate()[0])
    report = "\n".join(
        f"===== node {i} (exit {p.returncode}) =====\n{out}"
        for i, (p, out) in enumerate(zip(procs, outs))
    )
    assert all(p.returncode == 0 for p in procs), report

    world = 2 * NPROC_PER_NODE
    # Rank 0's own file under --log-dir, not torchrun's output: there a stdout line can be cut
    # where torchrun's block-buffered stdout was flushed, and a stderr line land in the cut.
    files = sorted((tmp_path / "logs0").glob("*/attempt_0/0/stdout.log"))
    assert len(files) == 1, (files, report)
    rank0 = files[0].read_text()
    assert f"backend=smddp world_size={world}" in rank0, report
    for out in outs:  # one embedded daemon per node, started by the node's first rank
        assert len(re.findall(r"started an embedded daemon for this job", out)) == 1, report
    accuracy = re.findall(r"^final accuracy: ([0-9.]+)$", rank0, re.MULTILINE)
    assert len(accuracy) == 1, report
    assert float(accuracy[0]) > 0.90, report
    assert (tmp_path / "model" / "model.pt").exists()
