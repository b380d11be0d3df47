"""The lookup index's reader in a client: loading its compiled probe, and how it tells that the
index's writer (the daemon) still lives."""

from __future__ import annotations

import fcntl
import os
import struct
import subprocess
import sys

import pytest
import xxhash

from kvtier.connector.client import index_reader
from kvtier.connector.client.index_reader import LookupIndexReader
from kvtier.proto.lookup_index import DISK, HOST, LookupIndexWriter, index_path, is_kept

from daemonutil import BLOCK_BYTES, SIGNATURE, Daemon, block_hash, store, wait_until


def h(i: int) -> bytes:
    return xxhash.xxh3_128_digest(i.to_bytes(8, "little"))


def test_importing_the_client_loads_no_numba():
    """vLLM's CPU build scans every loaded module when its worker starts and fails on one of
    llvmlite's: the client may load numba only once it runs (on its own thread), never when
    an engine imports the connector."""
    code = """
import sys
import kvtier.connector.client.daemon_client
import kvtier.connector.client.index_reader
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("numba", "llvmlite"))
assert not loaded, loaded
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_a_client_loads_the_probe_on_one_thread_per_process():
    """In a fresh process, the first client with the index on starts the thread that loads
    the probe, later clients start none; once it has run, probes are answered."""
    code = """
from kvtier.connector.client import index_reader
index_reader.start_loading_probe()
loader = index_reader._loader
assert loader is not None and loader.name == "kvtier-probe-load"
index_reader.start_loading_probe()
assert index_reader._loader is loader
loader.join(300)
assert index_reader._walk_table is not None
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_without_numba_the_probe_says_so_and_lookups_stay_calls(tmp_path):
    """Where numba is missing, loading the probe fails with a warning, not an error, and the
    reader answers no probe (the client then calls, as the next test shows)."""
    code = f"""
import sys
sys.modules["numba"] = None  # as where numba is not installed
from kvtier.connector.client.index_reader import LookupIndexReader, load_probe
from kvtier.proto.lookup_index import HOST, LookupIndexWriter
writer = LookupIndexWriter({str(tmp_path / "idx")!r}, blocks=8)
writer.set(bytes(range(16)), HOST)
assert load_probe() is False
assert LookupIndexReader({str(tmp_path / "idx")!r}).probe([bytes(range(16))]) is None
writer.close()
"""
    done = subprocess.run(
        [sys.executable, "-c", code], check=True, timeout=300, capture_output=True, text=True
    )
    assert "no compiled probe" in done.stderr


def test_lookups_are_calls_until_the_compiled_probe_is_loaded(monkeypatch):
    """Until its thread has loaded the compiled probe, a client answers lookups by call, with
    the same hits; once loaded, from the index."""
    daemon = Daemon(host_bytes=64 * BLOCK_BYTES).start()
    try:
        client = daemon.client(lookup_index=True)
        held = [block_hash("unloaded", i) for i in range(4)]
        assert store(client, held) == held
        reader = LookupIndexReader(index_path(daemon.socket, SIGNATURE))
        wait_until(lambda: reader.probe(held).all(), "the commit to be published")
        with monkeypatch.context() as patch:
            patch.setattr(index_reader, "_walk_table", None)
            assert reader.probe(held) is None
            assert client.lookup([*held, block_hash("never", 0)]).host == len(held)
            assert client._lookups.probed == 0
        assert client.lookup(held).host == len(held)
        assert client._lookups.probed == 1
        client.close()
    finally:
        daemon.stop()
        daemon.cleanup()


def test_a_killed_daemons_index_answers_no_probe(monkeypatch):
    """SIGKILL leaves the file unretired; the writer's lock went with the process, so a probe
    answers None (ask the daemon) instead of the hits a dead daemon can no longer hand out,
    once the reader asks after its writer again (at once here)."""
    monkeypatch.setattr(index_reader, "WRITER_RECHECK_S", 0.0)
    daemon = Daemon(host_bytes=64 * BLOCK_BYTES).start()
    try:
        client = daemon.client()
        held = [block_hash("killed", i) for i in range(4)]
        assert store(client, held) == held
        reader = LookupIndexReader(index_path(daemon.socket, SIGNATURE))
        wait_until(lambda: reader.probe(held).tolist() == [HOST | DISK] * 4, "written down")
        daemon.kill()
        assert index_path(daemon.socket, SIGNATURE).exists()
        assert reader.probe(held) is None
        assert LookupIndexReader(index_path(daemon.socket, SIGNATURE)).probe(held) is None
        client.close()
    finally:
        daemon.cleanup()


def test_a_live_writer_holds_the_lock_each_readers_generation_looks_for(tmp_path):
    """A reader queries the writer's record lock (no exception, no lock taken); a client from
    before it tries to take a shared ``flock``: both see a live writer, and neither once it
    has gone."""
    writer = LookupIndexWriter(tmp_path / "idx", blocks=8)
    fd = os.open(tmp_path / "idx", os.O_RDONLY)
    try:
        assert is_kept(fd)
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        writer.close()
        assert not is_kept(fd)
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    finally:
        os.close(fd)


def test_a_daemon_from_before_the_record_lock_is_probed_by_its_flock(tmp_path, monkeypatch):
    """A daemon from before the record lock holds only its ``flock``: a new client still
    probes its index while it lives, and stops once it has gone."""
    monkeypatch.setattr(index_reader, "WRITER_RECHECK_S", 0.0)
    writer = LookupIndexWriter(tmp_path / "idx", blocks=8)
    held = [h(i) for i in range(3)]
    writer.set_all(held, HOST)
    unlock = struct.pack("hhqqi4x", fcntl.F_UNLCK, os.SEEK_SET, 0, 0, 0)
    fcntl.fcntl(writer._fd, fcntl.F_OFD_SETLK, unlock)  # as the old daemon never took it
    reader = LookupIndexReader(tmp_path / "idx")
    try:
        assert reader.probe(held).tolist() == [HOST] * 3
        mapped = reader._map
        assert reader.probe(held).tolist() == [HOST] * 3
        assert reader._map is mapped  # kept mapped, not mapped again for each probe
        writer.close()
        assert reader.probe(held) is None
    finally:
        reader.close()


def test_a_reader_asks_after_its_writer_at_most_once_per_recheck_interval(tmp_path, monkeypatch):
    """The liveness check is a system call, 26 to 29 µs of a paced 240 µs lookup on the VM:
    a reader trusts a live writer for ``WRITER_RECHECK_S``, then asks again, and a writer
    gone by then ends the probes."""
    now = [100.0]
    monkeypatch.setattr(index_reader, "_clock", lambda: now[0])
    writer = LookupIndexWriter(tmp_path / "idx", blocks=8)
    held = [h(i) for i in range(3)]
    writer.set_all(held, HOST)
    reader = LookupIndexReader(tmp_path / "idx")
    asked = []
    try:
        assert reader.probe(held).tolist() == [HOST] * 3  # mapping it asks once
        real = reader._kept
        reader._kept = lambda fd: asked.append(fd) or real(fd)
        for _ in range(5):
            assert reader.probe(held).tolist() == [HOST] * 3
        assert asked == []
        now[0] += 2 * index_reader.WRITER_RECHECK_S
        assert reader.probe(held).tolist() == [HOST] * 3
        assert reader.probe(held).tolist() == [HOST] * 3
        assert len(asked) == 1
        writer.close()
        now[0] += 2 * index_reader.WRITER_RECHECK_S
        assert reader.probe(held) is None
    finally:
        reader.close()
