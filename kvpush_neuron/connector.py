"""vLLM-neuron entry class: `"kv_connector": "KVPushNeuronConnector",
"kv_connector_module_path": "kvpush_neuron.connector"`.

It is KVPushConnector with the Neuron device backend bound: the plugin's KV tensors in HBM registered
as VRAM through NIXL LIBFABRIC/EFA, after the EFA preflight and the Neuron start-up checks.  Without
torch's `neuron` device (no Neuron host) it refuses to start with a clear message.

What the plugin does not do is refused at start-up rather than silently not done (docs/neuron.md):
attention runs inside its compiled model and it calls no per-layer hook (`save_kv_layer`,
`wait_for_layer_load`), and its runtime gives kvpush no device event, so `kv_fence="event"` would fence nothing; more than one KV cache group, or a group of mixed
KV shapes, is refused naming the group (`kvpush_common.vllm.kv_groups`).

Block ids reach the core through `strip_block_sentinels` (BlockIdGuard): the connector gets vLLM's
ids as the scheduler gave them (the plugin turns the null block 0 into -1 only inside its attention
kernel's block table); trailing padding is dropped, a leading run of -1 (the tokens a sliding window
dropped on the prefill side: never read) is kept, and a request whose ids have a null block before
real ones, or an id out of range, moves no KV: its send is aborted (the decode side is told) and
reported finished so its blocks are freed; its receive is reported failed (vLLM then recomputes,
kv_load_failure_policy=recompute).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections import OrderedDict
from typing import Callable

from kvpush_common.device.backend import DeviceBackend
from kvpush_common.vllm.connector import KVPushConnector
from kvpush_common.vllm.kv_groups import window_block_missing
from kvpush_common.vllm.metadata import AbortOp, KVPushMetadata

from .kv_cache import DEFAULT_BLOCK_SIZE, NULL_BLOCK, PLUGIN_PAD, BlockIdError

log = logging.getLogger(__name__)


def _leading_nulls(block_ids) -> int:
    n = 0
    while n < len(block_ids) and int(block_ids[n]) in (NULL_BLOCK, PLUGIN_PAD):
        n += 1
    return n if n < len(block_ids) else 0  # all padding: nothing leads any real block


class BlockIdGuard:
    """Rewrites each step's metadata with sentinel-free block ids and settles the requests it refuses."""

    REMEMBER_FINISHED = 4096  # finished request ids kept while a refused send may still wait for one

    def __init__(self, strip: Callable[[object], list[int]], block_size: int = DEFAULT_BLOCK_SIZE):
        self._strip = strip
        self._block_size = block_size
        self._failed_recvs: set[str] = set()
        self._refused_sends: set[str] = set()
        self._finished: OrderedDict[str, None] = OrderedDict()

    def filter(self, meta: KVPushMetadata) -> KVPushMetadata:
        out = KVPushMetadata(aborts=list(meta.aborts), declines=list(meta.declines))
        for op in meta.recvs:
            try:
                # a sliding window's dropped blocks lead the list as vLLM's null block: no KV wanted there
                dropped = _leading_nulls(op.block_ids)
                out.recvs.append(dataclasses.replace(
                    op, block_ids=tuple(self._strip(op.block_ids[dropped:])),
                    first_token=min(op.num_tokens, op.first_token + dropped * self._block_size)))
            except BlockIdError as e:
                log.warning("kvpush: not receiving %s (%s/%d): %s", op.req_id, op.transfer_id, op.attempt, e)
                self._failed_recvs.add(op.req_id)
        for op in meta.sends:
            try:
                # the producer's dropped blocks become -1, which the planner refuses to read should the
                # consumer want those tokens after all
                dropped = _leading_nulls(op.block_ids)
                ids = (PLUGIN_PAD,) * dropped + tuple(op.block_ids[dropped:])
                out.sends.append(dataclasses.replace(op, block_ids=tuple(self._strip(ids))))
            except BlockIdError as e:
                log.warning("kvpush: not sending %s (%s/%d): %s", op.req_id, op.transfer_id, op.attempt, e)
                out.aborts.append(AbortOp(op.req_id, op.transfer_id, op.attempt, f"bad block ids on Neuron: {e}"))
                self._refused_sends.add(op.req_id)
        return out

    def settle(self, results, finished_req_ids: set[str]):
        """Add the refused requests to a KVConnectorTransferResults (mutated and returned).  A refused
        send is reported once vLLM has reported the request finished to this worker, as for any send."""
        if self._failed_recvs:
            results.finished_recving |= self._failed_recvs
            results.failed_recving |= self._failed_recvs
            self._failed_recvs = set()
        if self._refused_sends or self._finished:
            for r in finished_req_ids:
                self._finished[r] = None
            while len(self._finished) > self.REMEMBER_FINISHED:
                self._finished.popitem(last=False)
            ready = {r for r in self._refused_sends if r in self._finished}
            results.finished_sending |= ready
            self._refused_sends -= ready
            for r in ready:
                self._finished.pop(r, None)
            if not self._refused_sends:
                self._finished.clear()
        return results


def neuron_settings_problems(settings, kv_cache_config=None) -> list[str]:
    """The settings and KV cache groups the vLLM Neuron plugin cannot serve, each with its fix."""
    from kvpush_common.vllm.kv_groups import kv_group_problem

    problems = []
    if settings.kv_fence == "event":
        problems.append('kv_fence="event": the Neuron runtime gives kvpush no device event to record, so it would '
                        'fence nothing; keep the default kv_fence="output" (the sampled token of the step that '
                        "wrote the KV has been read by then)")
    group = kv_group_problem(kv_cache_config)
    if group:
        problems.append(group)
    return problems


class KVPushNeuronConnector(KVPushConnector):
    @staticmethod
    def runtime_factory():
        """The Neuron runtime of this worker (the tests substitute the simulated one)."""
        from .runtime import RealNeuronRuntime

        return RealNeuronRuntime()  # NeuronUnavailableError ("not available") without torch's `neuron` device

    def __init__(self, vllm_config, role, kv_cache_config=None):
        from kvpush_common.vllm.settings import ConnectorSettings

        problems = neuron_settings_problems(ConnectorSettings.from_vllm(vllm_config), kv_cache_config)
        if problems:  # before anything starts (the worker role's preflight, NIXL)
            raise ValueError("KVPushNeuronConnector cannot serve this configuration:\n  - " + "\n  - ".join(problems))
        super().__init__(vllm_config, role, kv_cache_config)
        self._guard: BlockIdGuard | None = None
        from kvpush_common.vllm.kv_groups import sliding_window_of

        self._window = sliding_window_of(kv_cache_config)  # the scheduler role always has the KVCacheConfig
        if self._window and self._sched is not None:
            self._sched.computes_here = functools.partial(window_block_missing, *self._window)

    def build_connector_meta(self, scheduler_output) -> KVPushMetadata:
        """A sliding-window group's decode asks only for the window's blocks.  vLLM hands the decode's blocks
        for the window only (its unhashed list leaves out the null blocks it pads the dropped ones with, while
        the receive says tokens [first_token, num_tokens)), and the prefill has freed the blocks that fell out
        of the window: the registration starts where the decode's list does, and no earlier than the window."""
        meta = super().build_connector_meta(scheduler_output)
        if getattr(self, "_window", None) and meta.recvs:
            from kvpush_common.vllm.kv_groups import window_first_token

            window, bs = self._window
            trimmed = []
            for op in meta.recvs:
                tail_blk = -(-op.num_tokens // bs) - len(op.block_ids)  # the list holds the request's last blocks
                start = max(op.first_token, tail_blk * bs)
                first = window_first_token(op.num_tokens, start, window, bs)
                skip = (first - start) // bs
                trimmed.append(dataclasses.replace(op, block_ids=tuple(op.block_ids[skip:]), first_token=first)
                               if first != op.first_token else op)
            meta.recvs = trimmed
        return meta

    def choose_transport(self, extra: dict):
        """Always LIBFABRIC (Neuron HBM registers only there), after the trn2 EFA preflight."""
        import os

        from .efa import neuron_transport

        return neuron_transport(extra, os.environ, same_host=bool(extra.get("same_host", True)))

    def layout_facts(self, kv_caches: dict) -> dict:
        """Cache dtype (an FP8 one with this Trainium generation's range), K/V scales and drafter for the layout
        (`kv_cache.neuron_layout_facts`)."""
        import os

        from .kv_cache import neuron_layout_facts

        return neuron_layout_facts(self._vllm_config, list(kv_caches), os.environ)

    def make_backend(self, kv_caches: dict, head_offset: int) -> DeviceBackend:
        from .kv_cache import NeuronKVCache

        runtime = self.runtime_factory()
        adopt = getattr(runtime, "adopt", None)
        for cache in kv_caches.values():  # tensors on the device: the plugin's worker initialised the runtime
            if adopt is not None:
                adopt(cache[0] if isinstance(cache, (list, tuple)) else cache)
            break
        cfg = self._vllm_config
        backend = NeuronKVCache(kv_caches, head_offset, runtime=runtime, block_size=cfg.cache_config.block_size,
                                num_heads=self.local_kv_heads(), head_size=cfg.model_config.get_head_size(),
                                **self.layout_facts(kv_caches))
        self._guard = BlockIdGuard(backend.block_ids, backend.layout().block_size)
        return backend

    def start_load_kv(self, forward_context, **kwargs) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVPushMetadata)
        self._start_step(meta)

    def _start_step(self, meta: KVPushMetadata) -> None:
        """The step's block tables, sentinels stripped, to the core (only enqueues)."""
        if getattr(self, "_guard", None) is not None:
            meta = self._guard.filter(meta)
        self._worker.start_load_kv(meta)

    def get_transfer_results(self, finished_req_ids: set[str]):
        results = super().get_transfer_results(finished_req_ids)
        guard = getattr(self, "_guard", None)
        return guard.settle(results, finished_req_ids) if guard is not None else results
