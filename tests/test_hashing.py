from __future__ import annotations

import subprocess
import sys

import pytest

from kvtier.tiers.hashing import (
    BlockHasher,
    ExtraKeys,
    MultiModalInput,
    Namespace,
    hash_prompt,
)

NS = Namespace("llama-3-8b", b"\x01" * 16)


def test_only_full_blocks_are_hashed():
    assert len(hash_prompt(NS, range(15), 4)) == 3
    assert len(hash_prompt(NS, range(16), 4)) == 4
    assert all(len(h) == 16 for h in hash_prompt(NS, range(16), 4))


def test_chain_shares_prefix_and_diverges_after():
    a = hash_prompt(NS, [*range(8), 1, 2, 3, 4], 4)
    b = hash_prompt(NS, [*range(8), 1, 2, 3, 5], 4)
    assert a[:2] == b[:2]
    assert a[2] != b[2]


def test_same_block_content_at_other_position_differs():
    a = hash_prompt(NS, [1, 2, 3, 4, 1, 2, 3, 4], 4)
    assert a[0] != a[1]


@pytest.mark.parametrize(
    "other",
    [
        Namespace("llama-3-70b", b"\x01" * 16),
        Namespace("llama-3-8b", b"\x02" * 16),
        Namespace("llama-3-8b", b"\x01" * 16, tp_rank=1, tp_world_size=2),
        Namespace("llama-3-8b", b"\x01" * 16, hash_version=2),
        Namespace("llama-3-8b", b"\x01" * 16, group=1),
        Namespace("llama-3-8b", b"\x01" * 16, layers=(0, 16)),
        Namespace("llama-3-8b", b"\x01" * 16, fingerprint=b"rope_theta 20000"),
    ],
)
def test_namespace_fields_change_every_hash(other):
    assert hash_prompt(NS, range(8), 4)[0] != hash_prompt(other, range(8), 4)[0]


def test_salt_enters_the_root_block_only():
    tokens = list(range(12))
    salted = hash_prompt(NS, tokens, 4, ExtraKeys(cache_salt="tenant-a"))
    plain = hash_prompt(NS, tokens, 4)
    # the chain carries the salt onward
    assert all(s != p for s, p in zip(salted, plain, strict=True))
    # the second block's own input is the plain one: same parent gives the same child
    from kvtier.tiers.hashing import hash_block_chain

    assert hash_block_chain(salted[0], tokens[4:], 4) == salted[1:]


def test_lora_and_multimodal_keys():
    tokens = list(range(12))
    lora = hash_prompt(NS, tokens, 4, ExtraKeys(lora="sql-adapter"))
    assert lora[0] != hash_prompt(NS, tokens, 4)[0]
    image_a = ExtraKeys(mm_inputs=(MultiModalInput(offset=5, length=2, content_hash="img-a"),))
    image_b = ExtraKeys(mm_inputs=(MultiModalInput(offset=5, length=2, content_hash="img-b"),))
    a, b = hash_prompt(NS, tokens, 4, image_a), hash_prompt(NS, tokens, 4, image_b)
    assert a[0] == b[0]  # block 0 does not overlap the image
    assert a[1] != b[1]


def test_incremental_equals_one_call():
    extra = ExtraKeys(cache_salt="s", mm_inputs=(MultiModalInput(9, 4, "img"),))
    hasher = BlockHasher(NS, 4, extra)
    got = []
    for chunk in ([1, 2, 3], [4, 5, 6, 7, 8, 9], [10], [11, 12, 13, 14, 15, 16, 17]):
        got.extend(hasher.extend(chunk))
    want = hash_prompt(NS, list(range(1, 18)), 4, extra)
    assert got == want
    assert hasher.hashes == want


def test_deterministic_across_processes():
    code = (
        "from kvtier.tiers.hashing import Namespace, ExtraKeys, hash_prompt;"
        "ns = Namespace('llama-3-8b', bytes([1]) * 16);"
        "print(','.join(h.hex() for h in hash_prompt(ns, range(40), 8, ExtraKeys('l', (), 's'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "12345", "PATH": ""},
    ).stdout.strip()
    here = hash_prompt(NS, range(40), 8, ExtraKeys("l", (), "s"))
    assert out.split(",") == [h.hex() for h in here]


def test_every_pipeline_stage_has_its_own_seed():
    """Two stages of an even split have one layout: their layer ranges tell them apart."""
    seeds = {Namespace("m", b"x" * 16, layers=(first, 8)).seed for first in (0, 8, 16, 24)}
    assert len(seeds) == 4
    assert Namespace("m", b"x" * 16, layers=(0, 8)).seed != Namespace("m", b"x" * 16).seed


def test_every_kv_cache_group_has_its_own_seed():
    seeds = {Namespace("m", b"x" * 16, group=g).seed for g in range(6)}
    assert len(seeds) == 6


def test_bad_input():
    with pytest.raises(ValueError):
        BlockHasher(NS, 0)
    with pytest.raises(ValueError):
        Namespace("m", b"x" * 16, tp_rank=2, tp_world_size=2)
    with pytest.raises(ValueError):
        Namespace("m", b"x" * 16, group=-1)
    with pytest.raises(ValueError):
        Namespace("m", b"x" * 16, layers=(4, 0))
