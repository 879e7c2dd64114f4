"""kvpush_cuda's reading of vLLM's CUDA KV tensors, checked on CPU tensors of the same shapes and
strides against the tensors' own indexing (no GPU needed), plus its registration slicing."""

import pytest
import torch

from kvpush_common.layout import LayoutError, contiguous_layout
from kvpush_cuda.backend import describe_cuda_caches
from kvpush_cuda.device import sliced_registrations

B, BS, H, D = 6, 4, 2, 8


def fa(order):  # FlashAttention: (2, B, bs, H, D); HND = bs and H strides permuted
    if order == "NHD":
        return torch.zeros(2, B, BS, H, D, dtype=torch.bfloat16)
    return torch.zeros(2, B, H, BS, D, dtype=torch.bfloat16).transpose(2, 3)


def fi(order):  # FlashInfer: (B, 2, bs, H, D)
    if order == "NHD":
        return torch.zeros(B, 2, BS, H, D, dtype=torch.bfloat16)
    return torch.zeros(B, 2, H, BS, D, dtype=torch.bfloat16).transpose(2, 3)


@pytest.mark.parametrize("make,kv_first", [(fa, True), (fi, False)])
@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_every_element_is_where_the_layout_says(make, kv_first, order):
    caches = {f"model.layers.{i}.attn": make(order) for i in (1, 0, 10, 2)}  # names out of order
    layout, allocs, dev = describe_cuda_caches(caches, block_size=BS, num_heads=H, head_size=D)
    assert layout.order == order and layout.num_blocks == B and len(layout.regions) == 8 and dev == 0
    names = sorted(caches, key=lambda n: int(n.split(".")[2]))
    e = 2
    for li, name in enumerate(names):
        t = caches[name]
        for kv in range(2):
            reg = layout.regions[2 * li + kv]
            for b, tok, h in [(0, 0, 0), (5, 3, 1), (2, 1, 0)]:
                idx = (kv, b, tok, h, 3) if kv_first else (b, kv, tok, h, 3)
                want = t.data_ptr() + sum(i * s for i, s in zip(idx, t.stride())) * e
                inner = (tok * H + h) if order == "NHD" else (h * BS + tok)
                got = reg.base + b * reg.block_stride + inner * layout.token_bytes + 3 * e
                assert got == want


def test_unknown_shapes_and_packings_are_refused():
    with pytest.raises(LayoutError, match="neither"):
        describe_cuda_caches({"l.0": torch.zeros(3, B, BS, H, D)}, block_size=BS, num_heads=H, head_size=D)
    odd = torch.zeros(2, B, BS, D, H).transpose(3, 4)  # head_size not innermost
    with pytest.raises(LayoutError, match="innermost"):
        describe_cuda_caches({"l.0": odd}, block_size=BS, num_heads=H, head_size=D)


def test_registrations_stay_under_the_limit_and_never_mix_in_a_descriptor():
    layout = contiguous_layout(1 << 20, num_layers=4, num_heads=1, head_dim=64, block_size=16, num_blocks=64)
    span = 4 * 2 * 64 * 16 * 64 * 2
    small, regs = sliced_registrations(layout, [(1 << 20, span)], 0, limit=1 << 30)
    assert len(regs) == 1 and {r.mem_id for r in small.regions} == {0}
    big, regs = sliced_registrations(layout, [(1 << 20, span)], 0, limit=span // 4)
    assert len(regs) == len(layout.regions) and len({r.mem_id for r in big.regions}) == len(layout.regions)
    assert all(int(n) <= span // 4 for n in regs[:, 1])
    with pytest.raises(LayoutError, match="limit"):
        sliced_registrations(layout, [(1 << 20, span)], 0, limit=1024)
