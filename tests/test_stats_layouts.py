"""``kvtier stats`` per layout: how many blocks each tier holds of each layout, the layout
described (tokens per block, layers, KV heads, head size, dtype), and a layout whose blocks lie
on disk though no engine has opened it since the daemon restarted (the engines' block size
changed, say) counted and described too, in the table, its JSON and ``/metrics``."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import torch
from prometheus_client.parser import text_string_to_metric_families

from kvtier.connector.client.daemon_client import DaemonClient
from kvtier.proto import contract
from kvtier.service.layout_dirs import NAMESPACE_FILE
from kvtier.service.layout_shape import LayoutShape
from kvtier.service.stats.cli import RESTING_NOTE
from kvtier.tiers.layout import KVLayout

from daemonutil import (
    START_TIMEOUT_S,
    Daemon,
    block_hash,
    in_process_daemon,
    store,
    wait_until,
)

# Two layouts of one model shape but for the block size (16 tokens, then 64 after an engine
# upgrade), each 8 KiB a block, as the tests' daemon expects.
OLD = KVLayout(num_layers=4, num_kv_heads=2, head_size=16, block_size=16, dtype=torch.float16)
NEW = KVLayout(num_layers=4, num_kv_heads=2, head_size=4, block_size=64, dtype=torch.float16)
OLD_BLOCKS, NEW_BLOCKS = 40, 24


def engine(daemon: Daemon, layout: KVLayout, described: bool = True) -> DaemonClient:
    """A client of ``layout`` as an engine opens it: with its description, or by signature and
    block size alone (a client of before)."""
    client = DaemonClient(
        layout.signature,
        layout.block_bytes,
        block_tokens=layout.block_size if described else 0,
        layout_description=layout.describe() if described else "",
        target=daemon.target,
    )
    assert client.wait_connected(START_TIMEOUT_S), daemon.log.read_text()
    return client


def blocks_of(daemon: Daemon, layout: KVLayout):
    """The daemon's ``LayoutBlocks`` of ``layout``, or None where it shows none."""
    found = {b.layout: b for b in daemon.stats().layout_blocks}
    return found.get(layout.signature.hex())


def fill(daemon: Daemon, layout: KVLayout, count: int) -> None:
    """Stores ``count`` blocks of ``layout`` and waits until the disk tier holds them all."""
    with engine(daemon, layout) as client:
        hashes = [block_hash(layout.signature.hex(), i) for i in range(count)]
        for start in range(0, count, 8):  # within a session's share of the host slots
            assert store(client, hashes[start : start + 8]) == hashes[start : start + 8]
    wait_until(
        lambda: blocks_of(daemon, layout).disk_blocks == count,
        f"{count} blocks of {layout.block_size}-token layout on disk",
    )


def stats_command(daemon: Daemon, *flags: str) -> str:
    """What ``kvtier stats`` prints for the daemon."""
    command = [sys.executable, "-m", "kvtier.service.cli", "stats", "--target", daemon.target]
    done = subprocess.run(
        [*command, *flags], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def table_row(table: str, layout: KVLayout) -> list[str]:
    """The cells of the per-layout table's row of ``layout`` (the note split into words)."""
    rows = [line.split() for line in table.splitlines() if line.startswith(layout_id(layout))]
    assert len(rows) == 1, table
    return rows[0]


def layout_id(layout: KVLayout) -> str:
    return layout.signature.hex()[:12]


def shape_cells(layout: KVLayout) -> list[str]:
    return [layout_id(layout), str(layout.block_size), "4", "2", str(layout.head_size), "float16"]


def metric(daemon: Daemon, name: str) -> dict[tuple, float]:
    """The samples of ``/metrics`` family ``name``: labels (sorted) -> value."""
    url = f"http://127.0.0.1:{daemon.stats_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return {
        tuple(sorted(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        if family.name == name
        for sample in family.samples
    }


def test_a_restart_shows_the_old_layouts_blocks_on_disk_beside_the_new_layouts():
    daemon = Daemon()
    try:
        daemon.start()
        fill(daemon, OLD, OLD_BLOCKS)
        assert daemon.stop() == 0, daemon.log.read_text()

        daemon.start()  # the engines come back with 64-token blocks: only NEW is opened
        old = blocks_of(daemon, OLD)
        assert old is not None, daemon.stats()
        assert (old.open, old.block_tokens, old.disk_blocks) == (False, 16, OLD_BLOCKS)
        fill(daemon, NEW, NEW_BLOCKS)

        table = stats_command(daemon)
        old_row, new_row = table_row(table, OLD), table_row(table, NEW)
        assert old_row[:8] == [*shape_cells(OLD), "-", f"{OLD_BLOCKS}"], table
        assert " ".join(old_row[8:]) == RESTING_NOTE, table
        assert new_row == [*shape_cells(NEW), f"{NEW_BLOCKS}", f"{NEW_BLOCKS}"], table

        as_json = json.loads(stats_command(daemon, "--json"))
        by_layout = {b["layout"]: b for b in as_json["layout_blocks"]}
        old, new = by_layout[OLD.signature.hex()], by_layout[NEW.signature.hex()]
        # uint64 fields are strings in protobuf's JSON
        assert (old["open"], old["block_tokens"], old["disk_blocks"]) == (False, 16, "40")
        assert (old["num_layers"], old["num_kv_heads"], old["head_size"]) == (4, 2, 16)
        assert (old["dtype"], old["description"], old["host_blocks"]) == (
            "float16",
            OLD.describe(),
            "0",
        )
        assert (new["open"], new["block_tokens"], new["disk_blocks"]) == (True, 64, "24")
        assert new["host_blocks"] == "24"

        disk = {
            dict(labels)["block_tokens"]: value
            for labels, value in metric(daemon, "kvtier_layout_blocks").items()
            if dict(labels)["tier"] == "disk"
        }
        assert disk == {"16": OLD_BLOCKS, "64": NEW_BLOCKS}
        info = {
            dict(labels)["layout"]: dict(labels) for labels in metric(daemon, "kvtier_layout_info")
        }
        assert info[OLD.signature.hex()] == {
            "layout": OLD.signature.hex(),
            "block_tokens": "16",
            "layers": "4",
            "kv_heads": "2",
            "head_size": "16",
            "dtype": "float16",
            "open": "false",
        }

        # An engine of the old block size opens it again, by signature alone: the shape its
        # directory kept still describes it, and its tier now counts its blocks as they change.
        with engine(daemon, OLD, described=False):
            old = blocks_of(daemon, OLD)
            assert (old.open, old.block_tokens, old.num_layers) == (True, 16, 4)
            assert old.disk_blocks == OLD_BLOCKS
    finally:
        daemon.cleanup()


def test_a_directory_without_a_description_after_a_crash_shows_its_signature_and_blocks():
    daemon = Daemon()
    try:
        daemon.start()
        fill(daemon, OLD, OLD_BLOCKS)
        daemon.kill()  # no clean close: the count at start walks the index first
        namespace = daemon.root / "data" / OLD.signature.hex() / NAMESPACE_FILE
        fields = json.loads(namespace.read_text())
        assert fields["layout_description"] == OLD.describe()
        # what a daemon from before layouts were described wrote
        namespace.write_text(
            json.dumps({k: fields[k] for k in ("layout_signature", "block_bytes")})
        )

        daemon.start()
        old = blocks_of(daemon, OLD)
        assert old is not None, daemon.stats()
        assert (old.open, old.disk_blocks, old.block_bytes) == (False, OLD_BLOCKS, 8192)
        assert (old.block_tokens, old.num_layers, old.dtype, old.description) == (0, 0, "", "")
        row = table_row(stats_command(daemon), OLD)
        assert row[:8] == [layout_id(OLD), "?", "?", "?", "?", "?", "-", f"{OLD_BLOCKS}"]
    finally:
        daemon.cleanup()


def test_a_description_that_is_not_the_signatures_is_not_believed():
    with in_process_daemon(host_bytes=16 * 8192) as daemon:
        daemon.open(
            "liar",
            OLD.signature,
            OLD.block_bytes,
            16,
            contract.PROTOCOL_VERSION,
            layout_description=NEW.describe(),
        )
        (shown,) = daemon.stats()["layout_blocks"]
        assert (shown["block_tokens"], shown["num_layers"], shown["description"]) == (16, 0, "")
        # a later session's true description is believed
        daemon.open(
            "engine",
            OLD.signature,
            OLD.block_bytes,
            16,
            contract.PROTOCOL_VERSION,
            layout_description=OLD.describe(),
        )
        (shown,) = daemon.stats()["layout_blocks"]
        assert (shown["num_layers"], shown["head_size"], shown["dtype"]) == (4, 16, "float16")
        assert shown["disk"] == "off" and shown["open"]


def test_the_shape_is_read_from_the_description():
    shape = LayoutShape.described(NEW.signature, NEW.describe())
    assert shape == LayoutShape(64, 4, 2, 4, "float16", NEW.describe())
    assert LayoutShape.described(NEW.signature, OLD.describe()) is None
    assert LayoutShape.from_saved(NEW.signature, shape.saved()) == shape
    assert LayoutShape.from_saved(NEW.signature, {"block_tokens": 64}) == LayoutShape(64)
    assert LayoutShape.from_saved(NEW.signature, {}) == LayoutShape()
    assert LayoutShape().learn(NEW.signature, 64, "") == LayoutShape(64)
    assert LayoutShape(16).learn(NEW.signature, 64, "") == LayoutShape(16)
