"""Regenerates the Python stubs of ``kvtier.proto`` beside it (or into another directory).

Run ``python -m kvtier.proto.generate`` after editing the ``.proto``; the generated files are
committed and a test checks that they match what this script produces. The gRPC module's
import of the message module is rewritten to be package-relative, so the stubs import as
``kvtier.proto.kvtier_pb2`` without ``proto/`` on ``sys.path``.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTO = "kvtier.proto"
OUTPUTS = ("kvtier_pb2.py", "kvtier_pb2.pyi", "kvtier_pb2_grpc.py")
GRPC_FLOOR = "1.85.1"
"""The oldest grpcio kvtier accepts (``pyproject.toml``). The gRPC stub refuses to import
under a grpcio older than the version it is stamped with, so it is stamped with this floor, not
with the generator's own version (a newer grpcio-tools would otherwise raise every install's
floor, and make the committed stubs differ by one line from a fresh generation)."""


def generate(out_dir: Path = HERE) -> list[Path]:
    """Runs protoc on ``kvtier.proto`` into ``out_dir``; returns the files written."""
    from grpc_tools import protoc  # build-time dependency only

    out_dir.mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).resolve().parent / "_proto"
    rc = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{HERE}",
            f"-I{include}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(HERE / PROTO),
        ]
    )
    if rc != 0:
        raise RuntimeError(f"protoc failed with status {rc}")
    grpc_module = out_dir / "kvtier_pb2_grpc.py"
    text = grpc_module.read_text()
    text = re.sub(r"^import kvtier_pb2 as", "from . import kvtier_pb2 as", text, flags=re.M)
    text = re.sub(
        r"^GRPC_GENERATED_VERSION = '[^']*'",
        f"GRPC_GENERATED_VERSION = '{GRPC_FLOOR}'",
        text,
        flags=re.M,
    )
    grpc_module.write_text(text)
    return [out_dir / name for name in OUTPUTS]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE, help="output directory")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
