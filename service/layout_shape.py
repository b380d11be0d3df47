"""What a layout is, in an operator's terms, as far as the daemon knows it.

A layout reaches the daemon as a 16-byte signature (a digest: it says nothing by itself), the
block's size in bytes and, from each ``Open``, the tokens per block and, where the client sends
it, the layout's canonical text (``KVLayout.describe()``: ``order=BLHNC;layers=32;heads=8;
tokens=16;k=128;v=128;dtype=bfloat16;page=…``). A text is believed only where it hashes to the
signature (the signature IS its digest), so no client can mislabel another's blocks. The shape
is kept beside the layout's disk tier (``layout_dirs``), so that blocks on disk are still
described after a restart, before (or without) any engine opening their layout again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import xxhash

log = logging.getLogger(__name__)

MAX_DESCRIPTION_CHARS = 1024
"""A longer ``layout_description`` is ignored (the canonical text is about 100 characters)."""
_INT_FIELDS = {"tokens": "block_tokens", "layers": "num_layers", "heads": "num_kv_heads"}


@dataclass(frozen=True, slots=True)
class LayoutShape:
    """A layout's shape; 0 or "" where not known."""

    block_tokens: int = 0
    num_layers: int = 0
    num_kv_heads: int = 0
    head_size: int = 0
    dtype: str = ""
    description: str = ""

    @classmethod
    def described(cls, signature: bytes, description: str) -> LayoutShape | None:
        """The shape ``description`` (``KVLayout.describe()``'s text) gives, or None where it
        does not hash to ``signature`` or cannot be read."""
        if not description or len(description) > MAX_DESCRIPTION_CHARS:
            return None
        if xxhash.xxh3_128_digest(description.encode()) != signature:
            return None
        fields = dict(part.partition("=")[::2] for part in description.split(";"))
        shape = {"description": description, "dtype": fields.get("dtype", "")}
        try:
            for key, name in (*_INT_FIELDS.items(), ("k", "head_size")):
                shape[name] = int(fields.get(key) or 0)
        except ValueError:
            return None
        return cls(**shape)

    def learn(self, signature: bytes, block_tokens: int, description: str) -> LayoutShape:
        """This shape with what an ``Open`` said: a description that hashes to ``signature``
        says everything; else ``block_tokens`` fills an unknown block size."""
        if description and not self.description:
            shape = LayoutShape.described(signature, description)
            if shape is not None:
                return shape
            log.warning(
                "layout %s: an Open's layout_description does not hash to its signature; "
                "ignored (%.120r)",
                signature.hex(),
                description,
            )
        if block_tokens > 0 and not self.block_tokens:
            return replace(self, block_tokens=block_tokens)
        return self

    def saved(self) -> dict:
        """What ``layout_dirs`` writes beside the disk tier: what cannot be read back from
        the description is the block size of a layout named by signature alone."""
        return {"block_tokens": self.block_tokens, "layout_description": self.description}

    @classmethod
    def from_saved(cls, signature: bytes, fields: dict) -> LayoutShape:
        """The shape ``saved`` wrote (from a directory of an older daemon: nothing known)."""
        description = fields.get("layout_description")
        if isinstance(description, str) and description:
            shape = cls.described(signature, description)
            if shape is not None:
                return shape
        tokens = fields.get("block_tokens")
        return cls(block_tokens=tokens if isinstance(tokens, int) and tokens > 0 else 0)

    def label(self) -> str:
        """``64 tok, 32 layers x 8 kv heads x 128, bfloat16`` (what is known of it)."""
        parts = [f"{self.block_tokens} tok" if self.block_tokens else "? tok"]
        if self.num_layers:
            parts.append(
                f"{self.num_layers} layers x {self.num_kv_heads} kv heads x {self.head_size}"
            )
        if self.dtype:
            parts.append(self.dtype)
        return ", ".join(parts)
