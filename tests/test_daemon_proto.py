"""The committed gRPC stubs are what ``proto/generate.py`` makes from ``kvtier.proto``."""

from __future__ import annotations

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
