"""The test harness's own promises, where a flaw in them would show only as a rare flake."""

from __future__ import annotations

import socket
from pathlib import Path

from daemonutil import free_port


def test_a_free_port_is_below_the_ephemeral_ports_and_bindable_everywhere():
    # A port in the ephemeral range can be taken by a client's own connect to it (a
    # self-connect) before its server binds: vLLM's event publisher failed so in CI.
    first_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(50):
        port = free_port()
        assert 1024 <= port < first_ephemeral
        with socket.socket() as s:
            s.bind(("", port))
