"""Every layout the daemon serves, each with its own arena, disk directory and budgets.

One daemon serves every model on the node. The first ``Open`` of a layout (signature and
block size) creates its arena (``<arena_dir>/kvtier-<name>-<layout>``, ``host_bytes``) and its
disk tier (``<data_dir>/<layout>/``, ``disk_bytes``); a layout served before finds its disk
tier there again, with every block it committed. Layouts are built at their first ``Open``
only, so a layout no engine uses any more costs no shared memory; its blocks on disk are
counted once at start and shown in the statistics (``layout_dirs``), with its shape, which
``Open`` teaches the store (``layout_shape``) and the layout's directory keeps. At most
``max_layouts`` are served at once. A data directory of the one-layout daemon
(``namespace.json`` and ``lmdb/`` at its top) is moved into its layout's directory at start.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from kvtier.proto.contract import MIN_BLOCK_BYTES
from kvtier.proto.lookup_index import index_path
from kvtier.service.arena import Arena
from kvtier.service.config import DaemonConfig
from kvtier.service.events import EventHub
from kvtier.service.layout_dirs import (
    DISK_DIR,
    NAMESPACE_FILE,
    RestingLayout,
    read_namespace,
    resting_layouts,
    write_namespace,
)
from kvtier.service.layout_shape import LayoutShape
from kvtier.service.layout_store import LayoutStore
from kvtier.tiers.disk.directory import TierDirectory

log = logging.getLogger(__name__)


class LayoutRefused(ValueError):
    """A layout this daemon cannot serve (too small a block, too many layouts, no room)."""


class BlockStore:
    """The daemon's layouts by signature; each built at its first ``Open``."""

    def __init__(self, config: DaemonConfig, events: EventHub):
        self.config = config
        self.events = events
        self._lock = threading.Lock()
        self._layouts: dict[bytes, LayoutStore] = {}
        self._shapes: dict[bytes, LayoutShape] = {}
        self._resting: dict[bytes, RestingLayout] = {}
        # One daemon per data directory: a second one would hand out the same disk slots.
        self._dir = TierDirectory(str(config.disk_path)) if config.disk_bytes > 0 else None
        if self._dir is not None:
            try:
                self._migrate_single_layout(config.disk_path)
                for resting in resting_layouts(config.disk_path):
                    self._resting[resting.signature] = resting
            except BaseException:
                self._dir.release()
                raise

    def layouts(self) -> list[LayoutStore]:
        with self._lock:
            return list(self._layouts.values())

    def get(self, signature: bytes) -> LayoutStore | None:
        return self._layouts.get(signature)

    def shape(self, signature: bytes) -> LayoutShape:
        """What the layout is, as far as its ``Open`` calls (and its directory) said."""
        return self._shapes.get(signature) or LayoutShape()

    def resting(self) -> list[RestingLayout]:
        """Layouts whose blocks lay on disk at start, no session has opened since."""
        with self._lock:
            return list(self._resting.values())

    def open_layout(
        self, signature: bytes, block_bytes: int, block_tokens: int = 0, description: str = ""
    ) -> LayoutStore:
        """The layout's store, built at its first call; later calls must agree on its size.
        ``block_tokens`` and ``description`` (``layout_shape``) teach the store its shape."""
        with self._lock:
            store = self._layouts.get(signature)
            built = store is None
            resting = None
            if built:
                store = self._build(signature, block_bytes)
                resting = self._resting.pop(signature, None)
            elif block_bytes != store.block_bytes:
                raise LayoutRefused(
                    f"layout {signature.hex()} has {store.block_bytes} B blocks here, not "
                    f"{block_bytes} B; a layout signature must name one block size"
                )
            known = self._shapes.get(signature)
            if known is None and resting is not None:
                known = resting.shape  # its namespace.json, read at start
            elif known is None:
                fields = (
                    read_namespace(self._layout_dir(signature)) if store.disk is not None else {}
                )
                known = LayoutShape.from_saved(signature, fields)
            shape = known.learn(signature, block_tokens, description)
            self._shapes[signature] = shape
            if built or shape != known:
                self._save_namespace(store, shape)
        return store

    def close(self) -> None:
        """Flushes and closes every layout's disk tier and arena."""
        with self._lock:
            stores, self._layouts = list(self._layouts.values()), {}
        for store in stores:
            store.close()
        if self._dir is not None:
            self._dir.release()

    # ---- internals ----

    def _build(self, signature: bytes, block_bytes: int) -> LayoutStore:
        """Creates a layout's arena and tiers; call with the lock held (or at start)."""
        config = self.config
        if block_bytes < MIN_BLOCK_BYTES:
            raise LayoutRefused(
                f"blocks of {block_bytes} B are below the {MIN_BLOCK_BYTES} B this daemon "
                "accepts (it bounds the number of slots per arena)"
            )
        if block_bytes > config.host_bytes:
            raise LayoutRefused(
                f"a block of {block_bytes} B does not fit the {config.host_bytes} B host tier; "
                "raise --host-bytes"
            )
        if len(self._layouts) >= config.max_layouts:
            raise LayoutRefused(
                f"this daemon already serves {len(self._layouts)} layouts (max_layouts); "
                "raise --max-layouts or run another daemon (--name)"
            )
        arena = Arena(
            f"{config.arena_name}-{signature.hex()[:12]}", config.host_bytes, config.arena_dir
        )
        disk_path = None
        if config.disk_bytes > 0:
            self._layout_dir(signature).mkdir(mode=0o700, parents=True, exist_ok=True)
            disk_path = self._layout_dir(signature) / DISK_DIR
        try:
            store = LayoutStore(
                signature,
                block_bytes,
                arena,
                disk_path,
                config.disk_bytes,
                self.events,
                disk_sync=config.disk_sync,
                flush_interval_s=config.flush_interval_s,
                remote=config.remote_config(),
                admission=config.admission,
                index=index_path(config.socket_path, signature),
                disk_read_delay_s=config.disk_read_delay_ms / 1000,
            )
        except BaseException:
            arena.close()
            raise
        self._layouts[signature] = store
        log.info(
            "layout %s: %d host slots of %d B in %s",
            signature.hex(),
            store.num_slots,
            block_bytes,
            arena.path,
        )
        return store

    def _layout_dir(self, signature: bytes) -> Path:
        return self.config.disk_path / signature.hex()

    def _migrate_single_layout(self, root: Path) -> None:
        """Moves a one-layout daemon's ``namespace.json`` and ``lmdb/`` into a layout dir."""
        namespace = root / NAMESPACE_FILE
        if not namespace.is_file():
            return
        try:
            signature = bytes.fromhex(read_namespace(root)["layout_signature"])
        except (ValueError, KeyError, TypeError) as exc:  # read_namespace logs the unreadable
            log.error("%s names no layout (%r); left as it is", namespace, exc)
            return
        target = root / signature.hex()
        target.mkdir(mode=0o700, exist_ok=True)
        if (root / DISK_DIR).is_dir():
            old = TierDirectory(str(root / DISK_DIR))  # never move a directory in use
            try:
                os.replace(root / DISK_DIR, target / DISK_DIR)
            finally:
                old.release()
        os.replace(namespace, target / NAMESPACE_FILE)
        log.info("moved the disk tier of layout %s into %s", signature.hex(), target)

    def _save_namespace(self, store: LayoutStore, shape: LayoutShape) -> None:
        if store.disk is None:
            return
        try:
            write_namespace(
                self._layout_dir(store.signature), store.signature, store.block_bytes, shape
            )
        except OSError as exc:  # the shape is for statistics: no reason to refuse a session
            log.error("layout %s: namespace.json not written: %s", store.hex, exc)
