"""The vLLM Neuron plugin's KV forms that go beyond one buffer per layer, pushed end to end over real NIXL
(UCX here; LIBFABRIC in tests/libfabric) between producer and consumer processes on the simulated Neuron
runtime, every destination byte verified (tests/nixl/test_conformance.py style):

- layers sharing one buffer (a vLLM KVCacheTensor `shared_by` several layers: the plugin hands each of them
  the same tensor): registered and moved once, and every sharing layer reads the producer's bytes;
- a sliding-window request whose first blocks the window dropped (vLLM's null block leads the block lists on
  both sides; BlockIdGuard turns the producer's into -1 and starts the consumer's registration after them):
  the window's tokens arrive, and a consumer asking for a dropped block gets a clean failure, not the null
  block's bytes.
"""

from __future__ import annotations

import base64
import os

import numpy as np
import pytest

from kvpush_common.testing.procs import PeerProcess

NIXL_BACKEND = os.environ.get("KVPUSH_TEST_NIXL_BACKEND", "UCX")  # tests/libfabric sets LIBFABRIC
POISON = 0xAB
GEO = dict(num_layers=4, head_dim=8, dtype="bfloat16", dtype_size=2, num_heads=2, head_offset=0, block_size=32,
           num_blocks=16)


class Pair:
    def __init__(self, shared=None):
        self.p, self.d = PeerProcess("P"), PeerProcess("D")
        transport = {"transport": {"backend": NIXL_BACKEND}} if NIXL_BACKEND != "UCX" else {}
        backend = dict(kind="neuron-sim", **GEO, **({"shared": {str(k): v for k, v in shared.items()}} if shared else {}))
        reply = self.p.call("start", role="producer", backend=backend,
                            cfg=dict(engine_id="P", rank=0, tp_size=1, total_kv_heads=2, **transport))
        assert reply["nixl_backend"] == NIXL_BACKEND
        self.port = reply["port"]
        self.p.call("fill", seed=7)
        reply = self.d.call("start", role="consumer", backend=backend,
                            cfg=dict(engine_id="D", rank=0, tp_size=1, total_kv_heads=2, **transport))
        assert reply["nixl_backend"] == NIXL_BACKEND
        self.d.call("poison", byte=POISON)
        self.pushed = 0

    def push(self, tid, p_blocks, d_blocks, num_tokens, first_token=0):
        self.d.call("expect", tid=tid, attempt=0, blocks=d_blocks, num_tokens=num_tokens, first_token=first_token,
                    producer=dict(engine_id="P", host="127.0.0.1", port=self.port, tp_size=1))
        self.p.call("ready", tid=tid, attempt=0, blocks=p_blocks, num_tokens=num_tokens)
        self.pushed += 1
        results = self.d.call("wait", n=self.pushed, seconds=20, timeout=50)["results"]
        return next(r for r in results if r["tid"] == tid)

    def close(self):
        self.p.close()
        self.d.close()


def logical(proc, blocks, num_tokens) -> np.ndarray:
    r = proc.call("logical", blocks=blocks, num_tokens=num_tokens)
    return np.frombuffer(base64.b64decode(r["data"]), dtype=np.uint8).reshape(r["shape"])


@pytest.fixture
def pair(request):
    pr = Pair(**getattr(request, "param", {}))
    yield pr
    pr.close()


@pytest.mark.parametrize("pair", [{"shared": {3: 1}}], indirect=True)
def test_layers_sharing_a_buffer_are_moved_once_and_read_the_same_bytes(pair):
    """4 layers, layer 3 shares layer 1's buffer: 3 buffers' K and V planes registered and moved (as vLLM's NIXL
    connector de-duplicates base addresses), every byte of them equal to P's; layer 3's tensor is layer 1's."""
    p_blocks, d_blocks, n = [3, 4, 9], [12, 5, 1], 90
    assert pair.push("shared", p_blocks, d_blocks, n)["ok"] is True
    got, want = logical(pair.d, d_blocks, n), logical(pair.p, p_blocks, n)
    assert got.shape[0] == want.shape[0] == 2 * 3  # one K and one V region per buffer, not per layer
    np.testing.assert_array_equal(got, want)
    assert set(pair.d.call("dirty_blocks", poison=POISON)["blocks"]) == set(d_blocks)


def test_a_sliding_windows_dropped_blocks_never_move(pair):
    """Tokens 0-63 fell out of the window on both sides (vLLM's lists start with two null blocks): P holds
    (-1, -1, 7, 8) after BlockIdGuard, D registers (5, 6) from token 64.  Tokens 64-119 arrive byte for byte.
    A D that wants token 32 on (a block P dropped) gets a failed receive and nothing written."""
    n = 120
    assert pair.push("swa", [-1, -1, 7, 8], [5, 6], n, first_token=64)["ok"] is True
    np.testing.assert_array_equal(logical(pair.d, [5, 6], n - 64), logical(pair.p, [1, 1, 7, 8], n)[:, 64:])
    assert set(pair.d.call("dirty_blocks", poison=POISON)["blocks"]) == {5, 6}
    failed = pair.push("swa-too-early", [-1, -1, 9, 10], [11, 12, 13], n, first_token=32)
    assert failed["ok"] is False and "out of range" in failed["reason"], failed
    assert set(pair.d.call("dirty_blocks", poison=POISON)["blocks"]) == {5, 6}  # nothing of 11-13 written
