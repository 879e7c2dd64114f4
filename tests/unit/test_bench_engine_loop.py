"""The engine-loop benchmark's checks that need no transfer: argument refusals and the byte patterns of its
slabs.  Its CPU sweeps over real NIXL are tests/nixl/test_bench_engine_loop_sweeps.py."""

import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def test_vllm_style_pull_refuses_several_ranks(tmp_path):
    run = subprocess.run([sys.executable, "-m", "scripts.bench.handoff.engine_loop", "--cpu", "--modes",
                          "push,vllm-pull", "--p-tp", "2", "--out", str(tmp_path / "x.json")],
                         timeout=60, capture_output=True, text=True, cwd=ROOT)
    assert run.returncode != 0 and "vllm-pull" in run.stderr and not (tmp_path / "x.json").exists()


def test_slab_patterns_are_per_model_wide_head_in_the_layouts_own_byte_order():
    """The benchmark's byte check catches a head delivered to the wrong rank or offset: each head of a
    block holds pattern(seq, model-wide head), read back here through the independent layout reference."""
    import torch

    from scripts.bench.handoff import kvslab

    KVSlab, count_wrong_heads, fill_heads, pattern = kvslab.KVSlab, kvslab.count_wrong_heads, kvslab.fill_heads, kvslab.pattern
    from kvpush_common.testing.kvref import logical_view

    geo = dict(num_layers=2, num_heads=3, head_dim=4, dtype="bfloat16", dtype_size=2)
    slab = KVSlab(block_size=4, num_blocks=6, device=None, geometry=geo, head_offset=5)
    slab.fill([4, 1], seq=9)
    be = slab.backend
    view = logical_view(be.read_bytes(), be.layout(), be.slab_base, [4, 1], 8)  # (regions, tokens, heads, bytes)
    for h in range(3):
        assert (view[:, :, h, :] == pattern(9, 5 + h)).all()
    assert len({pattern(9, 5 + h) for h in range(3)} | {pattern(10, 5)}) == 4
    assert slab.count_wrong([4, 1], 9) == 0
    other = logical_view(be.read_bytes(), be.layout(), be.slab_base, [0, 2, 3, 5], 16)
    assert (other == 0).all()  # nothing outside the filled blocks
    # planes (2 layers x K/V) x blocks x heads x (block_size x head_dim x 2 bytes): every byte differs next request
    assert slab.count_wrong([4, 1], 10) == 4 * 2 * 3 * (4 * 4 * 2)
    # the torch path (used on GPUs) writes the same bytes as numpy, in place through the view
    t = torch.zeros(be.read_bytes().size, dtype=torch.uint8)
    heads = t.reshape(4, 6, 3, -1)
    fill_heads(heads, torch.as_tensor([4, 1]), [pattern(9, 5 + h) for h in range(3)])
    assert np.array_equal(t.numpy(), be.read_bytes())
    assert count_wrong_heads(heads, torch.as_tensor([4, 1]), [pattern(9, 5 + h) for h in range(3)]) == 0
