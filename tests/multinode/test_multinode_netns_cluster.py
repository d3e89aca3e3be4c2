"""The namespace nodes themselves: linked to each other only, shaped, and removed without trace."""

from __future__ import annotations

import subprocess
import sys

import pytest
from netns_cluster import PREFIX, remove_stale

# Listens in one namespace, connects from another: prints what the listener received.
_PING = """
import socket, sys
addr, mode = sys.argv[1], sys.argv[2]
if mode == "listen":
    s = socket.socket(); s.bind((addr, 7000)); s.listen(1); print("up", flush=True)
    c, _ = s.accept(); print(c.recv(16).decode(), flush=True)
else:
    socket.create_connection((addr, 7000), timeout=5).sendall(b"hello")
"""


def _links(prefix: list[str]) -> set[str]:
    out = subprocess.run(
        [*prefix, "ip", "-o", "link", "show"], capture_output=True, text=True, check=True
    ).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines()}


@pytest.mark.netns
@pytest.mark.timeout(60)
def test_nodes_reach_each_other_and_leave_nothing_behind(netns_cluster):
    host_links = _links([])
    cluster = netns_cluster(2)
    assert _links([]) == host_links, "links appeared in the host's namespace"
    for i, addr in enumerate(cluster.addresses):
        assert addr.startswith("10.231.") and addr.endswith(f".{i + 1}")
        assert _links(cluster.prefix(i)) == {"lo", "eth0"}
    cluster.shape("100mbit")
    qdisc = subprocess.run(
        [*cluster.prefix(1), "tc", "qdisc", "show", "dev", "eth0"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "tbf" in qdisc and "100Mbit" in qdisc, qdisc

    listener = subprocess.Popen(
        [*cluster.prefix(1), sys.executable, "-c", _PING, cluster.addresses[1], "listen"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert listener.stdout.readline().strip() == "up"
        subprocess.run(
            [*cluster.prefix(0), sys.executable, "-c", _PING, cluster.addresses[1], "send"],
            check=True,
        )
        assert listener.stdout.readline().strip() == "hello"
    finally:
        listener.kill()
        listener.wait()

    cluster.destroy()
    assert not cluster.exists()
    assert _links([]) == host_links


@pytest.mark.netns
@pytest.mark.timeout(60)
def test_namespaces_of_a_dead_run_are_removed(netns_cluster):
    netns_cluster(1)  # skips unless namespaces can be made here
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that no longer runs: the "run" that made the namespace below is over
    stale = f"{PREFIX}{gone.pid}-dead-n0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        remove_stale()
        listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert stale not in listing
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)
