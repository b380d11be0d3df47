"""Daemon start-up: a second daemon with default flags, failed starts that clean up after
themselves, the socket's directory and path, settings of the wrong type, and what a daemon
loads."""

from __future__ import annotations

import json
import logging
import os
import socket
import stat
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from kvtier.connector.client.daemon_client import DaemonClient
from kvtier.proto import contract
from kvtier.service import config
from kvtier.service.cli import build_parser
from kvtier.service.config import ConfigError, DaemonConfig

from daemonutil import (
    BLOCK_BYTES,
    SIGNATURE,
    Daemon,
    arenas_of,
    block_hash,
    load,
    store,
    wait_until,
)

ROOT = os.getuid() == 0
OTHER_UID = 65534  # nobody


@pytest.fixture
def daemons():
    made: list[Daemon] = []

    def make(**kwargs) -> Daemon:
        made.append(Daemon(**kwargs))
        return made[-1]

    yield make
    for d in made:
        d.cleanup()


def assert_failed_cleanly(d: Daemon, code: int, *words: str) -> str:
    """Exit 1, one ERROR line that says why, no traceback, nothing of the start left behind."""
    log = d.log.read_text()
    assert code == 1, log
    errors = [line for line in log.splitlines() if " ERROR " in line]
    assert len(errors) == 1, log
    assert "Traceback" not in log, log
    for word in words:
        assert word in errors[0], errors[0]
    assert not arenas_of(d.name)
    assert not d.socket.is_socket()
    return errors[0]


def test_two_daemons_with_default_stats_ports_both_serve(daemons):
    """every daemon took 9477; the second failed with a traceback."""
    first = daemons(stats_port=None).start()
    second = daemons(stats_port=None).start()
    urls = {first.stats_url, second.stats_url}
    assert len(urls) == 2
    for url in urls:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as reply:
            assert reply.status == 200 and b"kvtier" in reply.read()
    # They cannot both have the default port: at least one said which one it took instead.
    logs = first.log.read_text() + second.log.read_text()
    assert f"stats port {config.DEFAULT_STATS_PORT} is taken" in logs
    client = second.client()
    try:
        hashes = [block_hash("second", i) for i in range(4)]
        assert store(client, hashes) == hashes and load(client, hashes) == hashes
    finally:
        client.close()


def test_taken_stats_port_asked_for_is_a_clean_start_error(daemons):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        d = daemons(stats_port=port)
        save_namespace(d)  # so that the start opens the disk tier too
        code = d.run_to_exit()
        assert_failed_cleanly(d, code, f"127.0.0.1:{port}", "--stats-port")
    d.proc = None
    d.stats_port = 0
    d.start()  # nothing of the failed start is in the way: arena, socket, disk tier lock
    client = d.client()
    client.close()


def test_a_second_daemon_on_the_same_data_directory_refuses_to_start(daemons):
    """two names, one --data-dir: both handed out the same disk slots."""
    first = daemons().start()
    second = daemons(extra=["--data-dir", str(first.root / "data")])
    code = second.run_to_exit()
    assert_failed_cleanly(second, code, "in use by process", str(first.proc.pid))
    client = first.client()  # the first one is untouched
    assert store(client, [block_hash("still", 0)]) == [block_hash("still", 0)]
    client.close()


def save_namespace(d: Daemon) -> None:
    data = d.root / "data"
    data.mkdir(parents=True, exist_ok=True)
    namespace = {"layout_signature": SIGNATURE.hex(), "block_bytes": BLOCK_BYTES}
    (data / "namespace.json").write_text(json.dumps(namespace))


_HOLD = """
import sys
from kvtier.tiers.disk.tier import DiskTier
t = DiskTier(sys.argv[1], bytes.fromhex(sys.argv[2]), int(sys.argv[3]), 64 * int(sys.argv[3]))
print("open", flush=True)
sys.stdin.read()
"""


def test_disk_tier_in_use_is_a_clean_start_error(daemons):
    """From the daemon's side: a second daemon on one data directory."""
    d = daemons()
    save_namespace(d)
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(d.root / "data" / "lmdb"), SIGNATURE.hex(), "8192"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert holder.stdout.readline() == b"open\n"
        code = d.run_to_exit()
    finally:
        holder.kill()
        holder.wait(30)
    assert_failed_cleanly(d, code, "in use by process", str(holder.pid))


@pytest.mark.parametrize("kind", ["file", "directory", "symlink"])
def test_only_a_socket_is_ever_removed_at_the_socket_path(daemons, kind):
    """a regular file at --socket was deleted."""
    d = daemons()
    d.root.mkdir(exist_ok=True)
    if kind == "file":
        d.socket.write_text("precious")
    elif kind == "directory":
        d.socket.mkdir()
    else:
        (d.root / "target").write_text("precious")
        d.socket.symlink_to(d.root / "target")
    code = d.run_to_exit()
    assert_failed_cleanly(d, code, str(d.socket), "not a socket")
    if kind == "file":
        assert d.socket.read_text() == "precious"
    elif kind == "directory":
        assert d.socket.is_dir()
    else:
        assert d.socket.is_symlink() and (d.root / "target").read_text() == "precious"


def test_a_dead_daemons_socket_is_replaced(daemons):
    d = daemons()
    d.root.mkdir(exist_ok=True)
    with socket.socket(socket.AF_UNIX) as dead:
        dead.bind(str(d.socket))  # bound, never listening: what a killed daemon leaves
    assert d.socket.is_socket()
    d.start()
    d.stop()
    assert not d.socket.exists()  # its own socket goes at a clean stop


def test_unsafe_socket_directory_is_refused_at_start(daemons):
    d = daemons()
    d.root.mkdir(exist_ok=True)
    os.chmod(d.root, 0o777)
    code = d.run_to_exit()
    assert_failed_cleanly(d, code, str(d.root), "writable by group or others", "0777")


def test_socket_directory_is_made_private(tmp_path):
    old = os.umask(0)
    try:
        made = contract.ensure_socket_dir(tmp_path / "a" / "kvtier")
    finally:
        os.umask(old)
    assert made == tmp_path / "a" / "kvtier"
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    # the directory it made above it too: had others been able to write to it, they could
    # rename "kvtier" away and put a directory of theirs in its place
    assert stat.S_IMODE(made.parent.stat().st_mode) == 0o700
    assert contract.ensure_socket_dir(made) == made  # ours, private: used as found


def test_socket_directory_writable_by_others_is_refused(tmp_path):
    for mode in (0o777, 0o770, 0o722):
        os.chmod(tmp_path, mode)
        with pytest.raises(contract.UnsafeSocketDirectory, match=f"{tmp_path}.*mode {mode:04o}"):
            contract.ensure_socket_dir(tmp_path)
    os.chmod(tmp_path, 0o755)  # readable by others is fine: connecting needs the socket's mode
    contract.ensure_socket_dir(tmp_path)


def test_a_client_does_not_connect_through_a_directory_others_can_write(caplog):
    """The client checks too: a daemon's socket in a directory someone else could have put
    their own socket into is not used until the directory is private again."""
    daemon = Daemon().start()
    client = None
    try:
        os.chmod(daemon.root, 0o777)
        client = DaemonClient(SIGNATURE, BLOCK_BYTES, block_tokens=16, target=daemon.target)
        with caplog.at_level(logging.ERROR, logger="kvtier.connector.client.session"):
            assert not client.wait_connected(1.0)
        assert "mode 0777" in caplog.text
        os.chmod(daemon.root, 0o700)
        assert client.wait_connected(30)
    finally:
        if client is not None:
            client.close()
        daemon.cleanup()


def test_a_client_waiting_for_its_daemon_makes_no_directory(tmp_path, caplog):
    """An engine started before its daemon (or pointed at one that never comes) tries and
    retries to connect; it leaves the socket's directory for the daemon to make."""
    socket_dir = tmp_path / "kvtier"
    client = None
    try:
        with caplog.at_level(logging.DEBUG, logger="kvtier.connector.client.session"):
            client = DaemonClient(
                SIGNATURE, BLOCK_BYTES, block_tokens=16, target=f"unix:{socket_dir}/d.sock"
            )
            wait_until(lambda: "Open failed" in caplog.text, "the client to try to connect")
        assert not socket_dir.exists()
    finally:
        if client is not None:
            client.close()


def test_socket_directory_of_another_user_is_refused(tmp_path):
    """another user creates the predictable directory first."""
    if ROOT:
        squatted = tmp_path / "kvtier-squat"
        squatted.mkdir(mode=0o700)
        os.chown(squatted, OTHER_UID, OTHER_UID)
    else:
        squatted = Path("/usr")  # root's, and we are not root
    owner = "uid 65534" if ROOT else "uid 0"
    with pytest.raises(contract.UnsafeSocketDirectory, match=f"{squatted}.*another user.*{owner}"):
        contract.ensure_socket_dir(squatted)


@pytest.mark.skipif(not ROOT, reason="making another user's symlink needs root")
def test_symlink_of_another_user_in_the_path_is_refused(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "kvtier-link"
    link.symlink_to(real)
    assert contract.ensure_socket_dir(link / "sub")  # our own symlink is fine
    os.lchown(link, OTHER_UID, OTHER_UID)
    with pytest.raises(contract.UnsafeSocketDirectory, match=f"{link} is a symlink owned by"):
        contract.ensure_socket_dir(link / "sub")


def test_config_of_the_wrong_type_names_the_key_and_file(tmp_path):
    """wrong types gave tracebacks; errors about a file name it."""
    toml = tmp_path / "kvtier.toml"
    cases = {
        'stats_port = "9000"': "stats_port must be an integer",
        "lease_s = true": "lease_s must be a number",
        "disk_sync = 1": "disk_sync must be true or false",
        "data_dir = 5": "data_dir must be a path",
        'host_bytes = "lots"': "host_bytes: not a size",
        "host_bytes = 1.5": "host_bytes must be a size",
        "name = 7": "name must be a string",
        "max_hashes = 0": "max_hashes must be in",
        "oops = [": "not valid TOML",
    }
    for text, words in cases.items():
        toml.write_text(text + "\n")
        with pytest.raises(ConfigError) as info:
            config.load(toml)
        assert str(info.value).startswith(f"config file {toml}: ") and words in str(info.value)
    with pytest.raises(ConfigError, match=f"config file {tmp_path / 'none.toml'}: No such file"):
        config.load(tmp_path / "none.toml")
    with pytest.raises(ConfigError, match=r"^--stats-port: stats_port must be an integer"):
        config.load(None, stats_port="http")
    with pytest.raises(ConfigError, match="lease_s must be a number"):
        DaemonConfig(lease_s="30")  # a field's type is checked however it is built
    toml.write_text('host_bytes = "64MiB"\nlease_s = 5\nstats_port = 0\n')
    cfg = config.load(toml, lease_s="2.5", disk_bytes="1GiB")
    assert (cfg.host_bytes, cfg.lease_s, cfg.disk_bytes, cfg.stats_port) == (
        64 << 20,
        2.5,
        1 << 30,
        0,
    )


def test_token_file_errors_name_the_file_and_loose_modes_warn(tmp_path, caplog):
    token = tmp_path / "token"
    cfg = DaemonConfig(token_file=token)
    with pytest.raises(ConfigError, match=f"token file {token}: No such file"):
        cfg.read_token()
    token.write_text("s3cret\n")
    os.chmod(token, 0o600)
    with caplog.at_level(logging.WARNING):
        assert cfg.read_token() == "s3cret"
        assert "token file" not in caplog.text
        os.chmod(token, 0o644)
        assert cfg.read_token() == "s3cret"
    [warning] = [r for r in caplog.records if "token file" in r.getMessage()]
    assert str(token) in warning.getMessage() and "644" in warning.getMessage()


def test_bad_config_file_stops_the_daemon_with_one_line(daemons):
    d = daemons()
    d.root.mkdir(exist_ok=True)
    toml = d.root / "kvtier.toml"
    toml.write_text("grace_s = 'soon'\n")  # a key no flag of the test's overrides
    d.extra = ["--config", str(toml)]
    code = d.run_to_exit()
    assert_failed_cleanly(d, code, str(toml), "grace_s must be a number")


def test_a_daemon_serves_its_tiers_without_loading_torch(daemons):
    """The daemon imported torch for a tensor over its arena: 1.4 s of its 1.8 s start (every
    restart under live engines waited for it) and about 190 MB of its memory. Every path here
    (stores written behind to disk, a lookup from the index and one by call, loads promoted
    back from disk, the statistics) must run without it."""
    d = daemons(host_bytes=16 * BLOCK_BYTES, disk_bytes=64 * BLOCK_BYTES).start()
    hashes = [block_hash("torchless", i) for i in range(32)]
    with d.client(lookup_index=True) as client:
        for start in range(0, len(hashes), 4):
            assert store(client, hashes[start : start + 4]) == hashes[start : start + 4]
            wait_until(lambda: d.stats().layouts[0].writing_behind == 0, "the writes behind")
        assert client.lookup(hashes).total == len(hashes)
    with d.client() as client:
        assert client.lookup(hashes).total == len(hashes)
        assert load(client, hashes[:4]) == hashes[:4]  # evicted from the host tier since
    for page in ("metrics", "stats"):
        with urllib.request.urlopen(f"{d.stats_url}/{page}", timeout=10) as reply:
            assert reply.status == 200
    maps = Path(f"/proc/{d.proc.pid}/maps").read_text()
    assert "libtorch" not in maps


def test_the_kvtier_command_imports_only_the_subcommand_it_runs():
    """``kvtier serve`` built every subcommand's parser before it ran, the benchmarks' too, and
    they import torch: the daemon the README starts loaded it after all."""
    code = (
        "import contextlib, runpy, sys\n"
        "for argv in (['serve', '--help'], ['-v', 'serve', '--help'], ['stats', '--help']):\n"
        "    sys.argv = ['kvtier', *argv]\n"
        "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(None):\n"
        "        runpy.run_module('kvtier.service.cli', run_name='__main__')\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('kvtier.bench')))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert run.stdout.strip() == "[]", run.stdout
    argv = ["bench", "tiers", "--blocks", "8"]
    assert build_parser(argv).parse_args(argv).blocks == 8  # a benchmark gets its arguments


def test_a_benchmark_says_it_needs_torch_where_torch_is_not_installed():
    """torch is no longer a dependency (a node's daemon installs without it); a benchmark run
    there must say what to install, not end in an ImportError's traceback."""
    code = (
        "import runpy, sys\n"
        "sys.modules['torch'] = None  # as if not installed: importing it fails\n"
        "sys.argv = ['kvtier', 'bench', 'tiers', '--blocks', '8']\n"
        "runpy.run_module('kvtier.service.cli', run_name='__main__')\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert "kvtier bench tiers needs torch" in run.stderr
    assert "pip install 'kvtier[torch]'" in run.stderr
    assert "Traceback" not in run.stderr
