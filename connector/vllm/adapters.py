"""LoRA adapters named by content in kvtier's block hashes.

A LoRA request's blocks carry its adapter's key on every block (``ExtraKeys.lora``). The name
alone does not say which weights computed them: an adapter reloaded under the same name
(vLLM's ``load_inplace``, a new path, new files at the old path) computes other KV. The key is
an xxh3-128 of the adapter's files (names and contents), computed once per version of its
files: a request re-checks the files' sizes, modification times and inodes, and hashes them
again only if one changed. An adapter whose files are not on this host (a hub id vLLM has not
downloaded yet) keeps its name as its key, as vLLM itself names it; a warning says so once.

vLLM serves the weights it loaded: replace an adapter's files only together with reloading it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import xxhash

log = logging.getLogger(__name__)

READ_BYTES = 8 << 20


class AdapterKeys:
    """The content key of each LoRA adapter a request names, kept per path while its files
    stay the same."""

    __slots__ = ("_known", "_warned")

    def __init__(self) -> None:
        self._known: dict[str, tuple[tuple, str]] = {}
        self._warned: set[str] = set()

    def key(self, lora_request) -> str | None:
        """The key of ``lora_request``'s adapter (None: no LoRA)."""
        if lora_request is None:
            return None
        path = _adapter_dir(lora_request.lora_path)
        files = _files(path) if path is not None else []
        if not files:
            if lora_request.lora_name not in self._warned:
                self._warned.add(lora_request.lora_name)
                log.warning(
                    "kvtier: LoRA adapter %r has no files at %r on this host; its blocks are "
                    "named by its name only",
                    lora_request.lora_name,
                    lora_request.lora_path,
                )
            return f"name:{lora_request.lora_name}"
        stamp = tuple((f.name, st.st_size, st.st_mtime_ns, st.st_ino) for f, st in files)
        known = self._known.get(str(path))
        if known is not None and known[0] == stamp:
            return known[1]
        key = "files:" + _content_digest(files)
        self._known[str(path)] = (stamp, key)
        return key


def _adapter_dir(lora_path: str) -> Path | None:
    """Where the adapter's files are on this host, as vLLM resolves ``lora_path`` (a local
    path, or a hub id already in the local cache; never a download)."""
    path = Path(lora_path).expanduser()
    if path.is_dir():
        return path.resolve()
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(lora_path, local_files_only=True))
    except (ImportError, OSError, ValueError):
        return None


def _files(path: Path) -> list[tuple[Path, os.stat_result]]:
    return sorted(
        ((entry, entry.stat()) for entry in path.iterdir() if entry.is_file()),
        key=lambda item: item[0].name,
    )


def _content_digest(files: list[tuple[Path, os.stat_result]]) -> str:
    digest = xxhash.xxh3_128()
    for file, stat in files:
        digest.update(file.name.encode() + b"\0" + stat.st_size.to_bytes(8, "little"))
        with file.open("rb") as f:
            while chunk := f.read(READ_BYTES):
                digest.update(chunk)
    return digest.hexdigest()
