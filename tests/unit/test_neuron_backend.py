"""kvpush_neuron on CPU: the start-up rules (simulated runtime), the plugin layout read from shapes and
strides, block-id sentinels, and Neuron <-> CUDA-layout transfers
planned by the core and checked byte by byte with the independent reference in kvref."""

import os
import sys
import types
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvpush_common.testing.kvref import apply_plan, expected_after_copy, logical_view

from kvpush_common.protocol.layout import LayoutError, contiguous_layout
from kvpush_common.plan.planner import plan_transfer
from kvpush_common.protocol.topology import HeadRoute, routes
from kvpush_neuron.kv_cache import BlockIdError, NeuronKVCache, describe_neuron_caches, strip_block_sentinels
from kvpush_neuron.runtime import (NeuronRuntimeError, NeuronUnavailableError, RealNeuronRuntime,
                                   SimulatedNeuronRuntime, parse_core_list)
from kvpush_neuron.slab import NeuronSlab, plugin_kv_caches, ready_sim_runtime
from kvpush_neuron.startup import NeuronStartupError

L, B, H, BS, D = 3, 6, 2, 32, 8
GOOD = {"NEURON_RT_MAP_HBM": "1", "NEURON_VISIBLE_DEVICES": "0-3"}


def caches(runtime, num_layers=L):
    return plugin_kv_caches(runtime, num_layers=num_layers, num_heads=H, head_dim=D, num_blocks=B, block_size=BS)


def started(env=None):
    rt = SimulatedNeuronRuntime(dict(GOOD if env is None else env))
    rt.init()
    return rt


# ---- start-up rules -------------------------------------------------------------------------------

def test_the_documented_start_up_passes_every_check():
    rt = started()
    backend = NeuronKVCache(caches(rt), 0, runtime=rt, block_size=BS, num_heads=H, head_size=D)
    backend.bind_thread()
    backend.bind_thread()  # the same endpoint may bind again
    assert backend.layout().mem_type == rt.mem_type == "DRAM"  # simulation: NIXL UCX moves host memory
    assert RealNeuronRuntime.mem_type == "VRAM"
    assert backend.registration_regions().shape == (2 * L, 3)


def test_the_kv_fence_is_the_runtimes():
    """The backend's fence is the runtime's: a WRITE waits for whatever the runtime says is still running
    (both runtimes today report the plugin's KV complete at kv_ready; see the design doc)."""
    rt = started()
    backend = NeuronKVCache(caches(rt), 0, runtime=rt, block_size=BS, num_heads=H, head_size=D)
    pending = {"done": False}
    rt.fence = lambda: pending
    rt.fence_done = lambda token: token["done"]
    token = backend.mark_kv_written()
    assert token is pending and not backend.kv_written(token)
    pending["done"] = True
    assert backend.kv_written(token)


def test_hbm_not_mapped_gives_address_zero_and_is_refused():
    rt = started({"NEURON_VISIBLE_DEVICES": "0"})
    kv = caches(rt)
    assert all(rt.data_ptr(t) == 0 for t in kv.values())
    with pytest.raises(NeuronStartupError, match=r"NEURON_RT_MAP_HBM is not set.*set NEURON_RT_MAP_HBM=1"):
        NeuronKVCache(kv, 0, runtime=rt, block_size=BS)


def test_map_hbm_set_after_the_first_allocation_is_too_late():
    rt = started({})
    rt.allocate(64)
    rt.env["NEURON_RT_MAP_HBM"] = "true"
    with pytest.raises(NeuronStartupError, match="was not at the first device allocation"):
        NeuronKVCache(caches(rt), 0, runtime=rt, block_size=BS)


def test_allocation_and_backend_need_an_initialised_runtime():
    rt = SimulatedNeuronRuntime(dict(GOOD))
    with pytest.raises(NeuronRuntimeError, match="before the Neuron runtime was initialised"):
        rt.allocate(64)
    kv = caches(started())
    with pytest.raises(NeuronStartupError, match=r"not initialised.*before creating the NIXL agent"):
        NeuronKVCache(kv, 0, runtime=rt, block_size=BS)


class _Agent:
    """Stands for the NIXL agent the hook is given (it only keeps a weak reference)."""


@pytest.fixture
def fresh_process_fabric(monkeypatch):
    """libfabric's start is process-wide: each test starts from a process that has not started it."""
    from kvpush_common.transport import fabric_start

    monkeypatch.setattr(fabric_start, "_first_at", None)
    monkeypatch.setattr(fabric_start, "_ours", fabric_start.weakref.WeakSet())
    return fabric_start


def test_libfabric_started_before_runtime_init_is_refused_not_silently_host_memory(fresh_process_fabric):
    rt = SimulatedNeuronRuntime(dict(GOOD))
    fresh_process_fabric.note_libfabric_backend(_Agent())  # what NixlTransport calls before a LIBFABRIC backend
    rt.init()
    assert rt.device_memory_kind() == "SYSTEM"  # what libfabric would do without a word
    with pytest.raises(NeuronStartupError, match="FI_HMEM_SYSTEM"):
        NeuronKVCache(caches(rt), 0, runtime=rt, block_size=BS)


def test_libfabric_started_after_runtime_init_is_fine_and_ucx_never_counts(fresh_process_fabric):
    from kvpush_common.transport.nixl import NixlTransport, TransportConfig

    ucx = NixlTransport("before-init", TransportConfig(backend="UCX"))  # UCX does not start libfabric
    rt = started()
    assert fresh_process_fabric.libfabric_started_at() is None
    backend = NeuronKVCache(caches(rt), 0, runtime=rt, block_size=BS)
    fresh_process_fabric.note_libfabric_backend(_Agent())  # the connector's own agent, after init
    assert rt.device_memory_kind() == "NEURON"
    backend.bind_thread()
    del ucx


def test_one_agent_per_rank():
    rt = started()
    first = NeuronKVCache(caches(rt), 0, runtime=rt, block_size=BS)
    second = NeuronKVCache(caches(rt), 0, runtime=rt, block_size=BS)
    first.bind_thread()
    with pytest.raises(NeuronRuntimeError, match="one agent per rank"):
        second.bind_thread()


def test_neuron_rt_visible_cores_is_refused_with_the_new_plugin():
    rt = SimulatedNeuronRuntime({"NEURON_RT_MAP_HBM": "1", "NEURON_RT_VISIBLE_CORES": "0-3"})
    with pytest.raises(NeuronRuntimeError, match="use NEURON_VISIBLE_DEVICES"):
        rt.init()
    rt = started()
    kv = caches(rt)
    del rt.env["NEURON_VISIBLE_DEVICES"]
    rt.env["NEURON_RT_VISIBLE_CORES"] = "0-3"
    with pytest.raises(NeuronStartupError, match="NEURON_VISIBLE_DEVICES"):
        NeuronKVCache(kv, 0, runtime=rt, block_size=BS)
    rt.env["NEURON_VISIBLE_DEVICES"] = "0-3"  # the plugin's worker pins its one core next to it: fine
    rt.env["NEURON_RT_VISIBLE_CORES"] = "2"
    NeuronKVCache(kv, 0, runtime=rt, block_size=BS)
    assert started().visible_devices() == [0, 1, 2, 3] and parse_core_list("0,4-5") == [0, 4, 5]


def test_real_runtime_is_not_available_here_and_says_so():
    with pytest.raises(NeuronUnavailableError, match=r"no `neuron` device.*trn2/trn3 host.*libtorch-neuronx-lite"):
        RealNeuronRuntime()


# torch's `neuron` device registered the way libtorch_neuronx_lite (or the native torch_neuronx) registers it
# (PyTorch's PrivateUse1 backend renamed; irreversible, hence a child process), torch_neuronx unimportable
_NEURON_DEVICE = """
import sys, torch
sys.modules["torch_neuronx"] = None
{register}
from kvpush_neuron.runtime import NeuronRuntimeError, RealNeuronRuntime
rt = RealNeuronRuntime({{}})

class KV:  # a `neuron` tensor as the plugin's worker allocates it (no Neuron backend on this host)
    device = torch.device("neuron", 3)
    def data_ptr(self):
        return 0x7F0000001000

rt.adopt(KV())
assert rt.is_initialized() and rt.data_ptr(KV()) == 0x7F0000001000 and rt.device_index(KV()) == 3
try:
    rt.data_ptr(torch.zeros(4))
    raise SystemExit("a CPU tensor was accepted")
except NeuronRuntimeError as e:
    assert "not a Neuron device" in str(e)
print("provider", rt.provider)
"""


@pytest.mark.parametrize("register,provider", [
    ("torch.utils.rename_privateuse1_backend('neuron')", "already"),  # inside the plugin's worker
    ("", "libtorch_neuronx_lite"),  # the lite package is importable but not imported yet
])
def test_real_runtime_runs_on_the_neuron_device_without_torch_neuronx(tmp_path, register, provider):
    """The plugin's stack (vllm-neuron 0.24/0.29: torch + libtorch-neuronx-lite) ships no torch_neuronx."""
    import subprocess

    lite = tmp_path / "libtorch_neuronx_lite"
    lite.mkdir()
    (lite / "__init__.py").write_text("import torch\ntorch.utils.rename_privateuse1_backend('neuron')\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-c", _NEURON_DEVICE.format(register=register)], capture_output=True,
                         text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip().endswith(f"provider {provider}")


def test_connector_refuses_without_a_neuron_host():
    from kvpush_neuron.connector import KVPushNeuronConnector

    with pytest.raises(RuntimeError, match="not available"):
        KVPushNeuronConnector.make_backend(object.__new__(KVPushNeuronConnector), {}, 0)


def test_an_xla_torch_neuronx_is_not_the_neuron_device(monkeypatch):
    """torch-neuronx 2.9 (PyTorch/XLA) imports but registers no `neuron` device: refused, naming why."""
    monkeypatch.setitem(sys.modules, "torch_neuronx", types.ModuleType("torch_neuronx"))
    with pytest.raises(NeuronUnavailableError, match="torch_neuronx: imported, but torch has no `neuron` device"):
        RealNeuronRuntime({})


# ---- layout of the plugin's tensors --------------------------------------------------------------

def element_address(t, idx):
    return t.data_ptr() + sum(i * s for i, s in zip(idx, t.stride())) * t.element_size()


@pytest.mark.parametrize("pair", [False, True])
def test_every_element_is_where_the_layout_says(pair):
    rt = started()
    kv = caches(rt, num_layers=11)
    kv = {name: (t[0], t[1]) if pair else t for name, t in reversed(kv.items())}  # names out of order
    layout, regs, dev = describe_neuron_caches(kv, rt, block_size=BS, num_heads=H, head_size=D)
    assert (layout.order, layout.block_size, layout.num_blocks, len(layout.regions), dev) == ("HND", BS, B, 22, 0)
    assert len(regs) == 22 and [r.mem_id for r in layout.regions] == list(range(22))  # K and V registered apart
    names = sorted(kv, key=lambda n: int(n.split(".")[1]))
    e = 2
    for li, name in enumerate(names):
        for kvp in range(2):
            t = kv[name][kvp] if pair else kv[name]
            reg = layout.regions[2 * li + kvp]
            lo, hi = layout.region_span(2 * li + kvp)
            assert (lo, hi - lo) == tuple(int(x) for x in regs[2 * li + kvp][:2])
            for b, h, tok, d in [(0, 0, 0, 0), (5, 1, 31, 7), (2, 1, 3, 4), (4, 0, 17, 1)]:
                want = element_address(t, (b, h, tok, d)) if pair else element_address(t, (kvp, b, h, tok, d))
                got = reg.base + b * reg.block_stride + (h * BS + tok) * layout.token_bytes + d * e
                assert got == want


def test_slab_layout_is_the_contiguous_hnd_layout():
    slab = NeuronSlab(num_layers=2, num_heads=H, head_dim=D, num_blocks=B)
    want = contiguous_layout(slab.slab_base, num_layers=2, num_heads=H, head_dim=D, block_size=32, num_blocks=B,
                             order="HND", blocks_first=False)
    assert [(r.base, r.block_stride) for r in slab.layout().regions] == [(r.base, r.block_stride) for r in want.regions]
    data = np.arange(slab.read_bytes().size, dtype=np.uint64).astype(np.uint8)
    slab.write_bytes(data)
    slab.write_bytes(np.full(3, 7, np.uint8), offset=5)
    got = slab.read_bytes()
    assert (got[5:8] == 7).all() and (got[8:] == data[8:]).all()


def test_unknown_shapes_and_packings_are_refused():
    rt = started()
    t = caches(rt, 1)["layers.0.self_attn"]
    with pytest.raises(LayoutError, match="block_size"):
        describe_neuron_caches({"l.0": t}, rt, block_size=16)
    nhd = t.view(2, B, BS, H, D).transpose(2, 3)  # right shape, but blocks stored (block_size, heads)
    assert nhd.shape == t.shape
    with pytest.raises(LayoutError, match="not HND packed"):
        describe_neuron_caches({"l.0": nhd}, rt, block_size=BS)
    with pytest.raises(LayoutError, match=r"not \(2, num_blocks"):
        describe_neuron_caches({"l.0": t[0]}, rt, block_size=BS)
    with pytest.raises(NeuronRuntimeError, match="not allocated by this"):
        describe_neuron_caches({"l.0": torch.zeros(2, B, H, BS, D, dtype=torch.bfloat16)}, rt, block_size=BS)


# ---- block id sentinels ----------------------------------------------------------------------------

def test_sentinels_are_stripped_or_refused():
    assert strip_block_sentinels([3, 4, 9, -1, -1], 10) == [3, 4, 9]  # plugin padding
    assert strip_block_sentinels([3, 4, 0], 10) == [3, 4]  # vLLM null block as padding
    assert strip_block_sentinels([], 10) == [] and strip_block_sentinels([-1], 10) == []
    with pytest.raises(BlockIdError, match="null block"):
        strip_block_sentinels([0, 5, 6], 10)  # a skipped sliding-window block before real ones
    with pytest.raises(BlockIdError, match="null block"):
        strip_block_sentinels([5, -1, 6], 10)
    with pytest.raises(BlockIdError, match=r"out of range: must be in \[1, 10\)"):
        strip_block_sentinels([5, 10], 10)
    rt = started()
    assert NeuronKVCache(caches(rt), 0, runtime=rt, block_size=BS).block_ids(np.array([1, 5, -1])) == [1, 5]


# ---- Neuron layout <-> CUDA FlashAttention NHD layout through the core planner ---------------------

def cuda_fa_nhd(num_layers, num_heads, num_blocks, block_size=16):
    """vLLM's FlashAttention caches (2, blocks, block_size, heads, head_size) as kvpush_cuda reads them,
    on CPU tensors sharing one buffer."""
    from kvpush_cuda.kv_cache import describe_cuda_caches

    buf = torch.zeros(num_layers * 2 * num_blocks * block_size * num_heads * D * 2, dtype=torch.uint8)
    t = buf.view(torch.bfloat16).view(num_layers, 2, num_blocks, block_size, num_heads, D)
    layout, _, _ = describe_cuda_caches({f"model.layers.{i}.attn": t[i] for i in range(num_layers)},
                                        block_size=block_size, num_heads=num_heads, head_size=D)
    assert layout.order == "NHD" and layout.block_size == 16
    return layout, buf


def check_copy(src, src_buf, src_base, dst, dst_buf, dst_base, route, src_blocks, dst_blocks, n, first=0):
    plan = plan_transfer(src, dst, route, src_blocks, dst_blocks, num_tokens=n, dst_first_token=first)
    want = expected_after_copy(src_buf, src_base, src, dst_buf, dst_base, dst, route, src_blocks, dst_blocks, n,
                               first)
    apply_plan(plan, src_buf, src_base, dst_buf, dst_base)
    assert np.array_equal(dst_buf, want)
    sv = logical_view(src_buf, src, src_base, src_blocks, n)[:, first:, route.src_head_start:][:, :, :route.num_heads]
    dv = logical_view(dst_buf, dst, dst_base, dst_blocks, n - first)[:, :, route.dst_head_start:][:, :, :route.num_heads]
    assert np.array_equal(sv, dv)
    return plan


@pytest.mark.parametrize("n,first", [(70, 0), (96, 32), (1, 0)])
def test_neuron_prefill_to_cuda_layout_decode(n, first):
    rng = np.random.default_rng(n)
    neuron = NeuronSlab(num_layers=2, num_heads=2, head_dim=D, num_blocks=8, runtime=ready_sim_runtime())
    neuron.write_bytes(rng.integers(0, 255, neuron.read_bytes().size, dtype=np.uint8))
    cuda, cbuf = cuda_fa_nhd(2, 2, 16)
    dst_buf = np.full(cbuf.numel(), 0xFF, dtype=np.uint8)
    p_blocks = [7, 2, 5, 0][: -(-n // 32)]
    d_blocks = [11, 3, 14, 0, 9, 1, 6][first // 16: -(-n // 16)]
    check_copy(neuron.layout(), neuron.read_bytes(), neuron.slab_base, cuda, dst_buf, cbuf.data_ptr(),
               HeadRoute(0, 0, 0, 0, 2), p_blocks, d_blocks, n, first)


@pytest.mark.parametrize("src_tp,dst_tp", [(1, 1), (2, 1), (1, 2)])
def test_cuda_layout_prefill_to_neuron_decode(src_tp, dst_tp):
    rng = np.random.default_rng(src_tp * 10 + dst_tp)
    total, n = 4, 100
    srcs = []
    for _ in range(src_tp):
        layout, buf = cuda_fa_nhd(2, total // src_tp, 16)
        buf.copy_(torch.from_numpy(rng.integers(0, 255, buf.numel(), dtype=np.uint8)))
        srcs.append((layout, buf.numpy(), buf.data_ptr()))
    dsts = [NeuronSlab(num_layers=2, num_heads=total // dst_tp, head_dim=D, num_blocks=8, runtime=ready_sim_runtime())
            for _ in range(dst_tp)]
    bufs = [np.full(d.read_bytes().size, 0xFF, dtype=np.uint8) for d in dsts]
    for route in routes(total, src_tp, dst_tp):
        layout, sbuf, sbase = srcs[route.src_rank]
        d = dsts[route.dst_rank]
        check_copy(layout, sbuf, sbase, d.layout(), bufs[route.dst_rank], d.slab_base, route,
                   [15, 0, 4, 9, 2, 13, 8], [6, 1, 3, 7], n)
    src_all = np.concatenate([logical_view(b, lay, base, [15, 0, 4, 9, 2, 13, 8], n) for lay, b, base in srcs], 2)
    dst_all = np.concatenate([logical_view(b, d.layout(), d.slab_base, [6, 1, 3, 7], n)
                              for d, b in zip(dsts, bufs)], 2)
    assert np.array_equal(src_all, dst_all)  # every head of every token arrived, whatever the TP split


def test_simulated_plugin_mirrors_vllm_cpu_blocks_into_the_plugin_planes_and_back():
    """vLLM's CPU cache keeps, per block and head, the K rows then the V rows ([blocks, heads, 32, 2*dim]
    read as [blocks, heads, 2, 32, dim]); the plugin's tensor is [2, blocks, heads, 32, dim].  A step's writes
    (its slot mapping) reach the plugin tensors on the simulated device's queue, asynchronously, and are all there
    when the forward ends (wait_for_save): the moment kv_fence="output" relies on."""
    import threading

    from kvpush_neuron.testing.simulated_plugin import SimulatedNeuronPluginConnector, _runtime, plugin_register_view

    engine = {f"model.layers.{i}.self_attn.attn": torch.randn(B, H, BS, 2 * D).to(torch.bfloat16) for i in range(L)}
    conn = object.__new__(SimulatedNeuronPluginConnector)
    conn._engine_kv = engine
    conn._plugin_kv = plugin_register_view(_runtime(), None, engine)
    gate = threading.Event()
    _runtime().issue(lambda: gate.wait(30))  # the device is busy: what is issued next waits behind it
    # slots of blocks 4 and 1 and of vLLM's null block 0 (a sliding window's dropped block: never copied), padding
    written = SimpleNamespace(slot_mapping=torch.tensor([4 * BS, 4 * BS + 31, BS + 5, 3, -1]))
    for name in engine:
        conn.save_kv_layer(name, None, written)
    assert not any(p.any() for p in conn._plugin_kv.values())  # issued, not done: asynchronous
    assert not _runtime().fence_done(_runtime().fence())
    gate.set()
    conn.wait_for_save()
    assert _runtime().fence_done(_runtime().fence())
    for name, plugin in conn._plugin_kv.items():
        kv = engine[name].view(B, H, 2, BS, D)
        for b in (4, 1):
            assert torch.equal(plugin[0, b], kv[b, :, 0]) and torch.equal(plugin[1, b], kv[b, :, 1])
        assert not plugin[:, [0, 2, 3, 5]].any()  # only the blocks written
    before = {n: t.clone() for n, t in engine.items()}
    for t in engine.values():
        t.zero_()
    conn._from_plugin((0, 1))
    for name, t in engine.items():
        assert torch.equal(t[1], before[name][1]) and not t[[0, 2, 3, 4, 5]].any()
    with pytest.raises(RuntimeError, match="slot mapping"):
        conn.save_kv_layer(next(iter(engine)), None, SimpleNamespace())


def test_the_simulated_device_queue_runs_in_order_behind_its_fence():
    import threading

    rt = ready_sim_runtime()
    assert rt.fence() is None and rt.fence_done(None)
    gate, ran = threading.Event(), []
    rt.issue(lambda: (gate.wait(30), ran.append(1)))
    token = rt.issue(lambda: ran.append(2))
    assert rt.fence() is token and not rt.fence_done(token) and ran == []
    gate.set()
    rt.sync()
    assert rt.fence_done(token) and ran == [1, 2]


def test_a_peer_of_another_kv_geometry_is_refused_naming_the_fields():
    from kvpush_common.protocol.layout import geometry_difference
    from kvpush_common.vllm.host_cache import describe_cpu_caches

    cpu = describe_cpu_caches({f"l.{i}": torch.zeros(B, H, BS, 2 * D, dtype=torch.bfloat16) for i in range(L)}, 0)[0]
    rt = ready_sim_runtime()
    plugin = NeuronKVCache(plugin_kv_caches(rt, num_layers=L, num_heads=H, head_dim=D, num_blocks=B, block_size=BS), 0,
                           runtime=rt, block_size=BS, num_heads=H, head_size=D).layout()
    assert geometry_difference(cpu, plugin) == f"head_dim {2 * D} vs {D}, kv_planes 1 vs 2, token_rows False vs True"
    assert geometry_difference(plugin, plugin) is None

