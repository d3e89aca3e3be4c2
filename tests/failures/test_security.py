"""Who may use smddpd, and what it refuses.

- The sockets (gRPC and data) are 0600 in a 0700 folder; with ``--socket-group`` 0660 in
  a 0750 folder of that group. Arenas are sealed memfds, never files in /dev/shm.
- A process of another uid (``setpriv --reuid``) cannot reach a 0600 daemon at all; given
  the socket group, it still cannot join (attach to) a job that root's ranks own — refused
  with a message naming its uid and the job — and the job does not notice.
- A wrong job token is UNAUTHENTICATED; a session id with another session's secret, or a
  session that has ended, is refused on every door (Ops, Deregister, the data socket).
- Limits (--max-jobs, --max-ranks-per-job, --max-arena-bytes, the gRPC and data-socket
  message sizes) each give an error that names the limit.
"""

from __future__ import annotations

import grp
import os
import secrets
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from smddp.client import connect
from smddp.client.arena import ClientArena
from smddp.client.errors import ConnectError
from smddp.core.wire import (
    DATA_SOCKET_SUFFIX,
    MAX_MESSAGE_BYTES,
    MSG_ATTACH,
    MSG_ATTACH_REPLY,
    MSG_OP,
    pack,
    unpack,
)
from smddp.server.ctl import ask_status
from smddp.v1 import smddp_pb2 as pb
from smddp.v1 import smddp_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[2]
NOBODY = 65534
GROUP = "nogroup"  # gid 65534: the group of the other user in these tests
SO_SNDBUFFORCE = 32  # root may send data-socket messages larger than the default buffer


def _mode(path: str) -> tuple[int, int, int]:
    st = os.stat(path)
    return stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid


def as_nobody(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Runs ``python -c code args`` as uid/gid 65534 with no supplementary groups."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMDDP_")}
    return subprocess.run(
        [
            "setpriv",
            "--reuid",
            str(NOBODY),
            "--regid",
            str(NOBODY),
            "--clear-groups",
            sys.executable,
            "-c",
            code,
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
        env=env,
        check=False,
    )


def _blocked_for_others(path: Path) -> Path | None:
    """The first folder on the way to ``path`` that users other than its owner cannot enter."""
    for folder in [*reversed(path.parents), path]:
        if folder.is_dir() and not os.stat(folder).st_mode & stat.S_IXOTH:
            return folder
    return None


@pytest.fixture(scope="module")
def other_user() -> None:
    """uid 65534 ready to run smddp's client: skipped unless root; as root, failed if not ready.

    CI runs as root with ``.venv`` made by scripts/setup.sh from /usr/bin/python3, so uid
    65534 can run the same interpreter and packages; a machine where it cannot is a broken
    setup, named here, not a reason to leave these tests out.
    """
    if os.geteuid() != 0:
        pytest.skip("needs root to run a client as another uid (setpriv --reuid)")
    if shutil.which("setpriv") is None:
        pytest.fail("needs setpriv (Debian package util-linux)", pytrace=False)
    try:
        gid = grp.getgrnam(GROUP).gr_gid
    except KeyError:
        pytest.fail(f"needs the group {GROUP} (gid {NOBODY})", pytrace=False)
    assert gid == NOBODY, f"group {GROUP} is gid {gid}, not {NOBODY}"
    probe = as_nobody("import smddp.client")
    if probe.returncode != 0:
        blocked = [
            f"{p} (mode {stat.S_IMODE(os.stat(p).st_mode):o})"
            for p in {
                _blocked_for_others(Path(x))
                for x in (sys.prefix, os.path.realpath(sys.executable), REPO)
            }
            if p is not None
        ]
        hint = f"; others cannot enter {', '.join(sorted(blocked))}" if blocked else ""
        pytest.fail(
            f"uid {NOBODY} cannot import smddp.client with {sys.executable}{hint} (the venv must "
            "come "
            "from a Python that every user may run, as scripts/setup.sh makes it, in a folder "
            "others "
            f"may enter):\n{probe.stderr[-1500:]}",
            pytrace=False,
        )


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A 0755 folder (anyone may look in); the daemon creates its socket folder inside."""
    folder = Path(tempfile.mkdtemp(prefix="smddp-sec-"))
    os.chmod(folder, 0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


# Run as uid 65534: join job argv[1] (token hex argv[2]) as rank argv[3] of argv[4] at argv[5].
JOIN = r"""
import sys
from smddp.client import connect
from smddp.client.errors import ConnectError
from smddp.server.ctl import ask_status
job, token, rank, world, path = sys.argv[1], bytes.fromhex(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
try:
    comm = connect(job, token, rank, world, socket_path=path, arena_bytes=1 << 20)
except ConnectError as exc:
    print("REFUSED", exc)
    sys.exit(0)
if world == 1:
    import numpy as np
    x = np.arange(10, dtype=np.int64)
    comm.all_reduce(x).wait()
    assert (x == np.arange(10)).all()
comm.close()
print("JOINED")
"""

# Run as uid 65534: attach a fresh arena with session argv[1] / secret hex argv[2] at argv[3].
ATTACH = r"""
import socket, sys
from smddp.client.arena import ClientArena
from smddp.v1 import smddp_pb2 as pb
from smddp.core.wire import MSG_ATTACH, MAX_MESSAGE_BYTES, pack, unpack
arena = ClientArena(1 << 20)
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.settimeout(10)
try:
    s.connect(sys.argv[3])
except OSError as exc:
    print("CONNECT", exc)
    sys.exit(0)
req = pb.AttachRequest(session_id=sys.argv[1], session_secret=bytes.fromhex(sys.argv[2]))
socket.send_fds(s, [pack(MSG_ATTACH, req.SerializeToString())], [arena.fd])
kind, payload = unpack(s.recv(MAX_MESSAGE_BYTES))
reply = pb.AttachReply.FromString(payload)
print("OK" if reply.ok else "REFUSED " + reply.error)
print("CLOSED" if s.recv(MAX_MESSAGE_BYTES) == b"" else "OPEN")
"""


def stub(path: str) -> pb_grpc.NodeStub:
    return pb_grpc.NodeStub(grpc.insecure_channel("unix:" + path))


def register_request(**fields: object) -> pb.RegisterRequest:
    req = pb.RegisterRequest(
        job_id="rootjob",
        job_token=b"t" * 32,
        comm_id="0",
        rank=0,
        world_size=1,
        node_id="sec",
        pid=os.getpid(),
        arena_bytes=1 << 20,
    )
    for name, value in fields.items():
        setattr(req, name, value)
    return req


def rpc_error(call, *args, **kwargs) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(*args, timeout=10, **kwargs)
    return info.value


def status(path: str) -> pb.StatusReply:
    return ask_status(path)  # as smddpctl status asks: gRPC cannot tell who calls


def pair_all_reduce(c0, c1) -> None:
    """An all_reduce of two ranks of this process, one in a thread."""
    a, b = np.arange(1000, dtype=np.float32), np.ones(1000, dtype=np.float32)
    h = threading.Thread(target=lambda: c1.all_reduce(b).wait())
    h.start()
    c0.all_reduce(a).wait()
    h.join(30)
    np.testing.assert_array_equal(a, np.arange(1000, dtype=np.float32) + 1)
    np.testing.assert_array_equal(b, a)


# -- sockets and arenas ----------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_sockets_are_owner_only_and_arenas_are_memfds(daemon_at, open_dir, other_user):
    path = str(open_dir / "run" / "smddpd.sock")
    d = daemon_at(path)
    assert _mode(str(open_dir / "run")) == (0o700, 0, 0)
    assert _mode(path) == (0o600, 0, 0)
    assert _mode(path + DATA_SOCKET_SUFFIX) == (0o600, 0, 0)

    shm_before = set(os.listdir("/dev/shm"))
    token = secrets.token_bytes(32)
    c0 = connect("rootjob", token, 0, 2, socket_path=path, arena_bytes=1 << 20)
    c1 = connect("rootjob", token, 1, 2, socket_path=path, arena_bytes=1 << 20)
    pair_all_reduce(c0, c1)
    # The arenas are memfds: in both processes, and nothing new in /dev/shm.
    assert os.readlink(f"/proc/self/fd/{c0.session.arena.fd}").startswith("/memfd:smddp-arena")
    maps = Path(f"/proc/{d.proc.pid}/maps").read_text()
    assert maps.count("/memfd:smddp-arena") >= 2, "the daemon has not mapped the arenas"
    assert "/dev/shm" not in maps, [line for line in maps.splitlines() if "/dev/shm" in line]
    assert not {f for f in set(os.listdir("/dev/shm")) - shm_before if "smddp" in f}

    # Another uid reaches neither socket: not through the folder...
    joined = as_nobody(JOIN, "rootjob", token.hex(), "1", "2", path)
    assert joined.stdout.startswith("REFUSED"), joined
    assert "no smddpd socket found" in joined.stdout, joined.stdout
    # ...nor, in a folder open to all, through the sockets themselves.
    os.chmod(open_dir / "run", 0o755)
    joined = as_nobody(JOIN, "otherjob", token.hex(), "0", "1", path)
    assert joined.stdout.startswith("REFUSED"), joined
    assert "Permission denied" in joined.stdout, joined.stdout
    attached = as_nobody(ATTACH, c0.session.session_id, "00" * 32, path + DATA_SOCKET_SUFFIX)
    assert attached.stdout.startswith("CONNECT") and "Permission denied" in attached.stdout, (
        attached
    )
    pair_all_reduce(c0, c1)
    c0.close()
    c1.close()


@pytest.mark.timeout(60)
def test_socket_group_may_connect_but_not_join_roots_job(daemon_at, open_dir, other_user):
    path = str(open_dir / "run" / "smddpd.sock")
    daemon_at(path, ("--socket-group", GROUP))
    assert _mode(str(open_dir / "run")) == (0o750, 0, NOBODY)
    assert _mode(path) == (0o660, 0, NOBODY)
    assert _mode(path + DATA_SOCKET_SUFFIX) == (0o660, 0, NOBODY)

    token = secrets.token_bytes(32)
    c0 = connect("rootjob", token, 0, 2, socket_path=path, arena_bytes=1 << 20)

    # uid 65534, in the socket's group, knows the token: its rank is refused at attach...
    joined = as_nobody(JOIN, "rootjob", token.hex(), "1", "2", path)
    assert joined.returncode == 0, joined.stderr
    refusal = "job rootjob comm 0: uid 65534 may not join job rootjob, which belongs to uid 0"
    assert joined.stdout.strip() == f"REFUSED smddpd at {path} refused the arena: {refusal}", (
        joined.stdout
    )
    print(joined.stdout.strip().removeprefix("REFUSED "))
    # ...and root's job did not notice: healthy, rank 1's slot free for root's own rank.
    (comm,) = status(path).comms
    assert comm.failed == "" and [r.rank for r in comm.ranks] == [0], comm

    # With a stolen session (root registered it, has not attached yet) it cannot attach
    # either; the refused session is forgotten (whoever holds its secret could deregister it
    # anyway), and the job's other ranks still do not notice.
    reg = stub(path).Register(register_request(job_token=token, rank=1, world_size=2), timeout=10)
    attached = as_nobody(
        ATTACH, reg.session_id, reg.session_secret.hex(), path + DATA_SOCKET_SUFFIX
    )
    assert attached.stdout.splitlines() == [f"REFUSED {refusal}", "CLOSED"], attached
    err = rpc_error(
        stub(path).Deregister,
        pb.DeregisterRequest(session_id=reg.session_id, session_secret=reg.session_secret),
    )
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err
    (comm,) = status(path).comms
    assert comm.failed == "" and [r.rank for r in comm.ranks] == [0], comm
    c1 = connect("rootjob", token, 1, 2, socket_path=path, arena_bytes=1 << 20)
    pair_all_reduce(c0, c1)

    # The group is for using the daemon: uid 65534 runs a job of its own.
    own = as_nobody(JOIN, "nobodyjob", secrets.token_hex(32), "0", "1", path)
    assert own.stdout.strip() == "JOINED", own
    c0.close()
    c1.close()


# -- tokens and sessions ---------------------------------------------------------------------


def _ops_refused(path: str, session_id: str, secret: bytes) -> grpc.RpcError:
    first = pb.OpRequest(
        request_id=1, session_id=session_id, session_secret=secret, seq=1, parts=1, kind=pb.BARRIER
    )
    return rpc_error(lambda timeout: list(stub(path).Ops(iter([first]), timeout=timeout)))


def _attach_reply(path: str, session_id: str, secret: bytes) -> str:
    arena = ClientArena(1 << 20)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.settimeout(10)
            s.connect(path + DATA_SOCKET_SUFFIX)
            req = pb.AttachRequest(session_id=session_id, session_secret=secret)
            socket.send_fds(s, [pack(MSG_ATTACH, req.SerializeToString())], [arena.fd])
            kind, payload = unpack(s.recv(MAX_MESSAGE_BYTES))
            assert kind == MSG_ATTACH_REPLY
            reply = pb.AttachReply.FromString(payload)
            assert not reply.ok
            assert s.recv(MAX_MESSAGE_BYTES) == b"", "a refused attach left the connection open"
            return reply.error
    finally:
        arena.close()


@pytest.mark.timeout(60)
def test_wrong_token_and_replayed_secrets_are_refused(system_daemon):
    path = system_daemon.socket
    token_a, token_b = secrets.token_bytes(32), secrets.token_bytes(32)
    a0 = connect("job-a", token_a, 0, 2, socket_path=path, arena_bytes=1 << 20)

    # A wrong job token.
    err = rpc_error(
        stub(path).Register,
        register_request(job_id="job-a", job_token=token_b, rank=1, world_size=2),
    )
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    assert err.details() == "job job-a comm 0 rank 1: wrong job token"
    with pytest.raises(ConnectError, match="wrong job token") as info:
        connect("job-a", token_b, 1, 2, socket_path=path, arena_bytes=1 << 20)
    print(info.value)

    # Job A's session id with job B's session secret, on every door.
    b0 = connect("job-b", token_b, 0, 1, socket_path=path, arena_bytes=1 << 20)
    a_id, a_secret = a0.session.session_id, a0.session._secret
    b_secret = b0.session._secret
    refusal = f"unknown session {a_id!r} or wrong session secret"
    err = _ops_refused(path, a_id, b_secret)
    assert (err.code(), err.details()) == (grpc.StatusCode.UNAUTHENTICATED, refusal)
    err = rpc_error(
        stub(path).Deregister, pb.DeregisterRequest(session_id=a_id, session_secret=b_secret)
    )
    assert (err.code(), err.details()) == (grpc.StatusCode.UNAUTHENTICATED, refusal)
    assert _attach_reply(path, a_id, b_secret) == refusal

    # Job A is untouched: its second rank joins and both reduce.
    a1 = connect("job-a", token_a, 1, 2, socket_path=path, arena_bytes=1 << 20)
    pair_all_reduce(a0, a1)
    a0.close()
    a1.close()

    # A session that has ended cannot be replayed, even with its own secret.
    refusal = f"unknown session {a_id!r} or wrong session secret"
    err = _ops_refused(path, a_id, a_secret)
    assert (err.code(), err.details()) == (grpc.StatusCode.UNAUTHENTICATED, refusal)
    err = rpc_error(
        stub(path).Deregister, pb.DeregisterRequest(session_id=a_id, session_secret=a_secret)
    )
    assert (err.code(), err.details()) == (grpc.StatusCode.UNAUTHENTICATED, refusal)
    assert _attach_reply(path, a_id, a_secret) == refusal

    x = np.arange(5, dtype=np.float64)
    b0.all_reduce(x).wait()
    np.testing.assert_array_equal(x, np.arange(5, dtype=np.float64))
    b0.close()
    assert status(path).comms == []


# -- limits ----------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_limits_give_errors_that_name_them(start_daemon):
    d = start_daemon(
        args=("--max-jobs", "1", "--max-ranks-per-job", "2", "--max-arena-bytes", str(1 << 20)),
        name="limits",
    )
    path = d.socket
    token = secrets.token_bytes(32)
    first = connect("first", token, 0, 1, socket_path=path, arena_bytes=1 << 20)
    exhausted = grpc.StatusCode.RESOURCE_EXHAUSTED

    cases = [
        (
            register_request(job_id="second", job_token=token),
            exhausted,
            "job second comm 0: the daemon already serves 1 jobs (--max-jobs)",
        ),
        (
            register_request(job_id="first", job_token=token, comm_id="wide", world_size=3),
            exhausted,
            "job first comm wide: world_size 3 is outside 1..2 (--max-ranks-per-job)",
        ),
        (
            register_request(job_id="first", job_token=token, comm_id="big", arena_bytes=2 << 20),
            exhausted,
            "job first comm big rank 0: arena_bytes 2097152 is outside 65536..1048576 "
            "(--max-arena-bytes)",
        ),
        (
            register_request(job_id="first", job_token=b"t" * 2000, comm_id="1"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "job first comm 1: job_token must have 16-1024 bytes",
        ),
    ]
    for req, code, message in cases:
        err = rpc_error(stub(path).Register, req)
        assert (err.code(), err.details()) == (code, message)
    with pytest.raises(ConnectError) as info:
        connect("second", token, 0, 1, socket_path=path, arena_bytes=1 << 20)
    assert str(info.value).endswith("the daemon already serves 1 jobs (--max-jobs)"), info.value
    print(info.value)

    # A gRPC message over 4 MiB.
    err = rpc_error(stub(path).Register, register_request(job_id="first", node_id="n" * (5 << 20)))
    assert err.code() == exhausted and "larger than max" in err.details(), err.details()

    # A data-socket message over 1 MiB (root may raise its send buffer that far) ends the
    # connection, and the log says why; the daemon serves on.
    victim = connect("first", token, 0, 1, socket_path=path, arena_bytes=1 << 20, comm_id="victim")
    s = victim.session._sock
    s.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, 4 * MAX_MESSAGE_BYTES)
    big = pb.OpRequest(request_id=1, seq=1, parts=1, kind=pb.ALL_TO_ALL, dtype=pb.FLOAT32)
    big.send_blocks.extend(pb.Region(offset=i, nbytes=1) for i in range(150_000))
    data = pack(MSG_OP, big.SerializeToString())
    assert len(data) > MAX_MESSAGE_BYTES
    s.sendall(data)
    s.settimeout(10)
    assert s.recv(MAX_MESSAGE_BYTES) == b""
    assert f"a message of more than {MAX_MESSAGE_BYTES} bytes on the data socket" in d.log()
    victim.session.close(deregister=False)

    x = np.ones(3)
    first.all_reduce(x).wait()
    np.testing.assert_array_equal(x, np.ones(3))
    first.close()
    second = connect("second", token, 0, 1, socket_path=path, arena_bytes=1 << 20)
    second.close()
