"""Network namespaces as nodes: N namespaces joined by veth pairs to one bridge.

Every node namespace holds ``lo`` and ``eth0`` with an address 10.231.X.(i+1)/24; the bridge
and the other ends of the veth pairs live in a namespace of their own, so nothing is added
to, or routed through, the host's namespace. Names carry the creating process's pid and a
random suffix, so concurrent runs never collide; namespaces of runs whose process is gone
are removed the next time a cluster is created. Needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN).

Used by the multi-node tests and by ``benchmarks/multinode.py``; it imports nothing but the
standard library.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import time
from collections.abc import Sequence

PREFIX = "smddpt-"
IFNAME = "eth0"
# The second octet is fixed; the third is drawn per cluster (addresses never leave the
# cluster's namespaces, so a clash with another cluster would be harmless anyway).
SUBNET_FMT = "10.231.{x}.{y}"


class NetnsError(RuntimeError):
    """An ``ip``/``tc`` command failed; the message has the command and its stderr."""


def _run(*cmd: str) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise NetnsError(f"`{' '.join(cmd)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def unavailable_reason() -> str | None:
    """None when this process may create network namespaces, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add); run the netns tests as root"
    probe = f"{PREFIX}{os.getpid()}-probe{secrets.token_hex(2)}"
    try:
        _run("ip", "netns", "add", probe)
    except (NetnsError, OSError) as exc:
        return f"cannot create a network namespace: {exc}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> None:
    """Deletes namespaces left by runs whose creating process no longer exists."""
    try:
        listing = _run("ip", "netns", "list")
    except (NetnsError, OSError):
        return
    for line in listing.splitlines():
        name = line.split()[0] if line.split() else ""
        if not name.startswith(PREFIX):
            continue
        pid = name[len(PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not _pid_alive(int(pid)):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)


class NetnsCluster:
    """``nodes`` namespaces on one bridge: ``create()``, then ``destroy()`` in a ``finally``.

    Attributes:
        names: the node namespaces, in node order.
        addresses: each node's IPv4 address on ``eth0``.
        bridge: the namespace that holds the bridge.
    """

    def __init__(self, nodes: int) -> None:
        tag = f"{PREFIX}{os.getpid()}-{secrets.token_hex(3)}"
        x = 1 + secrets.randbelow(254)
        self.names = [f"{tag}-n{i}" for i in range(nodes)]
        self.addresses = [SUBNET_FMT.format(x=x, y=i + 1) for i in range(nodes)]
        self.bridge = f"{tag}-br"
        self._created: list[str] = []

    def create(self) -> None:
        """Creates the namespaces, the bridge and the links; undoes everything if a step fails.

        Raises:
            NetnsError: an ``ip`` command failed.
        """
        remove_stale()
        try:
            for ns in (self.bridge, *self.names):
                _run("ip", "netns", "add", ns)
                self._created.append(ns)
                _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", self.bridge, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self.bridge, "link", "set", "br0", "up")
            for i, (ns, addr) in enumerate(zip(self.names, self.addresses)):
                # Both ends are created inside their namespaces: no link ever exists in the host's.
                _run(
                    "ip",
                    "link",
                    "add",
                    IFNAME,
                    "netns",
                    ns,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    f"p{i}",
                    "netns",
                    self.bridge,
                )
                _run("ip", "-n", self.bridge, "link", "set", f"p{i}", "master", "br0")
                _run("ip", "-n", self.bridge, "link", "set", f"p{i}", "up")
                _run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", IFNAME)
                _run("ip", "-n", ns, "link", "set", IFNAME, "up")
        except BaseException:
            self.destroy()
            raise

    def shape(self, rate: str, burst: str = "512kb", latency: str = "100ms") -> None:
        """Limits every node's egress on ``eth0`` to ``rate`` (tc tbf, e.g. ``1gbit``)."""
        for ns in self.names:
            _run(
                "ip",
                "netns",
                "exec",
                ns,
                "tc",
                "qdisc",
                "replace",
                "dev",
                IFNAME,
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                burst,
                "latency",
                latency,
            )

    def prefix(self, node: int) -> list[str]:
        """The command prefix that runs a program inside node ``node``'s namespace."""
        return ["ip", "netns", "exec", self.names[node]]

    def pids(self) -> list[int]:
        """Processes still running inside the cluster's namespaces."""
        found: list[int] = []
        for ns in self._created:
            proc = subprocess.run(
                ["ip", "netns", "pids", ns], capture_output=True, text=True, check=False
            )
            found += [int(p) for p in proc.stdout.split() if p.isdigit()]
        return found

    def destroy(self, grace_s: float = 5.0) -> None:
        """Ends what still runs inside the namespaces (started from them: ranks, embedded
        daemons, torchrun workers), then deletes them and with them every link."""
        leftover = self.pids()
        for pid in leftover:
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while leftover and time.monotonic() < deadline:
            time.sleep(0.1)
            leftover = [p for p in leftover if _pid_alive(p) and p in self.pids()]
        for pid in leftover:
            _signal(pid, signal.SIGKILL)
        for ns in reversed(self._created):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        self._created.clear()

    def exists(self) -> Sequence[str]:
        """The cluster's namespaces that exist right now (for tests of the teardown)."""
        listing = subprocess.run(
            ["ip", "netns", "list"], capture_output=True, text=True, check=False
        ).stdout
        present = {line.split()[0] for line in listing.splitlines() if line.split()}
        return [ns for ns in (self.bridge, *self.names) if ns in present]


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
