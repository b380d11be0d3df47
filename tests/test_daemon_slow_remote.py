"""A remote store that answers slowly holds up only the calls that wait for it.

A real daemon over a real redis-server reached through ``SlowProxy``, which holds the store's
lookups (``EXISTS``) until the test lets them go. While one client's lookup waits there, the
daemon's event loop must go on serving everyone else: another client's host-hit lookup, its
stores and its keep-alive.
"""

from __future__ import annotations

import threading

from kvtier.bench.daemon.proxy import SlowProxy
from kvtier.bench.redis_server import RedisProcess

from daemonutil import Daemon, block_hash, load, store, wait_until

WAIT_S = 120.0


def remote_stored(daemon: Daemon) -> int:
    return next(t for t in daemon.stats().tiers if t.tier == "remote").blocks_stored


def test_a_lookup_waiting_on_the_remote_store_holds_up_no_other_client():
    with RedisProcess() as server, SlowProxy(server.port) as proxy:
        # The store's lookups may take as long as the test holds them.
        extra = ["--remote", proxy.url, "--remote-lookup-timeout-s", str(WAIT_S)]
        daemon = Daemon(extra=extra).start()
        try:
            near = daemon.client(client_name="host-hits")
            far = daemon.client(client_name="remote-miss", timeout_s=WAIT_S)
            held = [block_hash("held", i) for i in range(8)]
            assert store(near, held) == held
            wait_until(lambda: remote_stored(daemon) == len(held), "the remote writes")

            proxy.shut(b"EXISTS")
            answered = threading.Event()
            answers = []

            def ask_the_store() -> None:
                answers.append(far.lookup([block_hash("nowhere", i) for i in range(4)]))
                answered.set()

            asking = threading.Thread(target=ask_the_store)
            asking.start()
            try:
                assert proxy.held.wait(WAIT_S), "the lookup never reached the store"
                hits = near.lookup(held)
                assert (hits.host, near.failures) == (len(held), 0), hits
                more = [block_hash("more", i) for i in range(4)]
                assert store(near, more) == more
                assert load(near, held) == held
                assert not answered.is_set(), "the store's lookup was not held after all"
            finally:
                proxy.open()
                asking.join(WAIT_S)
            assert answers and answers[0].total == 0 and far.failures == 0
            near.close()
            far.close()
        finally:
            daemon.cleanup()
