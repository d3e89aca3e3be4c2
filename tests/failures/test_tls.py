"""Mutual TLS between daemons (``--tls-cert/--tls-key/--tls-ca``), on loopback nodes.

Certificates are made here: a CA that signs both nodes' certificates, and a second, rogue
CA. A job spanning two TLS daemons runs and gets correct results, and both the Peer service
and the data port speak TLS only. A daemon that does not have the CA — its certificate
signed by the rogue CA, or no TLS at all — or whose certificate names another node is
refused: the job fails on both nodes with a message naming the lost node and why, instead
of hanging or talking in the clear.
"""

from __future__ import annotations

import datetime
import re
import socket
import ssl
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from smddp.client.communicator import daemon_info
from smddp.server.peer_wire import HELLO_REFUSED, pack_hello
from smddp.server.tls import contexts

PG_TIMEOUT_S = 6  # how long the node that was never connected waits for its peer


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(folder: Path, stem: str, key: Any, cert: Any) -> tuple[str, str]:
    key_path, cert_path = folder / f"{stem}.key", folder / f"{stem}.pem"
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(cert_path), str(key_path)


def make_ca(folder: Path, cn: str) -> tuple[Any, Any, str]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(_name(cn))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    path, _ = _write(folder, cn, key, cert)
    return key, cert, path


def make_cert(folder: Path, ca: tuple[Any, Any, str], cn: str) -> tuple[str, str]:
    """A certificate for ``cn`` (client and server use), signed by ``ca``; (cert, key) paths."""
    ca_key, ca_cert, _ = ca
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(cn)]), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage(
                [x509.oid.ExtendedKeyUsageOID.SERVER_AUTH, x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    return _write(folder, cn, key, cert)


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, Any]:
    """node0, node1 signed by the CA; rogue signed by the rogue CA (which trusts itself)."""
    folder = tmp_path / "pki"
    folder.mkdir()
    ca = make_ca(folder, "smddp-test-ca")
    rogue_ca = make_ca(folder, "smddp-rogue-ca")
    return {
        "ca": ca[2],
        "rogue_ca": rogue_ca[2],
        "node0": make_cert(folder, ca, "node0"),
        "node1": make_cert(folder, ca, "node1"),
        "rogue": make_cert(folder, rogue_ca, "rogue"),
    }


def tls_args(cert_key: tuple[str, str], ca: str) -> tuple[str, ...]:
    return ("--tls-cert", cert_key[0], "--tls-key", cert_key[1], "--tls-ca", ca)


def info(node: Any) -> Any:
    import grpc

    from smddp.v1 import smddp_pb2 as pb
    from smddp.v1 import smddp_pb2_grpc as pb_grpc

    with grpc.insecure_channel("unix:" + node.daemon.socket) as ch:
        return pb_grpc.NodeStub(ch).Info(pb.InfoRequest(), timeout=10)


@pytest.mark.timeout(120)
def test_job_runs_over_mutual_tls(pki, loopback_daemons, launch_failure_world):
    nodes = loopback_daemons([tls_args(pki["node0"], pki["ca"]), tls_args(pki["node1"], pki["ca"])])
    results = launch_failure_world(
        "checked_ops", nodes, [0, 0, 1], {}, env={"SMDDP_ARENA_BYTES": str(1 << 21)}
    ).join()
    assert [r["ops"] for r in results] == [7, 7, 7]

    node1 = info(nodes[1])
    port = node1.data_port
    # The Peer service (gRPC) takes TLS only: a plain call does not get through.
    import grpc

    from smddp.v1 import smddp_pb2 as pb
    from smddp.v1 import smddp_pb2_grpc as pb_grpc

    with grpc.insecure_channel(node1.peer_address) as ch, pytest.raises(grpc.RpcError) as refused:
        pb_grpc.PeerStub(ch).Join(
            pb.JoinRequest(peer=pb.PeerRequest(job_id="j", comm_id="0")), timeout=10
        )
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    # In the clear, the data port answers only that it speaks TLS.
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(pack_hello("j", "c", 0, bytes(32)))
        answer = s.recv(4096)
    assert answer[0] == HELLO_REFUSED and b"over TLS only" in answer, answer
    # With TLS but a certificate of another CA, the handshake fails.
    _, rogue_client = contexts(*pki["rogue"], pki["rogue_ca"])
    rogue_client.load_verify_locations(
        cafile=pki["ca"]
    )  # trusts the node; the node does not trust it
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        pytest.raises((ssl.SSLError, ConnectionError)),
        rogue_client.wrap_socket(raw, server_hostname="node1") as tls,
    ):
        tls.sendall(pack_hello("j", "c", 0, bytes(32)))
        assert tls.recv(4096) == b"", "the node answered a peer whose CA it does not know"
        raise ConnectionError("closed")
    assert "refused a peer connection" in nodes[1].daemon.log()


# (node0's daemon, node1's daemon, what node0's ranks are told about node1)
REFUSALS = {
    "rogue certificate": (
        "node0",
        "rogue",
        r"refused our connection: TLS handshake failed: .*CERTIFICATE_VERIFY_FAILED.*",
    ),
    "peer without TLS": (
        "node0",
        None,
        r"refused our connection: TLS handshake failed: .* \(do both daemons run with --tls-cert, --tls-key and "
        r"--tls-ca of the same CA\?\)",
    ),
    "plain daemon to TLS": (
        None,
        "node1",
        r"refused our connection: it closed our connection unanswered: it takes peer connections "
        r"over TLS only "
        r"\(--tls-cert\), and this daemon has no TLS",
    ),
    "certificate of another node": (
        "node0",
        "node0",
        r"refused our connection: TLS: its certificate does not name node node1 .*",
    ),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(REFUSALS))
def test_daemon_without_the_ca_is_refused(case, pki, loopback_daemons, launch_failure_world):
    first, second, told = REFUSALS[case]
    args = [
        tls_args(pki[first], pki["ca"]) if first else (),
        tls_args(pki[second], pki["rogue_ca"] if second == "rogue" else pki["ca"])
        if second
        else (),
    ]
    nodes = loopback_daemons(args)
    results = launch_failure_world(
        "until_failure", nodes, [0, 1], {"pg_timeout_s": PG_TIMEOUT_S, "run_s": 30}
    ).join()

    r0, r1 = results
    assert r0["type"] == "SmddpRankFailedError", r0
    assert re.fullmatch(
        rf"job j[0-9a-f]{{16}} comm 0: lost node node1 \(daemon at 127\.0\.0\.1:\d+\): {told}",
        r0["message"],
    ), r0
    assert r0["ops"] == 0 and r1["ops"] == 0
    # node1 was never connected: its rank fails after the process group's timeout, naming node0
    # and the address of node0's daemon, as the README says.
    node0 = daemon_info(nodes[0].daemon.socket).peer_address
    job = r0["message"].split(" ", 2)[1]
    assert r1["type"] == "SmddpRankFailedError", r1
    assert (
        r1["message"]
        == f"job {job} comm 0: no connection to node node0 ({node0}) within {PG_TIMEOUT_S} s"
    ), r1
    print(f"{case}: node0's rank: {r0['message']}\nnode1's rank: {r1['message']}")
