"""Where an engine keeps one layout's pages: a strided view of its KV backing buffer.

vLLM allocates one flat buffer and views it per layer as ``[B, H, N, C]`` with strides chosen
by its ``KVCacheLayout`` (``BLHNC``, ``LBHNC``, ``LBNHC``, ...): page ``(layer, block)``
starts at ``offset + layer * layer_stride + block * block_stride`` and its ``[H, N, C]`` cells
sit ``head_stride`` and ``token_stride`` apart. ``KVPlacement`` records exactly that, in bytes,
over the whole backing buffer. When the engine's order is the canonical one
(``block_contiguous``) block ``b`` is the ``block_bytes`` run at ``block_offset(b)`` and moves
as one DMA; otherwise ``gather``/``scatter`` move blocks between the pages and rows of
canonical blocks with one indexing kernel for all layers.

Some attention kernels read smaller blocks than vLLM allocates: vLLM then views each cache
block as ``kernel_blocks`` kernel blocks of ``block_size / kernel_blocks`` tokens,
``kernel_stride`` bytes apart, each its own ``[H, n, C]`` page. Token ``t`` of a block lies in
kernel block ``t // n``; the canonical block is unchanged (``[L][H][N][C]`` over all its
tokens), so blocks move between engines whatever their kernel block size.

The reference engine allocates its pool here too (``allocate``), in the canonical order.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from kvtier.tiers.gpu.plan import Runs, plan_runs
from kvtier.tiers.layout import BLOCK_ORDER, KVLayout

ORDERS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
"""Physical order of the logical axes ``[L, B, H, N, C]`` (outermost first), as vLLM's
``KVCacheLayout`` names them."""

_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


@dataclass(frozen=True, eq=False)
class KVPlacement:
    """One layout's pages inside ``buffer`` (uint8, 1-D: the engine's whole KV allocation).

    Offsets and strides are in bytes; ``C`` (``layout.row_bytes``) is always contiguous.
    """

    layout: KVLayout
    buffer: torch.Tensor
    num_blocks: int
    offset: int
    layer_stride: int
    block_stride: int
    head_stride: int
    token_stride: int
    kernel_blocks: int = 1
    """Kernel blocks per cache block (1: the attention kernel reads whole cache blocks)."""
    kernel_stride: int = 0
    """Bytes from one kernel block of a cache block to the next."""

    def __post_init__(self) -> None:
        if self.buffer.dtype != torch.uint8 or self.buffer.dim() != 1:
            raise ValueError("a KV placement's buffer must be a 1-D uint8 tensor")
        if self.num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        lay = self.layout
        if min(self.offset, self.layer_stride, self.block_stride, self.kernel_stride) < 0:
            raise ValueError("KV placement offsets and strides must be non-negative")
        if self.kernel_blocks < 1 or lay.block_size % self.kernel_blocks:
            raise ValueError(
                f"{self.kernel_blocks} kernel blocks do not split a block of {lay.block_size}"
            )
        last = (
            self.offset
            + (lay.num_layers - 1) * self.layer_stride
            + (self.num_blocks - 1) * self.block_stride
            + (self.kernel_blocks - 1) * self.kernel_stride
            + (lay.num_kv_heads - 1) * self.head_stride
            + (self.kernel_tokens - 1) * self.token_stride
            + lay.row_bytes
        )
        if last > self.buffer.numel():
            raise ValueError(
                f"KV placement reaches byte {last} of a {self.buffer.numel()}-byte buffer"
            )

    # ---- construction ----

    @classmethod
    def allocate(
        cls,
        layout: KVLayout,
        num_blocks: int,
        device: torch.device | str = "cpu",
        order: str = BLOCK_ORDER,
    ) -> KVPlacement:
        """A zeroed buffer laid out as vLLM lays out ``order`` (padded pages included)."""
        if order not in ORDERS:
            raise ValueError(f"unknown KV order {order!r}; known: {sorted(ORDERS)}")
        perm = ORDERS[order]
        padded = layout.page_stride != layout.page_bytes
        if padded and set(perm[2:]) != {2, 3, 4}:
            raise ValueError(f"{order} cannot pad pages: heads or tokens lie outside the page")
        sizes = (layout.num_layers, num_blocks, layout.num_kv_heads, layout.block_size)
        strides = [0] * 4
        current = layout.row_bytes  # C is innermost in every order
        for pos in range(3, -1, -1):
            dim = perm[pos]
            if padded and pos == 1:
                current = layout.page_stride  # the page [H, N, C] ends here: pad it
            strides[dim] = current
            current *= sizes[dim]
        buffer = torch.zeros(current, dtype=torch.uint8, device=device)
        return cls(layout, buffer, num_blocks, 0, strides[0], strides[1], strides[2], strides[3])

    @classmethod
    def from_layer_views(cls, layout: KVLayout, views: Sequence[torch.Tensor]) -> KVPlacement:
        """The placement behind per-layer ``[B, H, N, C]`` views of one buffer (vLLM's).

        Views of kernel blocks (``[B * k, H, N / k, C]``, vLLM's split of each cache block
        into ``k`` kernel blocks) are recognised by their token count.
        """
        if len(views) != layout.num_layers:
            raise ValueError(f"expected {layout.num_layers} layer tensors, got {len(views)}")
        first = views[0]
        elem = first.element_size()
        c = (layout.head_size + layout.head_size_v) * layout.elem_bytes // elem
        tokens = first.shape[2] if first.dim() == 4 and first.shape[2] > 0 else layout.block_size
        kernel_blocks = layout.block_size // tokens if layout.block_size % tokens == 0 else 1
        if first.shape[0] % kernel_blocks:
            kernel_blocks = 1  # not a kernel split: the shape check below says what is wrong
        want = (layout.num_kv_heads, layout.block_size // kernel_blocks, c)
        storage = first.untyped_storage()
        base = storage.data_ptr()
        offsets = []
        for i, view in enumerate(views):
            if view.dim() != 4 or tuple(view.shape[1:]) != want or view.dtype != layout.dtype:
                raise ValueError(
                    f"layer {i}: KV tensor {tuple(view.shape)} {view.dtype} is not "
                    f"[blocks, {', '.join(map(str, want))}] {layout.dtype}"
                )
            if view.untyped_storage().data_ptr() != base:
                raise ValueError(f"layer {i}: KV tensors must share one backing buffer")
            if view.stride() != first.stride() or view.shape[0] != first.shape[0]:
                raise ValueError(f"layer {i}: KV tensors differ in block count or strides")
            if c > 1 and view.stride(3) != 1:
                raise ValueError(f"layer {i}: the C axis of the KV tensor must be contiguous")
            offsets.append(view.data_ptr() - base)
        layer_stride = offsets[1] - offsets[0] if len(offsets) > 1 else 0
        if any(b - a != layer_stride for a, b in itertools.pairwise(offsets)):
            raise ValueError("KV tensors must sit one constant layer stride apart")
        buffer = torch.empty(0, dtype=torch.uint8, device=first.device)
        buffer.set_(storage, 0, (storage.nbytes(),), (1,))
        s = first.stride()
        return cls(
            layout,
            buffer,
            first.shape[0] // kernel_blocks,
            offsets[0],
            layer_stride,
            s[0] * elem * kernel_blocks,
            s[1] * elem,
            s[2] * elem,
            kernel_blocks,
            s[0] * elem if kernel_blocks > 1 else 0,
        )

    # ---- what it looks like ----

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    @property
    def kernel_tokens(self) -> int:
        """Tokens of one kernel block (the whole block when the kernel reads whole blocks)."""
        return self.layout.block_size // self.kernel_blocks

    @cached_property
    def block_contiguous(self) -> bool:
        """True if every block is one run of ``block_bytes`` in the canonical byte order."""
        lay = self.layout
        n = self.kernel_tokens
        return (
            (lay.num_layers == 1 or self.layer_stride == lay.page_stride)
            and (lay.num_kv_heads == 1 or self.head_stride == lay.block_size * lay.row_bytes)
            and (n == 1 or self.token_stride == lay.row_bytes)
            # kernel blocks continue the token axis only where no head axis lies between
            and (
                self.kernel_blocks == 1
                or (lay.num_kv_heads == 1 and self.kernel_stride == n * lay.row_bytes)
            )
            and (self.num_blocks == 1 or self.block_stride >= lay.block_bytes)
        )

    def block_offset(self, block_id: int) -> int:
        """Byte offset of a block's first page (its whole run when ``block_contiguous``)."""
        return self.offset + block_id * self.block_stride

    def block_runs(
        self, block_ids: Sequence[int], slots: Sequence[int], host_boundary: int = 0
    ) -> Runs:
        """The copies of whole blocks (``block_contiguous``) into or out of slots of
        ``block_bytes``, merged where both sides continue (``plan_runs``)."""
        first, stride, size = self.offset, self.block_stride, self.layout.block_bytes
        return plan_runs(
            [first + b * stride for b in block_ids], [s * size for s in slots], size, host_boundary
        )

    @cached_property
    def word(self) -> tuple[int, torch.dtype]:
        """The widest word every offset and stride is a multiple of, for indexing kernels."""
        lay = self.layout
        sizes = [self.offset, self.block_stride, lay.row_bytes, lay.page_stride, lay.block_bytes]
        sizes += [self.layer_stride] if lay.num_layers > 1 else []
        sizes += [self.head_stride] if lay.num_kv_heads > 1 else []
        sizes += [self.token_stride] if self.kernel_tokens > 1 else []
        sizes += [self.kernel_stride] if self.kernel_blocks > 1 else []
        for size, dtype in _WORDS:
            if all(s % size == 0 for s in sizes) and self.buffer.data_ptr() % size == 0:
                return size, dtype
        raise AssertionError("unreachable: every size is a multiple of one byte")

    def word_for(self, rows: torch.Tensor) -> tuple[int, torch.dtype]:
        """The widest word for moving blocks between the pages and ``rows`` (its alignment)."""
        for size, dtype in _WORDS:
            if size <= self.word[0] and rows.data_ptr() % size == 0:
                return size, dtype
        raise AssertionError("unreachable: every address is a multiple of one byte")

    def pages(self, word: tuple[int, torch.dtype] | None = None) -> torch.Tensor:
        """Every page as ``[L, B, K, H, N / K, C]`` words, ``K`` the kernel blocks per block
        (a view of the buffer)."""
        size, dtype = word or self.word
        lay = self.layout
        words = _words(self.buffer, size, dtype)
        shape = (
            lay.num_layers,
            self.num_blocks,
            self.kernel_blocks,
            lay.num_kv_heads,
            self.kernel_tokens,
        )
        strides = (
            self.layer_stride,
            self.block_stride,
            self.kernel_stride,
            self.head_stride,
            self.token_stride,
        )
        return words.as_strided(
            (*shape, lay.row_bytes // size),
            (*(s // size for s in strides), 1),
            self.offset // size,
        )

    def rows_view(
        self, rows: torch.Tensor, word: tuple[int, torch.dtype] | None = None
    ) -> torch.Tensor:
        """uint8 ``[n, block_bytes]`` canonical rows as ``[L, n, K, H, N / K, C]`` words, the
        shape of ``pages`` (a view)."""
        size, dtype = word or self.word_for(rows)
        lay = self.layout
        n = rows.shape[0]
        if rows.dtype != torch.uint8 or rows.shape[1:] != (lay.block_bytes,):
            raise ValueError(f"rows must be uint8 [n, {lay.block_bytes}], got {tuple(rows.shape)}")
        if not rows.is_contiguous() or rows.data_ptr() % size:
            raise ValueError("rows must be contiguous and word-aligned")
        flat = rows.view(-1)
        words = _words(flat, size, dtype)
        row = lay.row_bytes // size
        tokens = self.kernel_tokens
        return words.as_strided(
            (lay.num_layers, n, self.kernel_blocks, lay.num_kv_heads, tokens, row),
            (
                lay.page_stride // size,
                lay.block_bytes // size,
                tokens * row,
                lay.block_size * row,
                row,
                1,
            ),
        )

    def layer_views(self) -> list[torch.Tensor]:
        """Per-layer ``[B, H, N, head_size + head_size_v]`` views in the layout's dtype."""
        if self.kernel_blocks > 1:
            raise ValueError("a block split into kernel blocks has no [B, H, N, C] view")
        lay = self.layout
        elem = lay.elem_bytes
        typed = _words(self.buffer, elem, lay.dtype)
        c = lay.head_size + lay.head_size_v
        shape = (self.num_blocks, lay.num_kv_heads, lay.block_size, c)
        strides = (self.block_stride, self.head_stride, self.token_stride)
        strides = (*(s // elem for s in strides), 1)
        return [
            typed.as_strided(shape, strides, (self.offset + layer * self.layer_stride) // elem)
            for layer in range(lay.num_layers)
        ]

    # ---- moving blocks ----

    def gather(self, block_ids: torch.Tensor, out: torch.Tensor) -> None:
        """Copies blocks ``block_ids`` into canonical rows ``out`` (uint8 ``[n, block_bytes]``).

        One indexing kernel for every layer, writing straight into ``out``; ``block_ids`` and
        ``out`` live on the buffer's device. Page padding in ``out`` is left as it was.
        """
        word = self.word_for(out)
        target = self.rows_view(out, word)
        ptr = target.data_ptr()
        torch.index_select(self.pages(word), 1, block_ids, out=target)
        if target.data_ptr() != ptr:
            raise RuntimeError("torch reallocated the rows of a gather instead of filling them")

    def scatter(self, rows: torch.Tensor, block_ids: torch.Tensor) -> None:
        """Writes canonical rows ``rows`` (uint8 ``[n, block_bytes]``) into blocks ``block_ids``."""
        word = self.word_for(rows)
        self.pages(word).index_copy_(1, block_ids, self.rows_view(rows, word))

    def block_pages(self, block_id: int) -> torch.Tensor:
        """Block ``block_id`` as ``[L, K, H, N / K, C]`` bytes (a strided view, for row
        copies)."""
        return self.pages((1, torch.uint8))[:, block_id]

    def row_pages(self, row: torch.Tensor) -> torch.Tensor:
        """One canonical row (uint8 ``[block_bytes]``) in the shape of ``block_pages``."""
        return self.rows_view(row.view(1, -1), (1, torch.uint8))[:, 0]


def _words(flat: torch.Tensor, size: int, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D uint8 tensor seen as words of ``size`` bytes (its tail cut to a whole word)."""
    usable = flat.numel() - flat.numel() % size
    return flat[:usable].view(dtype)
