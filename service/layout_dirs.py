"""The layouts' directories under the data directory: what each is, and what lies in those no
session has opened since the daemon started.

Each layout that had a disk tier has ``<data_dir>/<signature hex>/``: ``namespace.json`` (the
signature, the block size in bytes and, since layouts are described, the tokens per block and
the layout's canonical text: ``layout_shape``) and ``lmdb/``, the disk tier. A directory of an
older daemon has no description: its layout is then known by signature and block bytes only.

At start the daemon reads every such directory once (``resting_layouts``): its shape from
``namespace.json``, its blocks from the index's entry count (``tiers.disk.census``, O(1) per
layout). A layout whose blocks no engine asks for any more (the engines' block size changed,
say) shows in the statistics with them, until an engine opens it again or the operator removes
its directory.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import lmdb

from kvtier.service.layout_shape import LayoutShape
from kvtier.tiers.disk.census import count_blocks

log = logging.getLogger(__name__)

NAMESPACE_FILE = "namespace.json"
DISK_DIR = "lmdb"
_SIGNATURE_HEX = 32


@dataclass(frozen=True, slots=True)
class RestingLayout:
    """A layout found in the data directory at start, not opened since."""

    signature: bytes
    block_bytes: int
    """0 where its ``namespace.json`` is missing or unreadable."""
    shape: LayoutShape
    disk_blocks: int
    disk: str
    """"ok", or why its index could not be read (``disk_blocks`` is then 0)."""


def read_namespace(directory: Path) -> dict:
    """The fields of the layout directory's ``namespace.json``; {} if absent or unreadable."""
    path = directory / NAMESPACE_FILE
    try:
        fields = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.error("%s is unreadable (%s)", path, exc)
        return {}
    return fields if isinstance(fields, dict) else {}


def write_namespace(
    directory: Path, signature: bytes, block_bytes: int, shape: LayoutShape
) -> None:
    """Writes the layout directory's ``namespace.json`` (atomically: a new file renamed)."""
    path = directory / NAMESPACE_FILE
    tmp = path.with_suffix(".tmp")
    fields = {"layout_signature": signature.hex(), "block_bytes": block_bytes, **shape.saved()}
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(fields, f)
    os.replace(tmp, path)


def resting_layouts(root: Path) -> list[RestingLayout]:
    """Every layout directory under ``root`` (the data directory, held by this daemon), read
    once: a layout with no blocks on disk is left out."""
    found = []
    try:
        entries = sorted(root.iterdir())
    except FileNotFoundError:
        return []
    for directory in entries:
        signature = _signature_of(directory)
        if signature is None:
            continue
        fields = read_namespace(directory)
        block_bytes = fields.get("block_bytes")
        block_bytes = block_bytes if isinstance(block_bytes, int) and block_bytes > 0 else 0
        shape = LayoutShape.from_saved(signature, fields)
        try:
            blocks, state = count_blocks(str(directory / DISK_DIR)), "ok"
        except (OSError, RuntimeError, lmdb.Error) as exc:  # RuntimeError: DirectoryInUse
            blocks, state = 0, f"unread: {exc}"
            log.error(
                "layout %s: its disk tier %s could not be read: %s", directory.name, directory, exc
            )
        if blocks == 0 and state == "ok":
            continue
        log.info(
            "layout %s (%s): %d blocks on disk, no session has opened it yet",
            directory.name,
            shape.label(),
            blocks,
        )
        found.append(RestingLayout(signature, block_bytes, shape, blocks, state))
    return found


def _signature_of(directory: Path) -> bytes | None:
    """The signature a layout directory is named by, or None for anything else."""
    if len(directory.name) != _SIGNATURE_HEX or not directory.is_dir():
        return None
    try:
        return bytes.fromhex(directory.name)
    except ValueError:
        return None
