"""Generate the Python stubs of protos/smddp/v1/*.proto (committed beside them).

Run with the pinned grpcio-tools of the ``test`` extra. ``--check`` regenerates into a
temporary folder and fails when the committed stubs differ, so CI catches a .proto edited
without regenerating.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PACKAGE_DIR = PROTO_ROOT / "smddp" / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")
# mypy-protobuf's plugin (test extra) writes the typed stub of the gRPC module, which
# grpcio-tools does not; scripts/typecheck.sh reads it.
MYPY_GRPC_PLUGIN = Path(sys.executable).parent / "protoc-gen-mypy_grpc"


def generate(out_dir: Path) -> list[Path]:
    """Runs protoc on every .proto of smddp.v1, writing stubs under ``out_dir``.

    Returns:
        The generated files.
    """
    from grpc_tools import protoc  # only needed by this script and the test extra

    protos = sorted(PACKAGE_DIR.glob("*.proto"))
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--plugin=protoc-gen-mypy_grpc={MYPY_GRPC_PLUGIN}",
        f"--mypy_grpc_out={out_dir}",
        *(str(p) for p in protos),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    gen_dir = out_dir / "smddp" / "v1"
    return sorted(p for p in gen_dir.iterdir() if p.name.endswith(GENERATED_SUFFIXES))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if the stubs are stale")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        stale = []
        for path in fresh:
            target = PACKAGE_DIR / path.name
            if args.check:
                if not target.exists() or not filecmp.cmp(path, target, shallow=False):
                    stale.append(target.relative_to(ROOT))
            else:
                target.write_bytes(path.read_bytes())
    if stale:
        print("stale generated stubs (run scripts/gen_protos.py):", *stale, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
