"""The vLLM connector plugin: ``kv_connector_module_path: kvtier.connector.vllm``.

vLLM imports this package and takes ``KVTierConnector`` from it. The class lives in
``connector.py``; it is resolved on first use so that the parts that need no vLLM (hashing of
groups, hit planning, request state) import without it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVTierConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVTierConnector":
        from kvtier.connector.vllm.connector import KVTierConnector

        return KVTierConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
