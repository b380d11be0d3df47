"""Remote store configuration: URLs, where the password comes from, the daemon's settings, and
real password-protected and TLS redis-servers reached through them."""

from __future__ import annotations

import argparse
import subprocess

import pytest

from kvtier.bench.redis_server import RedisProcess, free_port
from kvtier.service import config as daemon_config
from kvtier.service import flags
from kvtier.tiers.remote.config import PASSWORD_ENV, RemoteConfig, parse_url

from redisutil import BLOCK_BYTES, FAST, SIGNATURE, assert_exact, block_hash, fetch, store


@pytest.mark.parametrize(
    ("url", "kind", "hosts", "tls", "db", "user"),
    [
        ("redis://cache", "redis", [("cache", 6379)], False, 0, None),
        ("rediss://kv@cache:7000/3", "redis", [("cache", 7000)], True, 3, "kv"),
        ("redis://a:7000,b:7001", "cluster", [("a", 7000), ("b", 7001)], False, 0, None),
        (
            "a:7000,b:7001,c:7002",
            "cluster",
            [("a", 7000), ("b", 7001), ("c", 7002)],
            False,
            0,
            None,
        ),
        ("rediss+cluster://seed", "cluster", [("seed", 6379)], True, 0, None),
        ("redis://[::1]:6380", "redis", [("::1", 6380)], False, 0, None),
        ("mooncake://master", "mooncake", [("master", 50051)], False, 0, None),
    ],
)
def test_urls_name_the_store(url, kind, hosts, tls, db, user):
    endpoint = parse_url(url)
    assert (endpoint.kind, list(endpoint.hosts), endpoint.tls, endpoint.db, endpoint.username) == (
        kind,
        hosts,
        tls,
        db,
        user,
    )


@pytest.mark.parametrize(
    "url",
    ["ftp://h", "redis://h:0", "redis://h:x", "redis+cluster://a/1", "redis://h?db=2", "m://"],
)
def test_bad_urls_are_refused(url):
    with pytest.raises(ValueError):
        parse_url(url)


def test_a_password_in_the_url_is_refused_without_being_echoed():
    with pytest.raises(ValueError, match="password") as info:
        parse_url("redis://kv:hunter2@cache:6379")
    assert "hunter2" not in str(info.value)


def test_the_password_comes_from_a_file_else_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    assert RemoteConfig("redis://h").password() is None
    monkeypatch.setenv(PASSWORD_ENV, "from-env")
    assert RemoteConfig("redis://h").password() == "from-env"
    secret = tmp_path / "password"
    secret.write_text("from-file\n")
    assert RemoteConfig("redis://h", password_file=secret).password() == "from-file"


def test_daemon_flags_and_toml_keys_build_the_remote_config(tmp_path):
    toml = tmp_path / "kvtier.toml"
    toml.write_text(
        'remote = "redis://a:7000,b:7001"\n'
        f'remote_password_file = "{tmp_path / "pw"}"\n'
        'remote_queue_bytes = "64MiB"\n'
        "remote_lookup_timeout_s = 0.2\n"
    )
    cfg = daemon_config.load(toml).remote_config()
    assert cfg.endpoint.kind == "cluster" and cfg.password_file == tmp_path / "pw"
    assert cfg.settings.queue_bytes == 64 << 20 and cfg.settings.lookup_timeout_s == 0.2
    parser = argparse.ArgumentParser()
    flags.add_arguments(parser)
    args = parser.parse_args(["--config", str(toml), "--remote", "rediss://cache"])
    cfg = flags.from_args(args).remote_config()
    assert cfg.endpoint.tls and cfg.settings.transfer_timeout_s == 5.0
    assert daemon_config.load().remote_config() is None
    with pytest.raises(ValueError):
        daemon_config.load(remote="redis://kv:pw@cache")
    with pytest.raises(ValueError):
        daemon_config.load(remote="redis://cache", remote_lookup_timeout_s=0)


def test_a_password_protected_store_is_used_with_its_password_only(tmp_path, monkeypatch):
    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    hashes = [block_hash("password", i) for i in range(4)]
    with RedisProcess(extra=("--requirepass", "s3cret")) as server:
        secret = tmp_path / "password"
        secret.write_text("s3cret\n")
        tier = RemoteConfig(server.url, password_file=secret, settings=FAST).open_tier(
            SIGNATURE, BLOCK_BYTES
        )
        try:
            assert store(tier, hashes) == [True] * 4
            metas, outs = fetch(tier, hashes)
            assert len(metas) == 4
            assert_exact(hashes, outs)
        finally:
            tier.close()
        anonymous = RemoteConfig(server.url, settings=FAST).open_tier(SIGNATURE, BLOCK_BYTES)
        try:
            assert anonymous.lookup_prefix(hashes) == 0
            assert anonymous.counters.fault_misses == 4
        finally:
            anonymous.close()


def _certificates(directory) -> dict[str, str]:
    """A CA and a server certificate for 127.0.0.1 signed by it (openssl)."""
    ca, ca_key = str(directory / "ca.pem"), str(directory / "ca.key")
    cert, key = str(directory / "server.pem"), str(directory / "server.key")
    csr, san = str(directory / "server.csr"), directory / "san.ext"
    san.write_text("subjectAltName=IP:127.0.0.1\n")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True)

    new_key = ("-newkey", "rsa:2048", "-nodes")
    openssl(
        "req", "-x509", *new_key, "-days", "2", "-subj", "/CN=ca", "-keyout", ca_key, "-out", ca
    )
    openssl("req", *new_key, "-subj", "/CN=127.0.0.1", "-keyout", key, "-out", csr)
    openssl(
        *("x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial"),
        *("-days", "2", "-extfile", str(san), "-out", cert),
    )
    return {"ca": ca, "cert": cert, "key": key}


def test_a_tls_store_is_reached_over_rediss(tmp_path):
    certs = _certificates(tmp_path)
    tls_port = free_port()
    tls = (
        *("--tls-port", str(tls_port), "--tls-cert-file", certs["cert"]),
        *("--tls-key-file", certs["key"], "--tls-ca-cert-file", certs["ca"]),
        *("--tls-auth-clients", "no"),
    )
    hashes = [block_hash("tls", i) for i in range(4)]
    with RedisProcess(extra=tls) as server:
        url = f"rediss://127.0.0.1:{tls_port}"
        tier = RemoteConfig(url, ca_file=certs["ca"], settings=FAST).open_tier(
            SIGNATURE, BLOCK_BYTES
        )
        try:
            assert store(tier, hashes) == [True] * 4
            metas, outs = fetch(tier, hashes)
            assert len(metas) == 4
            assert_exact(hashes, outs)
            assert server.client().dbsize() == 4
        finally:
            tier.close()
