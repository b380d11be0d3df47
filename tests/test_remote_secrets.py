"""A remote store's password never reaches a log line, an error message or a repr: not when
it is put in the URL by mistake, not when the URL is wrong in another way, not when the
daemon runs with it (right or wrong) against a real password-protected redis-server."""

from __future__ import annotations

import pytest

from kvtier.bench.redis_server import RedisProcess
from kvtier.service.config import DaemonConfig
from kvtier.tiers.remote.config import RemoteConfig, parse_url, redact_url
from kvtier.tiers.remote.redis import RedisOptions

from daemonutil import Daemon, block_hash, store, wait_until

SECRET = "S3cret"
WRONG = "Wr0ngS3cret"

BAD_URLS = [
    f"redis+clustre://admin:{SECRET}@h1",  # an unknown scheme is found first
    f"redis://admin:{SECRET}@h1",
    f"admin:{SECRET}@h1:7000,h2:7001",
    f"redis://admin:{SECRET}@h1:0",
    f"redis://admin:{SECRET}@h1:x",
    f"redis+cluster://admin:{SECRET}@h1/2",
    f"redis://admin:{SECRET}@h1?db=2",
    f"mooncake://admin:{SECRET}@m1,m2",
    f"redis://admin:{SECRET}/x@h1",  # a password holding / ? @ is redacted whole
    f"redis://admin:{SECRET}?x@h1",
    f"redis://admin:{SECRET}@x@h1",
    f"mooncake://m1?metadata=http://admin:{SECRET}@meta:8080&nope=1",
]


@pytest.mark.parametrize("url", BAD_URLS)
def test_a_bad_url_is_refused_without_its_password(url):
    for build in (parse_url, RemoteConfig, lambda u: DaemonConfig(remote=u)):
        with pytest.raises(ValueError) as info:
            build(url)
        assert SECRET not in str(info.value), info.value
        assert "***@" in str(info.value), info.value  # it still says which URL


def test_redact_url_hides_only_the_user_info():
    assert redact_url(f"redis+clustre://admin:{SECRET}@h1") == "redis+clustre://***@h1"
    assert redact_url(f"admin:{SECRET}@h1:7000,h2:7001") == "***@h1:7000,h2:7001"
    assert redact_url("rediss://cache:7000/3") == "rediss://cache:7000/3"
    nested = f"mooncake://kv@m1?metadata=http://admin:{SECRET}@meta:8080/metadata"
    assert redact_url(nested) == "mooncake://***@m1?metadata=http://***@meta:8080/metadata"


def test_reprs_of_the_settings_hold_no_password():
    options = RedisOptions(username="admin", password=SECRET)
    assert SECRET not in repr(options)
    assert options.connection_kwargs()["password"] == SECRET


@pytest.mark.parametrize("url", BAD_URLS[:3])
def test_a_daemon_started_with_a_bad_url_logs_one_line_without_its_password(url):
    daemon = Daemon(extra=["--remote", url])
    try:
        assert daemon.run_to_exit() == 1
        log = daemon.log.read_text()
        assert SECRET not in log, log
        assert "Traceback" not in log and "***@" in log, log
    finally:
        daemon.cleanup()


def remote(daemon: Daemon):
    return next(t for t in daemon.stats().tiers if t.tier == "remote")


def test_a_daemon_using_a_password_protected_store_logs_no_password(tmp_path):
    hashes = [block_hash("secret", i) for i in range(4)]
    with RedisProcess(extra=("--requirepass", SECRET)) as server:
        url = f"redis://default@{server.address}"
        right, wrong = tmp_path / "right", tmp_path / "wrong"
        right.write_text(f"{SECRET}\n")
        wrong.write_text(f"{WRONG}\n")
        daemons = [
            Daemon(extra=["--remote", url, "--remote-password-file", str(path)])
            for path in (right, wrong)
        ]
        try:
            for daemon in daemons:
                daemon.start()
            client = daemons[0].client()
            try:
                assert store(client, hashes) == hashes
            finally:
                client.close()
            wait_until(lambda: remote(daemons[0]).blocks_stored == 4, "the remote writes")
            refused = daemons[1]
            client = refused.client()
            batches = iter(range(1, 1000))

            def refusals_logged() -> bool:
                """Stores another batch: the store's refusals open the breaker, whose log line
                names the last error."""
                store(client, [block_hash(f"secret-{next(batches)}", i) for i in range(4)])
                return "breaker open" in refused.log.read_text()

            try:
                wait_until(refusals_logged, "the wrong password's refusals logged")
            finally:
                client.close()
            for daemon in daemons:
                assert daemon.stop() == 0
                log = daemon.log.read_text()
                assert SECRET not in log and WRONG not in log, log
        finally:
            for daemon in daemons:
                daemon.cleanup()
