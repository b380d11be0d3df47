"""A real daemon honours ``--admission``: what enters its host tier and what reaches its disk,
counted in its statistics; and the setting is checked like every other."""

from __future__ import annotations

import pytest

from kvtier.service import config
from kvtier.service.config import ConfigError, DaemonConfig
from kvtier.tiers.host.admission import DEFAULT_POLICY

from daemonutil import Daemon, block_hash, load, store, wait_until


def tier_stats(daemon: Daemon, tier: str):
    [stats] = [t for t in daemon.stats().tiers if t.tier == tier]
    return stats


@pytest.fixture
def daemons():
    made: list[Daemon] = []

    def start(policy: str) -> Daemon:
        d = Daemon(extra=["--admission", policy])
        made.append(d)
        return d.start()

    yield start
    for d in made:
        d.stop()  # a daemon that stops unlinks its arenas; a killed one would leave them
        d.cleanup()


def test_second_hit_stores_a_block_on_its_second_offer_only(daemons):
    daemon = daemons("second-hit")
    client = daemon.client()
    hashes = [block_hash("second-hit", i) for i in range(4)]
    assert store(client, hashes) == []  # first offer: recorded, not stored
    assert client.lookup(hashes[:2]).total == 0  # a miss, and the offer after it: one sighting
    assert load(client, hashes) == []
    assert store(client, hashes) == hashes  # the second offer
    assert client.lookup(hashes).host == len(hashes)
    assert tier_stats(daemon, "host").other["blocks_not_admitted"] == len(hashes)
    assert load(client, hashes) == hashes
    client.close()


def test_hit_to_disk_writes_a_block_down_once_it_is_hit(daemons):
    daemon = daemons("hit-to-disk")
    client = daemon.client()
    hashes = [block_hash("hit-to-disk", i) for i in range(4)]
    assert store(client, hashes) == hashes
    assert client.lookup(hashes).host == len(hashes)
    assert tier_stats(daemon, "host").blocks_stored == len(hashes)
    assert daemon.stats().layouts[0].writing_behind == 0  # nothing written behind to disk
    assert tier_stats(daemon, "disk").blocks_stored == 0
    assert load(client, hashes[:1]) == hashes[:1]
    wait_until(lambda: tier_stats(daemon, "disk").blocks_stored == 1, "the hit block on disk")
    assert load(client, hashes[:1]) == hashes[:1]  # hit again: no second write
    wait_until(lambda: daemon.stats().layouts[0].writing_behind == 0, "writes behind")
    assert tier_stats(daemon, "disk").blocks_stored == 1
    client.close()


def test_all_is_the_default_unless_told_and_a_bad_name_is_refused(tmp_path):
    assert DaemonConfig().admission == DEFAULT_POLICY
    toml = tmp_path / "kvtier.toml"
    toml.write_text('admission = "hit-to-disk"\n')
    assert config.load(toml).admission == "hit-to-disk"
    assert config.load(toml, admission="second-hit").admission == "second-hit"
    toml.write_text('admission = "lru"\n')
    with pytest.raises(ConfigError, match=r"config file .*admission 'lru': use one of all, "):
        config.load(toml)
