"""What this node has: CPUs and NUMA nodes from /sys, NVIDIA GPUs from the driver's /proc."""

from __future__ import annotations

import glob
import os

from smddp.core.wire import outward_ip
from smddp.v1 import smddp_pb2 as pb


def local_devices() -> list[pb.Device]:
    """NUMA nodes (with their CPUs) and GPUs visible on this node, without importing CUDA."""
    devices: list[pb.Device] = []
    for path in sorted(
        glob.glob("/sys/devices/system/node/node[0-9]*"), key=lambda p: int(p.rsplit("node", 1)[1])
    ):
        index = int(path.rsplit("node", 1)[1])
        try:
            with open(os.path.join(path, "cpulist")) as f:
                cpus = f.read().strip()
        except OSError:
            cpus = "?"
        devices.append(pb.Device(kind="cpu", index=index, name=f"NUMA node {index}: CPUs {cpus}"))
    if not devices:
        devices.append(pb.Device(kind="cpu", index=0, name=f"CPUs 0-{(os.cpu_count() or 1) - 1}"))
    for index, path in enumerate(sorted(glob.glob("/proc/driver/nvidia/gpus/*/information"))):
        model = "NVIDIA GPU"
        try:
            with open(path) as f:
                for line in f:
                    if line.startswith("Model:"):
                        model = line.split(":", 1)[1].strip()
        except OSError:
            pass
        devices.append(pb.Device(kind="gpu", index=index, name=model))
    return devices


def advertise_address(bind_host: str, port: int, advertise: str) -> str:
    """The peer address other daemons use: ``--advertise`` (its port filled in when 0 or
    missing), else the bind host, else this host's outward IP address."""
    if advertise:
        host, sep, adv_port = advertise.rpartition(":")
        if not sep or not adv_port.isdigit():  # just a host
            host, adv_port = advertise, "0"
        return f"{host}:{adv_port if adv_port != '0' else port}"
    if bind_host not in ("", "0.0.0.0", "::"):
        return f"{bind_host}:{port}"
    return f"{outward_ip()}:{port}"
