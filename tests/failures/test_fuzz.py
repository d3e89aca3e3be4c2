"""Fuzzing every door of smddpd while a well-behaved job runs beside the fuzzer.

One daemon for the module. A "steady" job of two numpy ranks all_reduces without pause and
checks every result. Meanwhile hypothesis throws at the daemon: every gRPC method of the
Node service (Register, Ops, Deregister, Status, Info, Topology) with random bytes and with
random field values (huge counts and sizes, unknown jobs, other jobs' tokens and session
secrets), every method of the Peer service that other nodes' daemons call (Join, Abort,
PeerStatus, Meet; against a registered two-node communicator, with forged proofs), and the
data socket (random messages, attaches with other sessions' secrets,
random ops on an attached session: offsets outside the arena, out-of-order sequence
numbers, impossible kinds and dtypes). Each bad call must get a gRPC error status with a
message (an op: an error reply with a message, or a closed connection), never an internal
error; the daemon must never crash; the steady job must complete with correct results.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from smddp.client.arena import ClientArena
from smddp.core.wire import (
    DATA_SOCKET_SUFFIX,
    MAX_MESSAGE_BYTES,
    MSG_ATTACH,
    MSG_ATTACH_REPLY,
    MSG_OP,
    MSG_OP_REPLY,
    MSG_PEER_ARENAS,
    MSG_PEER_ARENAS_REPLY,
    WIRE_CODES,
    pack,
    unpack,
)
from smddp.server.registry import _uid_of
from smddp.v1 import smddp_pb2 as pb
from smddp.v1 import smddp_pb2_grpc as pb_grpc

NODE = "/smddp.v1.Node/"
PEER = "/smddp.v1.Peer/"
EXAMPLES = 200
FUZZ = settings(
    max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None
)
ACCESS_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
REPLY_TIMEOUT_S = 10.0
U32, U64 = (1 << 32) - 1, (1 << 64) - 1
I32, I64 = 1 << 31, 1 << 63

# A numpy rank of the steady job: all_reduces of many sizes (small, chunked, direct), every
# result checked, until the stop file appears (the ranks agree on it through an all_reduce).
STEADY = r"""
import os, sys
import numpy as np
from smddp.client import connect
from smddp.v1 import smddp_pb2 as pb
rank, path, token, stop_file = int(sys.argv[1]), sys.argv[2], bytes.fromhex(sys.argv[3]), sys.argv[4]
comm = connect("steady", token, rank, 2, socket_path=path, arena_bytes=4 << 20)
step = 0
flag = np.zeros(1)
while True:
    n = 1 + 4099 * (step % 64)
    x = np.arange(n, dtype=np.float64) * (rank + 1) + step
    comm.all_reduce(x).wait()
    assert np.array_equal(x, np.arange(n, dtype=np.float64) * 3 + 2 * step), f"op {step}: wrong result"
    step += 1
    if step == 1:
        print("ready", flush=True)
    flag[0] = float(os.path.exists(stop_file))
    comm.all_reduce(flag, pb.MAX).wait()
    if flag[0]:
        break
comm.close()
print(f"done {step}", flush=True)
"""


class Target:
    """The module's daemon, the steady job and what the fuzzer learned (sessions, tokens)."""

    def __init__(self, daemon: Any, steady: list[subprocess.Popen], stop_file: Path) -> None:
        self.daemon = daemon
        self.socket = daemon.socket
        self.steady = steady
        self.stop_file = stop_file
        self.channel = grpc.insecure_channel("unix:" + daemon.socket)
        self.stub = pb_grpc.NodeStub(self.channel)
        # Credentials of the fuzzer's own live sessions, to replay against each other.
        self.tokens: list[bytes] = [b"t" * 16]
        self.secrets: list[bytes] = [b"s" * 32]
        self.session_ids: list[str] = ["0" * 32]

    def alive(self) -> None:
        assert self.daemon.proc.poll() is None, f"smddpd died:\n{self.daemon.log()[-4000:]}"
        assert all(p.poll() is None for p in self.steady), "a rank of the steady job ended early"

    def register(self, prefix: str, world_size: int = 1) -> pb.RegisterReply:
        """A session of a new job of the fuzzer's (a job of its own each time: the last one's
        may still be on its way out)."""
        job_id = f"{prefix}-{secrets.token_hex(4)}"
        token = secrets.token_bytes(16)
        reply = self.stub.Register(
            pb.RegisterRequest(
                job_id=job_id,
                job_token=token,
                comm_id="0",
                rank=0,
                world_size=world_size,
                node_id="fuzz",
                pid=os.getpid(),
                arena_bytes=1 << 20,
                timeout_ms=2000,
            ),
            timeout=REPLY_TIMEOUT_S,
        )
        self.tokens = (self.tokens + [token])[-8:]
        self.secrets = (self.secrets + [reply.session_secret])[-8:]
        self.session_ids = (self.session_ids + [reply.session_id])[-8:]
        return reply

    def deregister(self, reply: pb.RegisterReply) -> None:
        try:
            self.stub.Deregister(
                pb.DeregisterRequest(
                    session_id=reply.session_id, session_secret=reply.session_secret
                ),
                timeout=REPLY_TIMEOUT_S,
            )
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAUTHENTICATED, exc  # already dropped


@pytest.fixture(scope="module")
def target(module_daemon: Any) -> Iterator[Target]:
    """The module's daemon and the steady job's two ranks, running."""
    folder = Path(tempfile.mkdtemp(prefix="smddp-fuzz-"))
    stop_file = folder / "stop"
    token = secrets.token_hex(16)
    env = dict(os.environ)
    steady = []
    for r in range(2):
        with open(folder / f"rank{r}.err", "wb") as err:
            steady.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-c",
                        STEADY,
                        str(r),
                        module_daemon.socket,
                        token,
                        str(stop_file),
                    ],
                    stdout=subprocess.PIPE,
                    stderr=err,
                    text=True,
                    env=env,
                )
            )
    t = Target(module_daemon, steady, stop_file)
    try:
        for p in steady:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready", (
                folder / "rank0.err"
            ).read_text()
        yield t
    finally:
        stop_file.touch()
        for p in steady:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        t.channel.close()
        shutil.rmtree(folder, ignore_errors=True)


def _check_error(err: grpc.RpcError, what: str) -> None:
    assert err.code() in ACCESS_CODES, f"{what}: {err.code()} {err.details()}"
    details = err.details() or ""
    assert details.strip(), f"{what}: {err.code()} without a message"
    assert "internal error" not in details.lower() and "Traceback" not in details, (
        f"{what}: {details}"
    )


def _check_reply(reply: pb.OpReply, request_id: int, what: str) -> None:
    assert reply.request_id == request_id, f"{what}: reply to {reply.request_id}, not {request_id}"
    if not reply.ok:
        assert reply.error.strip(), f"{what}: an error reply without a message"
        assert "internal error" not in reply.error.lower(), f"{what}: {reply.error}"


# -- strategies -------------------------------------------------------------------------------


def known(pool: list[Any]) -> st.SearchStrategy[Any]:
    """One of the fuzzer's live credentials; drawn as an index, so replays draw alike."""
    return st.integers(0, 7).map(lambda i: pool[i % len(pool)])


texts = st.text(max_size=300)
names = st.one_of(
    st.sampled_from(["steady", "fuzz", "0", "", "../etc", "a" * 129]),
    st.from_regex(r"[A-Za-z0-9._:-]{1,12}", fullmatch=True),
    texts,
)


@st.composite
def node_specs(draw: Any) -> pb.NodeSpec:
    return pb.NodeSpec(
        node_id=draw(st.one_of(st.sampled_from(["n0", "n1"]), texts)),
        peer_address=draw(
            st.sampled_from(["127.0.0.1:9", "[::1]:9", "nohost", "", "1.2.3.4:99999", ":"])
        ),
        ranks=draw(st.lists(st.integers(0, U32), max_size=5)),
    )


@st.composite
def register_requests(draw: Any, t: Target) -> pb.RegisterRequest:
    return pb.RegisterRequest(
        job_id=draw(names),
        job_token=draw(st.one_of(known(t.tokens), known(t.secrets), st.binary(max_size=1100))),
        comm_id=draw(names),
        rank=draw(st.one_of(st.integers(0, 3), st.integers(0, U32))),
        world_size=draw(st.one_of(st.integers(0, 3), st.integers(0, U32))),
        global_rank=draw(st.integers(0, U32)),
        node_id=draw(texts),
        pid=draw(st.integers(0, U32)),
        arena_bytes=draw(
            st.one_of(st.sampled_from([0, 1 << 16, 1 << 20, 1 << 40]), st.integers(0, U64))
        ),
        timeout_ms=draw(st.one_of(st.integers(0, 3000), st.integers(0, U64))),
        nodes=draw(st.one_of(st.just([]), st.lists(node_specs(), max_size=3))),
    )


regions = st.builds(
    pb.Region,
    offset=st.one_of(st.integers(0, 1 << 21), st.integers(0, U64)),
    nbytes=st.one_of(st.integers(0, 1 << 21), st.integers(0, U64)),
)
# Regions in and around a 1 MiB arena: mostly inside, sometimes across its end or beyond.
arena_regions = st.builds(
    pb.Region,
    offset=st.one_of(
        st.integers(0, 1 << 20).map(lambda x: x // 8 * 8),
        st.integers((1 << 20) - 64, (1 << 20) + 64),
    ),
    nbytes=st.one_of(st.integers(0, 1 << 16).map(lambda x: x // 8 * 8), st.integers(0, 1 << 21)),
)
COLLECTIVES = [
    pb.ALL_REDUCE,
    pb.BROADCAST,
    pb.REDUCE,
    pb.ALL_GATHER,
    pb.REDUCE_SCATTER,
    pb.ALL_TO_ALL,
    pb.GATHER,
    pb.SCATTER,
    pb.BARRIER,
    pb.SEND,
    pb.RECV,
]
DTYPES = list(WIRE_CODES)


@st.composite
def op_requests(draw: Any, request_id: int, seq: int) -> pb.OpRequest:
    """An op as a fuzzer would send it: usually shaped like a real one (so that it reaches
    the collectives, with odd counts and regions), sometimes absurd in every field."""
    if draw(st.integers(0, 3)) == 0:
        return pb.OpRequest(
            request_id=request_id,
            seq=draw(st.one_of(st.just(seq), st.integers(0, U64))),
            part=draw(st.one_of(st.just(0), st.integers(0, U32))),
            parts=draw(st.one_of(st.just(1), st.integers(0, U32))),
            kind=draw(st.integers(0, 14)),
            dtype=draw(st.integers(0, 12)),
            count=draw(st.one_of(st.integers(0, 1 << 18), st.integers(0, U64))),
            root=draw(st.one_of(st.integers(-1, 2), st.integers(-I32, I32 - 1))),
            reduce_op=draw(st.integers(0, 10)),
            tag=draw(st.integers(-I64, I64 - 1)),
            input=draw(regions),
            output=draw(regions),
            send_blocks=draw(st.lists(regions, max_size=3)),
            recv_blocks=draw(st.lists(regions, max_size=3)),
            direct=draw(st.booleans()),
        )
    parts = draw(st.sampled_from([1, 1, 1, 2]))
    return pb.OpRequest(
        request_id=request_id,
        seq=draw(
            st.one_of(st.just(seq), st.just(seq), st.integers(0, seq + 2))
        ),  # sometimes out of order
        part=draw(st.sampled_from([0, 0, 0, parts])),
        parts=parts,
        kind=draw(st.sampled_from(COLLECTIVES)),
        dtype=draw(st.sampled_from(DTYPES)),
        count=draw(st.one_of(st.integers(0, 1 << 17), st.sampled_from([U64, I64, 1 << 40]))),
        root=draw(st.sampled_from([0, 0, 0, 1, -1])),
        reduce_op=draw(
            st.sampled_from([pb.SUM, pb.SUM, pb.MAX, pb.MIN, pb.PRODUCT, pb.AVG, pb.BAND])
        ),
        input=draw(arena_regions),
        output=draw(arena_regions),
        send_blocks=draw(st.lists(arena_regions, max_size=2)),
        recv_blocks=draw(st.lists(arena_regions, max_size=2)),
        direct=draw(st.sampled_from([False, False, False, True])),
    )


# -- gRPC ---------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_fuzz_unary_methods_with_random_bytes(target: Target) -> None:
    @FUZZ
    @given(
        method=st.sampled_from(["Register", "Deregister", "Status", "Info", "Topology"]),
        data=st.binary(max_size=2000),
    )
    def run(method: str, data: bytes) -> None:
        call = target.channel.unary_unary(NODE + method)
        try:
            call(data, timeout=REPLY_TIMEOUT_S)
        except grpc.RpcError as err:
            _check_error(err, f"{method}({data[:40]!r})")
        target.alive()

    run()


@pytest.mark.timeout(120)
def test_fuzz_register_and_deregister_fields(target: Target) -> None:
    @FUZZ
    @given(data=st.data())
    def run(data: Any) -> None:
        req = data.draw(register_requests(target))
        try:
            reply = target.stub.Register(req, timeout=REPLY_TIMEOUT_S)
        except grpc.RpcError as err:
            _check_error(err, f"Register({req})")
        else:
            if req.job_id == "steady":
                # Another token is another job of the same id (README, "Limits"), which attach
                # confines to the uid that attaches first (test_security). Register refuses
                # it at once only where the claimed pid is a live process of the steady
                # job's uid; a pid of nobody's tells it nothing.
                assert _uid_of(req.pid) != os.getuid(), (
                    f"registered under the steady job's id and owner (pid {req.pid}) without "
                    "its token"
                )
            target.deregister(reply)
        session_id = data.draw(st.one_of(known(target.session_ids), texts))
        secret = data.draw(st.one_of(known(target.secrets), st.binary(max_size=64)))
        try:
            target.stub.Deregister(
                pb.DeregisterRequest(session_id=session_id, session_secret=secret),
                timeout=REPLY_TIMEOUT_S,
            )
        except grpc.RpcError as err:
            _check_error(err, "Deregister")
        else:
            raise AssertionError(
                f"Deregister of {session_id!r} with a replayed or random secret succeeded"
            )
        target.alive()

    run()


@pytest.mark.timeout(120)
def test_fuzz_status_info_topology(target: Target) -> None:
    @FUZZ
    @given(method=st.sampled_from(["Status", "Info", "Topology"]), noise=st.binary(max_size=64))
    def run(method: str, noise: bytes) -> None:
        request = {
            "Status": pb.StatusRequest,
            "Info": pb.InfoRequest,
            "Topology": pb.TopologyRequest,
        }[method]()
        # Unknown fields are part of protobuf: a request with them is still a request.
        reply = getattr(target.stub, method)(request, timeout=REPLY_TIMEOUT_S)
        if method == "Status":
            steady = [c for c in reply.comms if c.job_id == "steady"]
            assert len(steady) == 1 and steady[0].failed == "", steady
        try:
            target.channel.unary_unary(NODE + method)(
                request.SerializeToString() + noise, timeout=REPLY_TIMEOUT_S
            )
        except grpc.RpcError as err:
            _check_error(err, f"{method} with trailing bytes")
        target.alive()

    run()


@pytest.mark.timeout(120)
def test_fuzz_ops_stream(target: Target) -> None:
    @FUZZ
    @given(data=st.data())
    def run(data: Any) -> None:
        own = target.register("fuzz-ops") if data.draw(st.booleans()) else None
        try:
            if own is not None and data.draw(st.booleans()):
                session_id, secret = own.session_id, own.session_secret
            else:
                session_id = data.draw(st.one_of(known(target.session_ids), texts))
                secret = data.draw(st.one_of(known(target.secrets), st.binary(max_size=64)))
            ops = [
                data.draw(op_requests(i + 1, i + 1)) for i in range(data.draw(st.integers(1, 4)))
            ]
            ops[0].session_id, ops[0].session_secret = session_id, secret
            authentic = own is not None and (session_id, secret) == (
                own.session_id,
                own.session_secret,
            )
            try:
                replies = list(target.stub.Ops(iter(ops), timeout=REPLY_TIMEOUT_S))
            except grpc.RpcError as err:
                _check_error(err, "Ops")
                assert not authentic or err.code() != grpc.StatusCode.UNAUTHENTICATED, err
            else:
                assert authentic, (
                    f"an Ops stream of {session_id!r} with a replayed or random secret was served"
                )
                for op, reply in zip(ops, replies):
                    _check_reply(reply, op.request_id, f"Ops {op}")
        finally:
            if own is not None:
                target.deregister(own)
        target.alive()

    run()


# -- the data socket ----------------------------------------------------------------------------


def _data_conn(t: Target) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(REPLY_TIMEOUT_S)
    s.connect(t.socket + DATA_SOCKET_SUFFIX)
    return s


def _attach_answer(s: socket.socket) -> pb.AttachReply | None:
    """The daemon's answer to a first message, or None when it just hung up."""
    msg = s.recv(MAX_MESSAGE_BYTES)
    if not msg:
        return None
    kind, payload = unpack(msg)
    assert kind == MSG_ATTACH_REPLY, kind
    return pb.AttachReply.FromString(payload)


@pytest.mark.timeout(120)
def test_fuzz_data_socket_attach(target: Target) -> None:
    @FUZZ
    @given(data=st.data())
    def run(data: Any) -> None:
        arena = ClientArena(1 << 20)
        own = target.register("fuzz-attach")
        try:
            with _data_conn(target) as s:
                shape = data.draw(st.sampled_from(["bytes", "other secret", "random fields"]))
                if shape == "bytes":
                    message = data.draw(st.binary(min_size=1, max_size=3000))
                else:
                    sid = (
                        own.session_id
                        if shape == "other secret"
                        else data.draw(st.one_of(known(target.session_ids), texts))
                    )
                    secret = data.draw(
                        known([x for x in target.secrets if x != own.session_secret])
                    )
                    if shape == "random fields":
                        secret = data.draw(st.one_of(st.just(secret), st.binary(max_size=64)))
                    message = pack(
                        MSG_ATTACH,
                        pb.AttachRequest(session_id=sid, session_secret=secret).SerializeToString(),
                    )
                fds = [arena.fd] if data.draw(st.booleans()) else []
                socket.send_fds(s, [message], fds) if fds else s.send(message)
                answer = _attach_answer(s)
                if answer is not None:
                    assert not answer.ok, f"{shape}: attach accepted"
                    assert answer.error.strip() and "internal error" not in answer.error.lower(), (
                        answer
                    )
                    assert s.recv(MAX_MESSAGE_BYTES) == b"", (
                        "a refused attach left the connection open"
                    )
            # The session these attempts aimed at is untouched: it still attaches.
            with _data_conn(target) as s:
                good = pb.AttachRequest(
                    session_id=own.session_id, session_secret=own.session_secret
                )
                socket.send_fds(s, [pack(MSG_ATTACH, good.SerializeToString())], [arena.fd])
                answer = _attach_answer(s)
                assert answer is not None and answer.ok, answer
        finally:
            target.deregister(own)
            arena.close()
        target.alive()

    run()


@pytest.mark.timeout(120)
def test_fuzz_data_socket_ops(target: Target) -> None:
    @FUZZ
    @given(data=st.data())
    def run(data: Any) -> None:
        arena = ClientArena(1 << 20)
        own = target.register("fuzz-data-ops")
        try:
            with _data_conn(target) as s:
                good = pb.AttachRequest(
                    session_id=own.session_id, session_secret=own.session_secret
                )
                socket.send_fds(s, [pack(MSG_ATTACH, good.SerializeToString())], [arena.fd])
                answer = _attach_answer(s)
                assert answer is not None and answer.ok, answer
                for i in range(data.draw(st.integers(1, 4))):
                    garbage = b""
                    if data.draw(st.integers(0, 9)) == 0:
                        garbage = data.draw(st.binary(min_size=1, max_size=2000))  # not even an op
                        s.send(garbage)
                        expect_id = None
                    else:
                        op = data.draw(op_requests(i + 1, i + 1))
                        s.send(pack(MSG_OP, op.SerializeToString()))
                        expect_id = op.request_id
                    msg, fds, _, _ = socket.recv_fds(s, MAX_MESSAGE_BYTES, 64)
                    for fd in fds:
                        os.close(fd)
                    if not msg:
                        break  # the daemon hung up on garbage: this rank is dropped
                    kind, payload = unpack(msg)
                    if garbage[:1] == bytes([MSG_PEER_ARENAS]):
                        # Garbage that opens with the peer-arenas byte is that request, and a
                        # fair one: the daemon answers it (or refuses it) as such.
                        assert kind == MSG_PEER_ARENAS_REPLY, kind
                        continue
                    assert kind == MSG_OP_REPLY, kind
                    reply = pb.OpReply.FromString(payload)
                    if expect_id is not None:
                        _check_reply(reply, expect_id, f"op {op}")
        finally:
            target.deregister(own)
            arena.close()
        target.alive()

    run()


# -- the Peer service (other daemons' door) -------------------------------------------------


@st.composite
def peer_requests(draw: Any, job_id: str, token: bytes) -> pb.PeerRequest:
    """A Peer request naming the fuzzer's two-node job (or another), with a forged proof."""
    return pb.PeerRequest(
        job_id=draw(st.one_of(st.just(job_id), st.just("steady"), names)),
        comm_id=draw(st.one_of(st.just("0"), names)),
        node=draw(st.one_of(st.integers(0, 2), st.integers(0, U32))),
        proof=draw(
            st.one_of(st.just(token), st.binary(max_size=64))
        ),  # the token itself is no proof either
    )


@pytest.mark.timeout(180)
def test_fuzz_peer_service(target: Target) -> None:
    info = target.stub.Info(pb.InfoRequest(), timeout=REPLY_TIMEOUT_S)
    job_id, token = f"peerfuzz-{secrets.token_hex(4)}", secrets.token_bytes(16)
    # Rank 0 of a two-node job whose other node never comes: its communicator has peers, and
    # waits for node b (which the fuzzer's forged calls pretend to be).
    reply = target.stub.Register(
        pb.RegisterRequest(
            job_id=job_id,
            job_token=token,
            comm_id="0",
            rank=0,
            world_size=2,
            node_id="a",
            pid=os.getpid(),
            arena_bytes=1 << 20,
            timeout_ms=600_000,
            nodes=[
                pb.NodeSpec(node_id="a", peer_address=info.peer_address, ranks=[0]),
                pb.NodeSpec(node_id="b", peer_address="127.0.0.1:9", ranks=[1]),
            ],
        ),
        timeout=REPLY_TIMEOUT_S,
    )
    # NOT_FOUND: no such communicator; DEADLINE_EXCEEDED: a Meet whose other ranks never come.
    peer_codes = ACCESS_CODES | {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DEADLINE_EXCEEDED}
    with grpc.insecure_channel(info.peer_address) as channel:
        stub = pb_grpc.PeerStub(channel)

        @FUZZ
        @given(
            method=st.sampled_from(["Join", "Abort", "PeerStatus", "Meet"]),
            data=st.binary(max_size=2000),
        )
        def random_bytes(method: str, data: bytes) -> None:
            try:
                channel.unary_unary(PEER + method)(data, timeout=REPLY_TIMEOUT_S)
            except grpc.RpcError as err:
                assert err.code() in peer_codes, f"{method}: {err.code()} {err.details()}"
                assert (err.details() or "").strip() and "Traceback" not in err.details(), (
                    err.details()
                )
            target.alive()

        @FUZZ
        @given(data=st.data())
        def fields(data: Any) -> None:
            peer = data.draw(peer_requests(job_id, token))
            method = data.draw(st.sampled_from(["Join", "Abort", "PeerStatus", "Meet"]))
            request = {
                "Join": lambda: pb.JoinRequest(
                    peer=peer,
                    node_ids=data.draw(st.lists(texts, max_size=3)),
                    transport=data.draw(st.integers(0, 5)),
                ),
                "Abort": lambda: pb.AbortRequest(
                    peer=peer, kind=data.draw(st.integers(0, 20)), message=data.draw(texts)
                ),
                "PeerStatus": lambda: pb.PeerStatusRequest(peer=peer),
                "Meet": lambda: pb.MeetRequest(
                    job_id=peer.job_id,
                    proof=peer.proof,
                    rank=data.draw(st.integers(0, U32)),
                    world_size=data.draw(st.one_of(st.integers(0, 3), st.integers(0, U32))),
                    node_id=data.draw(texts),
                    peer_address=data.draw(texts),
                    timeout_ms=data.draw(st.integers(1, 200)),  # a meeting that waits gives up soon
                ),
            }[method]()
            try:
                reply = getattr(stub, method)(request, timeout=REPLY_TIMEOUT_S)
            except grpc.RpcError as refused:
                assert refused.code() in peer_codes, (
                    f"{method}({peer}): {refused.code()} {refused.details()}"
                )
            else:
                # Only a rendezvous of one rank completes alone; it tells the caller nothing new.
                assert method == "Meet" and request.world_size == 1, (
                    f"{method}({request}) succeeded: {reply}"
                )
            target.alive()

        random_bytes()
        fields()
    # No forged Abort got through: neither the fuzzer's job nor the steady one failed.
    comms = {
        c.job_id: c for c in target.stub.Status(pb.StatusRequest(), timeout=REPLY_TIMEOUT_S).comms
    }
    assert comms[job_id].failed == "" and comms["steady"].failed == "", comms
    target.deregister(reply)


# -- the job beside -----------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_steady_job_completes_with_correct_results(target: Target) -> None:
    target.alive()
    with grpc.insecure_channel("unix:" + target.socket) as ch:
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    target.stop_file.touch()
    outputs = []
    for p in target.steady:
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 0, f"a rank of the steady job failed ({p.returncode}): {out}"
        outputs.append(out.strip().splitlines()[-1])
    steps = {int(line.split()[1]) for line in outputs}
    assert len(steps) == 1 and steps.pop() > 10, outputs
    st_reply = target.stub.Status(pb.StatusRequest(), timeout=10)
    # Every session of the fuzzer was dropped or deregistered; the daemon (stopped by its
    # fixture, which wants exit status 0) holds nothing.
    assert [c.job_id for c in st_reply.comms] == [], st_reply
