"""The KV tensor forms vLLM's CUDA attention backends hand to a connector, read from shapes and strides.

vLLM builds each layer's cache as `get_kv_cache_shape(...)` (the *logical* dims) viewed over memory
permuted by `get_kv_cache_stride_order()`, so the tensor the connector receives has logical dims with
permuted strides.  The logical dims, by release (read in each wheel's `v1/attention/backends/`):

| vLLM | FlashAttention, Triton, FlashInfer, FlexAttention (dense, bf16/fp16/fp8 KV) |
|---|---|
| 0.24, 0.25 | 5-D `(blocks, 2, block_size, heads, head_size)`; NHD or HND stride order |
| 0.26 – 0.33 | 4-D `(blocks, heads, block_size, 2 * head_size)`: each (token, head) row holds K then V; physical NHD `(blocks, block_size, heads, 2D)` by default, or HND |
| 0.29 – 0.33 | the same 4-D views of one buffer for all layers (`kv_cache_interface.create_kv_cache_views`), laid out by the resolved `KVCacheLayout`: LBNHC / LBHNC per layer, BLNHC / BLHNC cross-layer (block stride = every layer's page), pages possibly padded |

Older releases (and ROCm) used 5-D `(2, blocks, block_size, heads, head_size)`, read here as well.  The
physical order is taken from the strides, never assumed.

MLA (DeepSeek-class models; `latent=True`): one latent row per token, `head_size` = kv_lora_rank + rope dims
(576 for DeepSeek-V2/V3), K and V in one, the same on every TP rank:

| vLLM | FlashMLA, CUTLASS MLA, FlashInfer MLA, Triton MLA (bf16 or fp8 / fp8_e4m3 stored as uint8) |
|---|---|
| 0.24 – 0.28 | 3-D `(blocks, block_size, head_size)` (MLACommonBackend.get_kv_cache_shape) |
| 0.29 – 0.33 | 4-D `(blocks, 1, block_size, head_size)`: `create_kv_cache_views` of an MLAAttentionSpec (head_size_v 0) |

Anything else (K/V interleaved per token as FlexAttention's 0.24 stride order makes it, per-token quantisation
scales padding the head or the latent, e.g. DeepSeek-V3.2's fp8_ds_mla 656-byte rows, a kernel block size other
than the scheduler's, hybrid state lists) is refused with the shape, strides and backend named, at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from kvpush_common.protocol.layout import LayoutError

# logical dim names: kv = the K/V selector (size 2), block, token (block_size), head, dim (head_size),
# kvdim (2 * head_size: K then V of one token and head)
_FORMS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("blocks-first 5-D (blocks, 2, block_size, heads, head_size)", ("block", "kv", "token", "head", "dim")),
    ("kv-first 5-D (2, blocks, block_size, heads, head_size)", ("kv", "block", "token", "head", "dim")),
    ("packed 4-D (blocks, heads, block_size, 2 * head_size)", ("block", "head", "token", "kvdim")),
)
# MLA: one latent row (`dim` = the latent width) per token of the one head
_LATENT_FORMS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("MLA latent 3-D (blocks, block_size, head_size)", ("block", "token", "dim")),
    ("MLA latent 4-D (blocks, 1, block_size, head_size)", ("block", "head", "token", "dim")),
)


@dataclass(frozen=True)
class KVForm:
    """How one layer's cache sits in memory, in elements: where block b, token t, head h of K (or V) starts."""

    name: str
    num_blocks: int
    order: Literal["NHD", "HND"]
    block_stride: int
    kv_planes: Literal[1, 2]
    plane_stride: int  # kv_planes 2: from K plane to V plane; 1: unused (K|V share each row)
    row: int  # elements in one (token, head) row: head_size, or 2 * head_size when K and V share a row


def describe_form(t: torch.Tensor, *, block_size: int, num_heads: int, head_size: int,
                  backend: str = "unknown", latent: bool = False) -> KVForm:
    """Read one layer's KV tensor; LayoutError naming shape, strides and backend if it is no known form.
    `latent`: the model uses MLA (vLLM's `model_config.use_mla`), whose cache is one latent head."""
    what = f"KV tensor shape {tuple(t.shape)} strides {tuple(t.stride())} (attention backend {backend})"
    if latent and num_heads != 1:
        raise LayoutError(f"an MLA cache holds one latent head per rank, not {num_heads}: {what}")
    sizes = {"kv": 2, "token": block_size, "head": num_heads, "dim": head_size, "kvdim": 2 * head_size}
    forms = _LATENT_FORMS if latent else _FORMS
    matches = [(name, dims) for name, dims in forms
               if t.dim() == len(dims) and all(d == "block" or t.shape[i] == sizes[d] for i, d in enumerate(dims))]
    if not matches:
        hint = ""
        if t.dim() == 3 and not latent:
            hint = ": a 3-D cache is MLA's latent form, but vLLM says this model does not use MLA"
        elif latent and block_size in tuple(t.shape):
            hint = (f": an MLA row other than the latent width {head_size} (per-token quantisation scales inline, "
                    "e.g. fp8_ds_mla) is not a format kvpush moves")
        elif t.dim() in (3, 4, 5) and block_size not in tuple(t.shape):
            hint = f": no dim equals the scheduler block size {block_size} (a different kernel block size?)"
        raise LayoutError(f"unknown KV layout: {what}; expected one of "
                          + "; ".join(n for n, _ in forms)
                          + f" with block_size {block_size}, {num_heads} heads, head_size {head_size}{hint}")
    problems = []
    for name, dims in matches:
        st = dict(zip(dims, t.stride()))
        if "head" not in st:  # the 3-D latent form: one head, whose stride is meaningless
            st["head"] = head_size
        row_dim = "kvdim" if "kvdim" in st else "dim"
        row = sizes[row_dim]
        if st[row_dim] != 1:
            problems.append(f"{name}: the head_size dim is not innermost")
            continue
        if num_heads == 1 and st["token"] == row:
            order = "HND"  # one head: both orders are the same bytes (the head stride is meaningless)
        elif block_size == 1 and st["head"] == row:
            order = "NHD"  # one token per block: likewise
        elif (st["token"], st["head"]) == (num_heads * row, row):
            order = "NHD"
        elif (st["token"], st["head"]) == (row, block_size * row):
            order = "HND"
        else:
            problems.append(f"{name}: a block's (token, head) rows are neither NHD nor HND packed"
                            + (" (K and V interleaved inside a block)" if "kv" in st else ""))
            continue
        block_elems = block_size * num_heads * row
        nblocks = t.shape[dims.index("block")]
        if "kv" in st:
            (s_in, n_in), (s_out, _) = sorted([(st["kv"], 2), (st["block"], nblocks)])
            if s_in < block_elems or s_out < s_in * n_in:
                problems.append(f"{name}: blocks or K/V planes overlap")
                continue
            return KVForm(name, nblocks, order, st["block"], 2, st["kv"], row)
        if st["block"] < block_elems:
            problems.append(f"{name}: blocks overlap")
            continue
        return KVForm(name, nblocks, order, st["block"], 1, 0, row)
    raise LayoutError(f"unknown KV layout: {what}: " + "; ".join(problems))
