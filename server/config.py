"""The daemon's configuration: flags > SMDDP_* environment > config file > defaults."""

from __future__ import annotations

import argparse
import dataclasses
import grp
import logging
import os
import re
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, cast

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, as a package (pyproject's dependency on it)
    import tomli as tomllib

from smddp.core.wire import default_socket_path
from smddp.server import units
from smddp.server.algorithms import parse_pins, pins_text

ENV_PREFIX = "SMDDP_"
# Settings whose empty default means "worked out at start", not "off".
_DERIVED = frozenset({"socket", "node_id", "advertise"})
_KINDS: dict[str, Callable[[Any], Any]] = {"int": int, "float": float}
# An on/off setting: a flag that takes no value; true/false in the file; in the environment
# one of these words.
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})


def _switch(value: object) -> bool:
    """An on/off setting's value from the file (a TOML bool) or the environment (a word).

    Raises:
        ValueError: anything else.
    """
    if isinstance(value, bool):
        return value
    word = str(value).strip().lower()
    if word in _TRUE or word in _FALSE:
        return word in _TRUE
    raise ValueError(f"{value!r} is not one of 1, true, yes, on, 0, false, no, off")


_KINDS["bool"] = _switch
IMPLIED_PEER_BIND = "0.0.0.0:7470"
_IMPLY_PEERS = ("data_port", "advertise", "peer_transport", "ucx_port")
_POSITIVE = (
    "attach_timeout_s",
    "max_unattached",
    "max_jobs_per_uid",
    "max_ranks_per_uid",
    "max_connections_per_uid",
    "max_handshakes_per_uid",
    "max_handshakes",
    "max_pending_rendezvous",
    "max_peer_rendezvous",
    "max_rendezvous_wait_s",
    "max_op_streams",
    "max_pending_ops",
)
# A node id: a host name, or what SMDDP_NODE_ID says; it goes into messages, logs and replies.
NODE_ID = re.compile(r"^[A-Za-z0-9._:@+-]{1,253}$")


@dataclass
class DaemonConfig:
    """Everything smddpd can be told. Field names are the flags' names with underscores."""

    socket: str = ""  # unix socket of the Node service; "" picks the default
    socket_group: str = ""  # group that may also use the socket and join jobs
    grpc_bind: str = ""  # optional TCP listener for health and reflection (Kubernetes probes)
    http_bind: str = "127.0.0.1:9464"  # /healthz /readyz /metrics; "off" disables
    # Daemon-to-daemon control (gRPC Peer service); "off" (the default) serves one node only.
    # --data-port, --advertise, --peer-transport or --ucx-port given alone imply 0.0.0.0:7470.
    peer_bind: str = "off"
    data_port: int = 7472  # daemon-to-daemon data over TCP, on peer_bind's host; 0 = any free port
    peer_transport: str = "tcp"  # tcp | ucx: what carries a job's bytes between nodes
    ucx_port: int = 7473  # UCX listener when peer_transport is ucx; 0 = any free port
    advertise: str = ""  # peer address other daemons use; "" derives it from peer_bind
    node_id: str = ""  # identity of this node; "" uses the host name
    log_level: str = "INFO"
    log_format: str = "text"  # text | json
    owner_pid: int = 0  # embedded daemon: exit once this process is gone and no rank is left
    # Embedded daemon: the job's launcher (torchrun), exit at once when it is gone; 0 = none.
    launcher_pid: int = 0
    chunk_bytes: int = 4 << 20  # arena footprint of one op chunk (4 MiB: a chunk stays in cache)
    gpu_chunk_bytes: int = 256 << 20  # most bytes one GPU reduction kernel launch covers
    # When CuPy is imported and the common kernels compiled on every GPU: "first-op" (the
    # first GPU op; a CPU-only daemon never touches a GPU) or "start" (in the background at
    # start: no job's first op waits for a compile, each GPU holds a context from then on).
    gpu_warm: str = "first-op"
    default_timeout_s: float = 1800.0  # per-op timeout when the client sets none
    max_jobs: int = 64
    max_ranks_per_job: int = 4096
    max_arena_bytes: int = 16 << 30
    # What one client (one uid, as the kernel tells it on the data socket) may make the
    # daemon hold, and how long; see server/limits.py.
    attach_timeout_s: float = 30.0  # Register -> attach, and a data connection's first message
    max_unattached: int = 1024  # registrations not attached yet, in all (the oldest makes room)
    max_jobs_per_uid: int = 32
    max_ranks_per_uid: int = 1024  # attached ranks
    max_connections_per_uid: int = 1024  # data-socket connections
    max_handshakes_per_uid: int = 16  # data-socket connections that have not attached yet
    max_handshakes: int = 128  # the same, in all
    max_buffered_bytes_per_uid: int = 512 << 20  # sends held for receives not yet posted
    max_buffered_bytes: int = 2 << 30  # the same, in all
    max_pending_rendezvous: int = 200  # Rendezvous calls waiting, in all; Meet calls apart
    # Rendezvous only other daemons' ranks are in: anyone reaching the Peer port can open
    # them, so they have a cap of their own and cannot crowd out this node's (--max-jobs).
    max_peer_rendezvous: int = 16
    max_rendezvous_wait_s: float = 900.0  # the longest one Rendezvous call waits
    max_op_streams: int = 256  # gRPC Ops streams (SMDDP_OP_CHANNEL=grpc), each holds a thread
    # Op chunks one communicator holds that some ranks sent and others not yet (about 1 KiB
    # each). DDP queues a handful of bucket all_reduces, batch_isend_irecv one op per message
    # of its batch, and a large op runs only two chunks ahead: 4096 is far above what a job
    # queues before its other ranks catch up, and holds a rank that races ahead to ~4 MiB.
    max_pending_ops: int = 4096
    tls_cert: str = ""  # PEM certificate this daemon shows other daemons; "" = no TLS
    tls_key: str = ""  # PEM private key of tls_cert
    tls_ca: str = ""  # PEM CA bundle that other daemons' certificates must chain to
    # Who sees every job in smddpctl status and metrics besides root and the daemon's own
    # uid (the others see their own jobs only); "" = nobody else.
    admin_group: str = ""
    # Per-job metric series (labelled job, removed when it ends); off, no series names a job.
    metrics_job_labels: bool = False
    # Pins the algorithm between nodes (server/algorithms.py): "op=name,..." or one name; "" lets
    # the cost model choose. Every daemon of a job must be given the same.
    algo: str = ""

    def __post_init__(self) -> None:
        if not self.socket:
            self.socket = default_socket_path()
        if not self.node_id:
            self.node_id = socket.gethostname()

    def exchange_settings(self) -> str:
        """The settings that shape the exchange between nodes, as one text: daemons of one
        job must have equal texts (a node joining with another is refused, naming both)."""
        return f"--algo {pins_text(parse_pins(self.algo))} --chunk-bytes {self.chunk_bytes}"


_HELP = {
    "socket": "unix socket of the local Node service (default /run/smddp/smddpd.sock, or a per-user runtime folder when /run/smddp is not writable)",  # noqa: E501
    "socket_group": "group allowed to use the socket besides the daemon's user",
    "grpc_bind": "HOST:PORT of a TCP gRPC listener serving grpc.health.v1 and reflection only, for probes (status, metrics and jobs stay on the unix socket)",  # noqa: E501
    "http_bind": "HOST:PORT serving /healthz, /readyz and /metrics; 'off' disables",
    "peer_bind": "HOST:PORT of the control service (gRPC) for other nodes' daemons; "
    "'off' serves one node only (the default, unless --data-port, --advertise, --peer-transport or --ucx-port is set: then 0.0.0.0:7470)",  # noqa: E501
    "data_port": "TCP port, on the --peer-bind host, of the data connections from other nodes' daemons (0: any free port; other daemons learn it when they join)",  # noqa: E501
    "peer_transport": "what carries a job's bytes between nodes: "
    "tcp, or ucx (UCX stream endpoints: RDMA where the site's UCX has it; needs smddp's ucx extra, e.g. pip install '.[ucx]' in a checkout); "  # noqa: E501
    "every daemon of a job must use the same",
    "ucx_port": "port of the UCX listener with --peer-transport ucx (0: any free port)",
    "advertise": "HOST:PORT other daemons use to reach this one",
    "node_id": "this node's identity (auto: the host name)",
    "log_level": "DEBUG, INFO, WARNING or ERROR",
    "log_format": "text or json",
    "owner_pid": "embedded mode: exit when this pid is gone and no rank is registered",
    "launcher_pid": "embedded mode: the job's launcher, such as torchrun; "
    "exit at once when it is gone, even with ranks registered",
    "chunk_bytes": "arena bytes of one op chunk (large ops are cut and pipelined)",
    "gpu_chunk_bytes": "GPU ops: "
    "most bytes one reduction kernel launch covers (a larger op is several launches, between which other jobs' GPU work can run)",  # noqa: E501
    "gpu_warm": "when CuPy is imported and the common reduction kernels (float32, bfloat16 all_reduce by 2, 4, 8 ranks) are compiled on every GPU: "  # noqa: E501
    "first-op, or start (in the background once serving; every GPU then holds a CUDA context of the daemon)",  # noqa: E501
    "default_timeout_s": "per-op timeout in seconds for clients that set none",
    "max_jobs": "most jobs served at once",
    "max_ranks_per_job": "largest world size of a communicator",
    "max_arena_bytes": "largest arena a rank may attach",
    "attach_timeout_s": "seconds a registered rank has to attach its arena (a registration not attached by then is dropped), and a data-socket connection to send its first message",  # noqa: E501
    "max_unattached": "most registrations not attached yet, in all (the oldest is dropped to make room: gRPC does not tell the caller's uid, so none may block another)",  # noqa: E501
    "max_jobs_per_uid": "most jobs one uid runs at once",
    "max_ranks_per_uid": "most attached ranks of one uid",
    "max_connections_per_uid": "most data-socket connections of one uid",
    "max_handshakes_per_uid": "most data-socket connections of one uid that have not attached yet",
    "max_handshakes": "most data-socket connections that have not attached yet, in all",
    "max_buffered_bytes_per_uid": "most bytes of one uid's sends the daemon holds until their receives are posted (beyond it a send waits for its receive)",  # noqa: E501
    "max_buffered_bytes": "the same, for all uids together",
    "max_pending_rendezvous": "most Rendezvous calls waiting at once (each holds a gRPC thread); "
    "the same again for Meet calls from other daemons",
    "max_peer_rendezvous": "most rendezvous hosted here that only other daemons' ranks are in (anyone who reaches --peer-bind can open them; this node's own ranks have --max-jobs apart)",  # noqa: E501
    "max_rendezvous_wait_s": "the longest one Rendezvous call waits, whatever its timeout",
    "max_op_streams": "most gRPC Ops streams (SMDDP_OP_CHANNEL=grpc) at once",
    "max_pending_ops": "most op chunks one communicator holds that some of its ranks have sent and others not yet; "  # noqa: E501
    "a rank that runs further ahead fails the communicator",
    "tls_cert": "PEM certificate for mutual TLS with other nodes' daemons (with --tls-key and --tls-ca; every node must use TLS; the certificate must name this node's id as a DNS subject alternative name, which the daemons that connect to it check)",  # noqa: E501
    "tls_key": "PEM private key of --tls-cert",
    "tls_ca": "PEM CA certificates that other daemons' certificates must be signed by",
    "admin_group": "group whose members see every job in smddpctl status and metrics, as root and the daemon's own user do; "  # noqa: E501
    "the others see their own jobs only",
    "metrics_job_labels": "per-job metric series (ops, bytes and stragglers, labelled job, removed when the job ends), on /metrics too; "  # noqa: E501
    "without it no series names a job",
    "algo": "algorithm between nodes per op, e.g. 'all_reduce=ring,broadcast=tree', or one name for every op that has it ('direct'); "  # noqa: E501
    "unset, a cost model chooses per op and size; "
    "give every daemon of a job the same",
}


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of smddpd; every default is None so that precedence can apply."""
    parser = argparse.ArgumentParser(
        prog="smddpd",
        description="smddp's node daemon: "
        "carries out the collectives of the training ranks on this node and exchanges with the daemons of other nodes. "  # noqa: E501
        "Every flag can also be set as an SMDDP_<NAME> environment variable (e.g. SMDDP_SOCKET) or in the TOML file given by --config / SMDDP_CONFIG; "  # noqa: E501
        "flags win over the environment, which wins over the file. "
        "Sizes (the --*-bytes flags) take units: "
        "4MiB, 1GiB (powers of 1024), 4MB (powers of 1000), or a plain byte count.",
    )
    parser.add_argument(
        "--config", help="TOML file with any of the settings below (env SMDDP_CONFIG)"
    )
    for f in fields(DaemonConfig):
        flag = "--" + f.name.replace("_", "-")
        env = ENV_PREFIX + f.name.upper()
        default = DaemonConfig.__dataclass_fields__[f.name].default
        shown = default if default != "" else ("auto" if f.name in _DERIVED else "none")
        kind: Callable[[str], Any] = {"int": int, "float": float}.get(str(f.type), str)
        if units.is_size(f.name):  # 4MiB, 1GiB, or a plain byte count
            kind, shown = units.size_arg, units.format_size(cast(int, default))
        if str(f.type) == "bool":  # a switch: the flag alone turns it on
            parser.add_argument(
                flag,
                action="store_const",
                const=True,
                default=None,
                help=f"{_HELP[f.name]} (env {env} set to 1 or 0; default off)",
            )
            continue
        parser.add_argument(
            flag, type=kind, default=None, help=f"{_HELP[f.name]} (env {env}; default {shown})"
        )
    return parser


def load(argv: list[str] | None = None, environ: dict[str, str] | None = None) -> DaemonConfig:
    """Builds the configuration from flags, environment and file.

    Raises:
        SystemExit: a bad flag, an unreadable file or a value of the wrong type.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    config_file = args.config or env.get(ENV_PREFIX + "CONFIG")
    names = {f.name: f for f in fields(DaemonConfig)}
    if config_file:
        try:
            data = tomllib.loads(Path(config_file).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            parser.error(f"cannot read config file {config_file}: {exc}")
        for key, value in data.items():
            name = key.replace("-", "_")
            if name not in names:
                parser.error(f"config file {config_file}: unknown setting {key!r}")
            # TOML values arrive typed: refuse true for an int or 1.5 for an int rather than
            # let Python's int() quietly turn them into 1.
            type_name = str(names[name].type)
            kind = _KINDS.get(type_name, str)
            accepted: tuple[type, ...] = (
                (bool,)
                if type_name == "bool"
                else (int, float)
                if kind is float
                else (int, str)
                if units.is_size(name)
                else (cast(type, kind),)
            )
            if (isinstance(value, bool) and type_name != "bool") or not isinstance(value, accepted):
                parser.error(
                    f"config file {config_file}: {key} = {value!r} is not a valid {type_name}"
                )
            values[name] = value
    for name in names:
        raw = env.get(ENV_PREFIX + name.upper())
        if raw is not None:
            values[name] = raw
        flag_value = getattr(args, name)
        if flag_value is not None:
            values[name] = flag_value
    for name, value in list(values.items()):
        kind = _KINDS.get(str(names[name].type), str)
        try:
            values[name] = units.parse_size(value) if units.is_size(name) else kind(value)
        except (TypeError, ValueError) as exc:
            parser.error(
                f"{name}: {exc}"
                if units.is_size(name) or kind is _switch
                else f"{name}: {value!r} is not a valid {names[name].type}"
            )
    if values.get("log_format", "text") not in ("text", "json"):
        parser.error("log_format must be 'text' or 'json'")
    tls = [values.get(name, "") for name in ("tls_cert", "tls_key", "tls_ca")]
    if any(tls) and not all(tls):
        parser.error("tls_cert, tls_key and tls_ca go together: set all three or none")
    if values.get("gpu_warm", "first-op") not in ("first-op", "start"):
        parser.error(f"gpu_warm: {values['gpu_warm']!r} is not one of first-op, start")
    transport = values.get("peer_transport", "tcp")
    if transport not in ("tcp", "ucx"):
        parser.error(f"peer_transport: {transport!r} is not one of tcp, ucx")
    if transport == "ucx" and any(tls):
        parser.error(
            "peer_transport ucx carries no TLS: "
            "use tcp with --tls-cert, or ucx on a trusted network without it"
        )
    for name in ("data_port", "ucx_port"):
        if not 0 <= values.get(name, 0) <= 65535:
            parser.error(f"{name}: {values[name]} is not a port number (0..65535)")
    if "peer_bind" not in values and any(n in values for n in _IMPLY_PEERS):
        # A setting that only matters between nodes asks for the peer listener.
        values["peer_bind"] = IMPLIED_PEER_BIND
    for name in _POSITIVE:
        if name in values and not values[name] > 0:
            parser.error(f"{name}: {values[name]} must be greater than 0")
    node_id = values.get("node_id")
    if node_id is not None and not NODE_ID.match(node_id):
        parser.error(
            f"node_id: {node_id[:80]!r} must be 1-253 characters of A-Z a-z 0-9 . _ : @ + -"
        )
    admin_group = values.get("admin_group", "")
    if admin_group:
        try:
            grp.getgrnam(admin_group)
        except KeyError:
            parser.error(f"admin_group: no group named {admin_group!r} on this host")
    try:
        parse_pins(values.get("algo", ""))
    except ValueError as exc:
        parser.error(str(exc))
    level = values.get("log_level", "INFO")
    if not isinstance(logging.getLevelName(level.upper()), int):
        parser.error(f"log_level: {level!r} is not one of DEBUG, INFO, WARNING, ERROR")
    return dataclasses.replace(DaemonConfig(), **values) if values else DaemonConfig()
