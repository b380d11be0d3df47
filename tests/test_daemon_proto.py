"""The committed gRPC stubs are what ``proto/generate.py`` makes from ``kvtier.proto``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvtier.proto import generate

pytest.importorskip("grpc_tools")


def test_committed_stubs_are_current(tmp_path: Path):
    for fresh in generate.generate(tmp_path):
        committed = generate.HERE / fresh.name
        assert committed.exists(), f"{committed} is missing: run python -m kvtier.proto.generate"
        assert committed.read_text() == fresh.read_text(), (
            f"{committed.name} is stale: run python -m kvtier.proto.generate"
        )


def test_the_stubs_ask_for_the_grpcio_kvtier_depends_on():
    """A stub stamped newer than ``pyproject.toml``'s grpcio floor would refuse installs the
    floor allows."""
    pyproject = (Path(generate.HERE).parent / "pyproject.toml").read_text()
    floor = re.search(r'^\s*"grpcio>=([^"]+)",$', pyproject, flags=re.M)
    assert floor is not None and floor.group(1) == generate.GRPC_FLOOR
    stub = (generate.HERE / "kvtier_pb2_grpc.py").read_text()
    assert f"GRPC_GENERATED_VERSION = '{generate.GRPC_FLOOR}'" in stub
