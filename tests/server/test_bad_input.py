"""Bad input gets a clear error, and smddpd keeps serving everyone else."""

from __future__ import annotations

import os
import re
import secrets
import socket
import sys

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from smddp.client.arena import ClientArena
from smddp.core.wire import (
    DATA_SOCKET_SUFFIX,
    MAX_MESSAGE_BYTES,
    MSG_ATTACH,
    MSG_ATTACH_REPLY,
    MSG_OP,
    MSG_OP_REPLY,
    pack,
    unpack,
)
from smddp.v1 import smddp_pb2 as pb
from smddp.v1 import smddp_pb2_grpc as pb_grpc

NODE = "/smddp.v1.Node/"
RECV_TIMEOUT_S = 10.0


def register_request(**fields) -> pb.RegisterRequest:
    """A valid RegisterRequest for a one-rank job, with ``fields`` replaced."""
    req = pb.RegisterRequest(
        job_id="intruder",
        job_token=b"t" * 16,
        comm_id="0",
        rank=0,
        world_size=1,
        global_rank=0,
        node_id="test",
        pid=os.getpid(),
        arena_bytes=1 << 20,
    )
    for name, value in fields.items():
        setattr(req, name, value)
    return req


# -- Register with absurd fields ---------------------------------------------------------------

INVALID = grpc.StatusCode.INVALID_ARGUMENT
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
ABSURD_REGISTRATIONS = [
    # (what, fields, acceptable codes, a word the message must contain)
    ("world_size 0", {"world_size": 0}, {INVALID, EXHAUSTED}, "world_size"),
    ("world_size huge", {"world_size": 1 << 31}, {INVALID, EXHAUSTED}, "world_size"),
    ("rank == world_size", {"rank": 1, "world_size": 1}, {INVALID}, "rank"),
    ("rank >= world_size", {"rank": 7, "world_size": 2}, {INVALID}, "rank"),
    ("job_id with /", {"job_id": "../etc/passwd"}, {INVALID}, "job_id"),
    ("job_id of 200 characters", {"job_id": "j" * 200}, {INVALID}, "job_id"),
    ("empty job_id", {"job_id": ""}, {INVALID}, "job_id"),
    ("empty comm_id", {"comm_id": ""}, {INVALID}, "comm_id"),
    ("token too short", {"job_token": b"short"}, {INVALID}, "job_token"),
    ("no token", {"job_token": b""}, {INVALID}, "job_token"),
    ("arena_bytes huge", {"arena_bytes": 1 << 60}, {INVALID, EXHAUSTED}, "arena_bytes"),
    ("arena_bytes 0", {"arena_bytes": 0}, {INVALID, EXHAUSTED}, "arena_bytes"),
    ("timeout_ms absurd", {"timeout_ms": 1 << 62}, {INVALID}, "timeout_ms"),
]


@pytest.mark.timeout(60)
def test_register_rejects_absurd_fields(daemon):
    with grpc.insecure_channel("unix:" + daemon.socket) as channel:
        stub = pb_grpc.NodeStub(channel)
        for what, fields, codes, word in ABSURD_REGISTRATIONS:
            with pytest.raises(grpc.RpcError) as info:
                stub.Register(register_request(**fields), timeout=10)
            err = info.value
            assert err.code() in codes, f"{what}: {err.code()} {err.details()}"
            assert word in err.details(), (
                f"{what}: the message does not name {word}: {err.details()}"
            )
        assert stub.Status(pb.StatusRequest(), timeout=10).comms == [], (
            "a refused rank was registered"
        )

        # The daemon still registers a sound rank, and refuses a second one in its slot or
        # one with the wrong job token, naming the problem.
        reg = stub.Register(register_request(world_size=2), timeout=10)
        with pytest.raises(grpc.RpcError) as info:
            stub.Register(register_request(world_size=2), timeout=10)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "rank 0 is already registered" in info.value.details()
        # A job id belongs to a uid once a rank attached; before, a registration with another
        # token is another job (so that an unattached registration cannot squat the id).
        arena = ClientArena(1 << 20)
        s = data_conn(daemon.socket + DATA_SOCKET_SUFFIX)
        attach = pb.AttachRequest(session_id=reg.session_id, session_secret=reg.session_secret)
        socket.send_fds(s, [pack(MSG_ATTACH, attach.SerializeToString())], [arena.fd])
        assert pb.AttachReply.FromString(unpack(s.recv(MAX_MESSAGE_BYTES))[1]).ok
        with pytest.raises(grpc.RpcError) as info:
            stub.Register(register_request(world_size=2, rank=1, job_token=b"x" * 16), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "wrong job token" in info.value.details()
        s.close()
        arena.close()


# -- bad tensors through the torch backend -----------------------------------------------------


def torch_bad_input(rank: int, world: int, init_file: str) -> dict[str, str]:
    """One torch rank: unsupported dtypes, mismatched sizes, a destroyed group.

    Returns:
        The error messages the parent checks across ranks.
    """
    import torch
    import torch.distributed as dist

    import smddp  # noqa: F401  (registers the backend)

    dist.init_process_group("smddp", init_method=f"file://{init_file}", rank=rank, world_size=world)
    seen = {}

    # Unsupported dtypes: a ValueError naming the dtype, raised before anything is sent.
    for dtype, call in [
        (torch.float8_e4m3fn, lambda t: dist.all_reduce(t)),
        (torch.float8_e5m2, lambda t: dist.broadcast(t, src=0)),
        (torch.uint32, lambda t: dist.all_reduce(t)),
        (torch.complex64, lambda t: dist.reduce(t, dst=0)),  # all_reduce would view it as float32
        (torch.uint16, lambda t: dist.all_gather([torch.empty_like(t) for _ in range(world)], t)),
    ]:
        name = str(dtype).removeprefix("torch.")
        with pytest.raises(ValueError, match=name):
            call(torch.zeros(8, dtype=dtype))

    # Local size mistakes: a ValueError before anything is sent.
    x = torch.ones(5)
    with pytest.raises(ValueError, match="expected 2 tensors") as info:
        dist.all_gather([torch.empty(5) for _ in range(world + 1)], x)
    seen["all_gather list"] = str(info.value)
    with pytest.raises(ValueError, match="4") as info:
        dist.all_gather([torch.empty(5), torch.empty(4)], x)
    seen["all_gather element count"] = str(info.value)
    with pytest.raises(ValueError):
        dist.all_gather_into_tensor(torch.empty(5 * world + 1), x)
    with pytest.raises(ValueError):
        dist.reduce_scatter_tensor(torch.empty(5), torch.ones(5 * world - 1))

    # Nothing of the above reached the daemon: the group's op numbering is intact.
    y = torch.full((1000,), float(rank + 1))
    dist.all_reduce(y)
    assert torch.equal(y, torch.full((1000,), float(world * (world + 1) / 2)))

    # Ranks disagree about the size: every rank gets an error naming both, no hang.
    group = dist.new_group(backend="smddp")
    with pytest.raises(dist.DistBackendError) as info:
        dist.all_reduce(torch.ones(10 + 10 * rank), group=group)
    seen["size mismatch"] = str(info.value)
    # The failed group stays failed with the same cause instead of hanging.
    with pytest.raises(dist.DistBackendError) as info:
        dist.all_reduce(torch.ones(10), group=group)
    seen["after mismatch"] = str(info.value)

    # An op on a destroyed group: torch refuses it, and so does the group object itself
    # (which C++ callers such as DDP's reducer reach directly).
    dist.destroy_process_group(group)
    with pytest.raises(ValueError, match="not initialized"):
        dist.all_reduce(torch.ones(10), group=group)
    # A DistBackendError (smddp's base one) naming the job, the communicator and the rank.
    from smddp.backend.errors import SmddpBackendError

    with pytest.raises(dist.DistBackendError) as info:
        group.allreduce([torch.ones(10)], dist.AllreduceOptions()).wait()
    assert type(info.value) is SmddpBackendError
    seen["destroyed group"] = str(info.value)

    # The default group and the daemon are unharmed.
    y = torch.full((1000,), float(rank + 1))
    dist.all_reduce(y)
    assert torch.equal(y, torch.full((1000,), float(world * (world + 1) / 2)))
    dist.destroy_process_group()
    return seen


@pytest.mark.timeout(120)
def test_torch_bad_tensors(daemon, spawn_ranks, tmp_path):
    env = dict(os.environ, SMDDP_SOCKET=daemon.socket, SMDDP_EMBEDDED="0")
    seen = spawn_ranks(torch_bad_input, 2, 2, str(tmp_path / "init"), env=env).join()

    for s in seen:
        assert "got 3" in s["all_gather list"], s
        mismatch = s["size mismatch"]
        assert "rank 0" in mismatch and "rank 1" in mismatch, mismatch
        assert "10 x float32" in mismatch and "20 x float32" in mismatch, mismatch
        assert mismatch in s["after mismatch"], s
    for rank, s in enumerate(seen):
        assert re.fullmatch(
            rf"job \S+ comm \d+: rank {rank}: the communicator has been destroyed "
            r"\(destroy_process_group\); create a new group",
            s["destroyed group"],
        ), s
    assert seen[0]["size mismatch"] == seen[1]["size mismatch"]


# -- garbage on the sockets while another job runs ---------------------------------------------


def steady_job(rank: int, world: int, socket_path: str, token: bytes) -> int:
    """A well-behaved numpy rank: one op, "ready", wait for "go", then many checked ops."""
    from smddp.client import connect

    comm = connect("steady", token, rank, world, socket_path=socket_path, arena_bytes=1 << 20)
    x = np.ones(100, dtype=np.int64)
    comm.all_reduce(x).wait()
    print("ready", flush=True)
    assert sys.stdin.readline().strip() == "go"
    for step in range(30):
        x = np.arange(50_000 + step, dtype=np.int64) * (rank + 1)
        comm.all_reduce(x).wait()
        np.testing.assert_array_equal(
            x, np.arange(50_000 + step, dtype=np.int64) * (world * (world + 1) // 2)
        )
    comm.close()
    return step + 1


def raw_stream(path: str, data: bytes) -> None:
    """Writes ``data`` to a unix stream socket and reads until the daemon hangs up."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(RECV_TIMEOUT_S)
        s.connect(path)
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
            while s.recv(65536):
                pass
        except ConnectionResetError:
            pass  # hanging up hard is as good an answer as any to garbage


def grpc_garbage(path: str) -> None:
    """Malformed traffic on the gRPC socket, each answered with an error or a hang-up."""
    rng = np.random.default_rng(1)
    raw_stream(path, rng.bytes(4096))
    raw_stream(path, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + rng.bytes(4096))
    raw_stream(path, b"PRI * HTTP/2.0\r\n\r")  # a truncated preface

    with grpc.insecure_channel("unix:" + path) as channel:

        def raw(method: str):
            return channel.unary_unary(NODE + method)

        sound = register_request().SerializeToString()
        for what, payload in [("random bytes", rng.bytes(300)), ("a truncated message", sound[:9])]:
            for method in ("Register", "Deregister"):
                with pytest.raises(grpc.RpcError) as info:
                    raw(method)(payload, timeout=10)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (
                    f"{method} with {what}"
                )
                assert "undecodable" in info.value.details(), f"{method} with {what}"

        stub = pb_grpc.NodeStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Deregister(
                pb.DeregisterRequest(session_id="nope", session_secret=b"x"), timeout=10
            )
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "unknown session" in info.value.details()

        # An Ops stream that names no valid session is refused, whatever it sends next.
        reqs = iter(
            [pb.OpRequest(session_id="nope", session_secret=b"x" * 32, kind=pb.BARRIER, parts=1)]
            * 3
        )
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Ops(reqs, timeout=10))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # Garbage streams: an Ops stream and the reflection service (grpc-python once kept
        # such calls open forever, so that smddpd could not stop; the fixture checks it can).
        for method in (
            NODE + "Ops",
            "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
        ):
            with pytest.raises(grpc.RpcError) as info:
                list(channel.stream_stream(method)(iter([rng.bytes(200)]), timeout=10))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
            assert "undecodable" in info.value.details(), method
        # An Ops stream that ends before its first message is simply over.
        assert list(stub.Ops(iter([]), timeout=10)) == []

        # A sound Ops stream that turns to garbage: the good op is answered, then the stream
        # is refused and the rank dropped from its communicator.
        reg = stub.Register(register_request(job_id="garbled"), timeout=10)
        barrier = pb.OpRequest(
            request_id=1,
            session_id=reg.session_id,
            session_secret=reg.session_secret,
            seq=1,
            part=0,
            parts=1,
            kind=pb.BARRIER,
        )
        replies = channel.stream_stream(NODE + "Ops", response_deserializer=pb.OpReply.FromString)(
            iter([barrier.SerializeToString(), b"\xff" * 64]), timeout=10
        )
        assert next(replies) == pb.OpReply(request_id=1, ok=True)
        with pytest.raises(grpc.RpcError) as info:
            next(replies)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "undecodable" in info.value.details()


def data_conn(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(RECV_TIMEOUT_S)
    s.connect(path)
    return s


def attach_refused(path: str, message: bytes, fds: list[int]) -> str:
    """Sends one first message on a new data connection; returns the daemon's refusal."""
    with data_conn(path) as s:
        socket.send_fds(s, [message], fds) if fds else s.send(message)
        kind, payload = unpack(s.recv(MAX_MESSAGE_BYTES))
        assert kind == MSG_ATTACH_REPLY
        reply = pb.AttachReply.FromString(payload)
        assert not reply.ok, "a bad attach was accepted"
        assert s.recv(MAX_MESSAGE_BYTES) == b"", "the daemon kept a refused connection open"
        return reply.error


def data_socket_garbage(path: str, grpc_path: str) -> None:
    """Malformed traffic on the data socket, each refused with a message that says why."""
    rng = np.random.default_rng(2)
    with grpc.insecure_channel("unix:" + grpc_path) as channel:
        reg = pb_grpc.NodeStub(channel).Register(register_request(), timeout=10)
    good = pb.AttachRequest(
        session_id=reg.session_id, session_secret=reg.session_secret
    ).SerializeToString()
    wrong = pb.AttachRequest(
        session_id=reg.session_id, session_secret=b"w" * 32
    ).SerializeToString()
    arena = ClientArena(1 << 20)
    small = ClientArena(1 << 16)
    unsealed = os.memfd_create("unsealed")
    os.ftruncate(unsealed, 1 << 20)
    r, w = os.pipe()
    try:
        assert "AttachRequest" in attach_refused(path, b"\xff" + rng.bytes(100), [])
        assert "AttachRequest" in attach_refused(path, pack(MSG_OP, rng.bytes(100)), [arena.fd])
        assert "undecodable" in attach_refused(path, pack(MSG_ATTACH, good[:20]), [arena.fd])
        assert "exactly one memfd, not 0" in attach_refused(path, pack(MSG_ATTACH, good), [])
        assert "not 2" in attach_refused(path, pack(MSG_ATTACH, good), [arena.fd, arena.fd])
        assert "wrong session secret" in attach_refused(path, pack(MSG_ATTACH, wrong), [arena.fd])
        assert "memfd" in attach_refused(path, pack(MSG_ATTACH, good), [r])
        assert "F_SEAL_SHRINK" in attach_refused(path, pack(MSG_ATTACH, good), [unsealed])
        assert "bytes" in attach_refused(path, pack(MSG_ATTACH, good), [small.fd])

        # After all that the session can still attach, and an op naming bytes outside its
        # arena is refused with a message that says so.
        with data_conn(path) as s:
            socket.send_fds(s, [pack(MSG_ATTACH, good)], [arena.fd])
            kind, payload = unpack(s.recv(MAX_MESSAGE_BYTES))
            assert (kind, pb.AttachReply.FromString(payload).ok) == (MSG_ATTACH_REPLY, True)
            assert "already attached" in attach_refused(path, pack(MSG_ATTACH, good), [arena.fd])
            op = pb.OpRequest(
                request_id=1,
                seq=1,
                part=0,
                parts=1,
                kind=pb.ALL_REDUCE,
                dtype=pb.FLOAT32,
                count=1 << 20,
                reduce_op=pb.SUM,
                input=pb.Region(offset=0, nbytes=4 << 20),
                output=pb.Region(offset=0, nbytes=4 << 20),
            )
            s.send(pack(MSG_OP, op.SerializeToString()))
            kind, payload = unpack(s.recv(MAX_MESSAGE_BYTES))
            reply = pb.OpReply.FromString(payload)
            assert (kind, reply.request_id, reply.ok) == (MSG_OP_REPLY, 1, False)
            assert "outside its arena" in reply.error, reply.error
            # Garbage after a good attach ends the connection (and that rank's membership).
            s.send(pack(MSG_OP, b"\xff" * 64))
            assert s.recv(MAX_MESSAGE_BYTES) == b""
    finally:
        for fd in (unsealed, r, w):
            os.close(fd)
        arena.close()
        small.close()


@pytest.mark.timeout(120)
def test_garbage_on_sockets_leaves_other_jobs_alone(daemon, spawn_ranks):
    steady = spawn_ranks(steady_job, 2, 2, daemon.socket, secrets.token_bytes(16))
    steady.wait_for("ready")

    grpc_garbage(daemon.socket)
    data_socket_garbage(daemon.socket + DATA_SOCKET_SUFFIX, daemon.socket)

    with grpc.insecure_channel("unix:" + daemon.socket) as channel:
        st = pb_grpc.NodeStub(channel).Status(pb.StatusRequest(), timeout=10)
    comms = {c.job_id: c for c in st.comms}
    assert "intruder" not in comms and "garbled" not in comms, (
        "a dropped connection left its rank registered"
    )
    assert comms["steady"].failed == "" and len(comms["steady"].ranks) == 2, comms["steady"]

    steady.send("go")
    assert steady.join() == [30, 30]
    with grpc.insecure_channel("unix:" + daemon.socket) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=10
        )
    assert health.status == health_pb2.HealthCheckResponse.SERVING
