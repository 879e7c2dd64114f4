"""How one rank's KV cache sits in memory, described well enough to address any token of any head.

A device backend (host, CUDA, Neuron) describes its caches with a `KVLayout`; the planner turns two
layouts plus block id lists into byte ranges.  The layout travels in the handshake, so it is a
msgspec struct with bounded fields.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

MAX_REGIONS = 4096  # 2 per layer: enough for 2048 layers
U64 = Annotated[int, Meta(ge=0, le=2**63 - 1)]  # user-space addresses
Count = Annotated[int, Meta(ge=1, le=2**31)]

# Within one block, "NHD" stores [token][head][dim] and "HND" stores [head][token][dim].
BlockOrder = Literal["NHD", "HND"]


class LayoutError(ValueError):
    """A layout is inconsistent in itself or cannot be paired with its peer's."""


class Region(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One layer's K (or V) plane: `num_blocks` blocks, block i at `base + i * block_stride`."""

    base: U64
    block_stride: Annotated[int, Meta(ge=1, lt=2**48)]
    mem_id: Annotated[int, Meta(ge=0, lt=2**20)] = 0  # which registration holds it; merges never cross
    device_id: Annotated[int, Meta(ge=0, lt=2**16)] = 0


class KVLayout(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """The KV cache of one rank: `regions` lists layer 0 K, layer 0 V, layer 1 K, ...

    `num_heads` is the number of KV heads held by this rank; `head_offset` is the first global head
    it holds (topology decides it).  A block holds `block_size` tokens of all local heads.
    """

    num_layers: Count
    num_heads: Annotated[int, Meta(ge=1, le=4096)]
    head_dim: Annotated[int, Meta(ge=1, le=65536)]
    dtype_size: Annotated[int, Meta(ge=1, le=16)]
    dtype: Annotated[str, Meta(max_length=32)]
    block_size: Annotated[int, Meta(ge=1, le=65536)]
    num_blocks: Count
    order: BlockOrder
    regions: Annotated[list[Region], Meta(max_length=MAX_REGIONS)]
    mem_type: Literal["DRAM", "VRAM"] = "DRAM"
    head_offset: Annotated[int, Meta(ge=0, le=1 << 20)] = 0
    # 2: a K plane and a V plane per layer.  1: one region per layer whose rows hold K and V together;
    # `head_dim` is then the row width (2 * head_size).
    kv_planes: Literal[1, 2] = 2
    # Rows inside a block are (token, head) rows in `order`, so any token of any head is addressable.
    # False only for kv_planes=1 caches whose rows are not tokens (vLLM's CPU cache keeps a head's K
    # rows then its V rows in a [block, head] slab): then only whole blocks move, in one block order.
    # vLLM >= 0.26 CUDA caches, (blocks, heads, block_size, 2 * head_size), hold K|V per row: True.
    token_rows: bool = True
    # The value format of the bytes, which `dtype` (their storage type) does not say: vLLM's --kv-cache-dtype
    # ("auto": the model dtype, as `dtype` says; "fp8_e4m3", "fp8_e5m2": both stored as uint8), or a device
    # backend's more exact name where one name means different formats on its hardware (an e4m3 whose largest
    # value is 240 is not one whose largest is 448).  `kv_scales` names the per-layer K/V scales the values are
    # multiplied by ("" where the cache is not quantised): bytes written under one scale read wrong under another.
    cache_dtype: Annotated[str, Meta(max_length=32, pattern=r"^[A-Za-z0-9_.:\-]+\Z")] = "auto"
    kv_scales: Annotated[str, Meta(max_length=80)] = ""
    # MLA (DeepSeek-class models): each row is one token's latent vector (kv_lora_rank + rope dims, K and V in one),
    # `head_dim` is its width and `num_heads` is 1; every TP rank holds the same latent, so topology replicates the
    # one head and each consumer rank takes it from one producer rank.  kv_planes is then 1.
    latent: bool = False
    # The speculative-decoding drafter whose KV layers are listed with the target's ("" without one), as
    # "method:draft model" (vLLM's NixlConnector hashes the same two): a consumer's drafter must find the KV of the
    # drafter it runs, or it proposes from another model's bytes.
    drafter: Annotated[str, Meta(max_length=128)] = ""

    @property
    def token_bytes(self) -> int:
        """Bytes of one token of one head."""
        return self.head_dim * self.dtype_size

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.num_heads * self.token_bytes

    def summary(self) -> str:
        """One line for logs: form, heads x row width, value format, block size and order."""
        fmt = self.dtype if self.cache_dtype == "auto" else f"{self.cache_dtype} (stored {self.dtype})"
        return (f"{'latent' if self.latent else 'kv'} {self.num_heads}x{self.head_dim} {fmt}, "
                f"{self.num_layers} layers, block {self.block_size} {self.order}"
                + (f", drafter {self.drafter}" if self.drafter else ""))

    def region_span(self, r: int) -> tuple[int, int]:
        """[start, end) bytes that region r may touch."""
        reg = self.regions[r]
        return reg.base, reg.base + (self.num_blocks - 1) * reg.block_stride + self.block_bytes

    def validate(self) -> "KVLayout":
        if self.latent and (self.kv_planes != 1 or self.num_heads != 1):
            raise LayoutError("a latent (MLA) layout holds one region per layer (kv_planes=1) of one head")
        if not self.token_rows and self.kv_planes != 1:
            raise LayoutError("token_rows=False describes one-region-per-layer caches only (kv_planes=1)")
        if len(self.regions) != self.kv_planes * self.num_layers:
            raise LayoutError(
                f"layout has {len(self.regions)} regions for {self.num_layers} layers; expected {self.kv_planes} per layer"
            )
        for i, reg in enumerate(self.regions):
            if reg.block_stride < self.block_bytes:
                raise LayoutError(
                    f"region {i}: block_stride {reg.block_stride} < block bytes {self.block_bytes} (blocks would overlap)"
                )
            if self.region_span(i)[1] >= 2**63:
                raise LayoutError(f"region {i} extends past the 63-bit address space")
        return self

    def geometry(self) -> tuple:
        """What both sides must agree on whatever their TP size, block size or block order."""
        return tuple(getattr(self, f) for f in GEOMETRY_FIELDS)


GEOMETRY_FIELDS = ("num_layers", "head_dim", "dtype", "dtype_size", "kv_planes", "token_rows", "cache_dtype",
                   "kv_scales", "latent", "drafter")
# the geometry fields that say what the bytes mean (compat_hash factors whenever they are not the default)
VALUE_FIELDS = ("cache_dtype", "kv_scales", "latent", "drafter")


# The fix for a pair whose bytes mean different values (the same shape read as another format or scale).
VALUE_FORMAT_FIX = ("serve P and D with one KV value format: the same --kv-cache-dtype and checkpoint on devices that "
                    "store it alike (a device's own format follows ':', e.g. an FP8 range: Trainium2 e4m3 max240, "
                    "Trainium3 e4m3fn max448, so P and D on one generation), or a bf16 KV cache (auto) on both")


def geometry_difference(peer: KVLayout, local: KVLayout) -> str | None:
    """Which geometry fields differ, as `name peer vs local` (None: the same), for a refusal that names them, and
    the fix where the value format differs."""
    diffs = [f"{f} {getattr(peer, f)} vs {getattr(local, f)}" for f in GEOMETRY_FIELDS
             if getattr(peer, f) != getattr(local, f)]
    if (peer.cache_dtype, peer.kv_scales) != (local.cache_dtype, local.kv_scales):
        diffs[-1] += f"; fix: {VALUE_FORMAT_FIX}"
    return ", ".join(diffs) or None


def same_block_arrangement(src: KVLayout, dst: KVLayout, num_heads: int) -> bool:
    """A block's bytes of `num_heads` heads sit in the same order on both sides, so whole blocks copy as they
    are: the same block size and token bytes, and the same block order unless the slice is one head or a block
    holds one token (then NHD and HND store identical bytes)."""
    return (src.block_size == dst.block_size and src.token_bytes == dst.token_bytes
            and (src.order == dst.order or num_heads == 1 or src.block_size == 1))


def check_pairable(src: KVLayout, dst: KVLayout) -> None:
    """Raise LayoutError with the first mismatch that makes a byte-exact copy impossible."""
    if src.geometry() != dst.geometry():
        diffs = [f"{n}: {a} vs {b}" for n, a, b in zip(GEOMETRY_FIELDS, src.geometry(), dst.geometry()) if a != b]
        raise LayoutError("KV geometry differs between producer and consumer: " + ", ".join(diffs))
    if len(src.regions) != len(dst.regions):
        raise LayoutError(f"region count differs: {len(src.regions)} vs {len(dst.regions)}")
    if not src.token_rows and (src.block_size, src.order) != (dst.block_size, dst.order):
        raise LayoutError("layouts whose rows are not tokens move whole blocks only: block size and block order must match "
                          f"({src.block_size} {src.order} vs {dst.block_size} {dst.order})")


def contiguous_layout(
    base: int,
    *,
    num_layers: int,
    num_heads: int,
    head_dim: int,
    block_size: int,
    num_blocks: int,
    dtype: str = "bfloat16",
    dtype_size: int = 2,
    order: BlockOrder = "HND",
    blocks_first: bool = False,
    cross_layer: bool = False,
    mem_id_per_layer: bool = False,
    mem_type: Literal["DRAM", "VRAM"] = "DRAM",
    device_id: int = 0,
    head_offset: int = 0,
    cache_dtype: str = "auto",
    kv_scales: str = "",
    latent: bool = False,
    drafter: str = "",
) -> KVLayout:
    """A layout for one slab at `base`, laid out layer by layer.

    Per layer, `blocks_first=False` is (2, num_blocks, block) as FlashAttention and the Neuron
    plugin store it (K plane then V plane); `blocks_first=True` is (num_blocks, 2, block) as
    FlashInfer stores it.  `cross_layer=True` is vLLM's cross-layer cache instead: block-major, every layer's
    K and V of block b back to back (`cross_layer_blocks`).  `latent=True` is MLA's cache: one plane per layer
    of (num_blocks, block) with one head whose rows are `head_dim` wide.
    """
    planes_per_layer = 1 if latent else 2
    block_bytes = block_size * num_heads * head_dim * dtype_size
    layer_bytes = planes_per_layer * num_blocks * block_bytes
    regions = []
    if cross_layer:
        regions = [Region(base + r * block_bytes, planes_per_layer * num_layers * block_bytes, 0, device_id)
                   for r in range(planes_per_layer * num_layers)]
    for layer in range(0 if cross_layer else num_layers):
        lbase = base + layer * layer_bytes
        mem_id = layer if mem_id_per_layer else 0
        if latent:
            planes = [(lbase, block_bytes)]
        elif blocks_first:
            planes = [(lbase, 2 * block_bytes), (lbase + block_bytes, 2 * block_bytes)]
        else:
            planes = [(lbase, block_bytes), (lbase + num_blocks * block_bytes, block_bytes)]
        regions += [Region(b, s, mem_id, device_id) for b, s in planes]
    return KVLayout(
        num_layers=num_layers,
        num_heads=num_heads,
        head_dim=head_dim,
        dtype_size=dtype_size,
        dtype=dtype,
        block_size=block_size,
        num_blocks=num_blocks,
        order=order,
        regions=regions,
        mem_type=mem_type,
        head_offset=head_offset,
        kv_planes=planes_per_layer,
        cache_dtype=cache_dtype,
        kv_scales=kv_scales,
        latent=latent,
        drafter=drafter,
    ).validate()


def slab_bytes(layout: KVLayout) -> int:
    """Bytes spanned from the first region's base to the end of the last region (one slab)."""
    return max(layout.region_span(r)[1] for r in range(len(layout.regions))) - min(
        reg.base for reg in layout.regions
    )


def layer_order(name: str) -> tuple:
    """Sort key for layer names that orders `layers.2` before `layers.10` (engines list caches by name)."""
    return tuple(int(x) if x.isdigit() else x for x in re.split(r"(\d+)", name))
