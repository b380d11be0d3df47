from __future__ import annotations

import json

from kvtier.service.cli import main

KEYS = {
    "blocks",
    "block_bytes",
    "raw_set_gbps",
    "raw_get_gbps",
    "remote_put_gbps",
    "remote_get_gbps",
    "lookup_ms",
    "remote_put_ratio",
    "remote_get_ratio",
}


def test_bench_remote_json_has_exactly_its_keys(capsys):
    assert main(["bench", "remote", "--blocks", "4", "--rounds", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) == KEYS
    assert result["blocks"] == 4 and all(value > 0 for value in result.values())
