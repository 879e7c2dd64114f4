"""kvpush settings of a vLLM instance, read once from `kv_transfer_config`."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

from kvpush_common.endpoint.config import EndpointConfig
from kvpush_common.transport.nixl import TransportConfig
from kvpush_common.protocol.legs import ProducerIdentity


@dataclass(frozen=True)
class ConnectorSettings:
    role: Literal["producer", "consumer"]
    mode: Literal["push", "pull"]
    engine_id: str
    model: str
    tp_size: int
    total_kv_heads: int
    host: str
    port: int  # side channel base port (producer): rank r serves on port + r
    secret: bytes | None
    backend: str
    backend_params: dict
    periods: dict  # EndpointConfig's timeouts, heartbeat and poll periods the config sets (seconds)
    ready_delay_s: float  # test knob: producer reports KV ready this much later (forces registration first)
    register_delay_s: float  # test knob: consumer registers this much later (forces KV ready first)
    metrics_port: int = 0  # >0: each TP rank serves its kvpush Prometheus metrics on metrics_port + rank
    staging: dict = field(default_factory=dict)  # staged-transfer settings (EndpointConfig.staging_*)
    # "output": vLLM finishes a prefill request only after the host has read the sampled token of the step
    # that wrote its last KV, and that token comes from the same stream (and, with TP, after the last layer's
    # all-reduce that every rank's KV writes precede): the KV is written when the worker hears of it.
    # "event": record a device event when the worker hears of it instead (it also waits for every step the
    # engine queued since, e.g. the next prefill under async scheduling).
    kv_fence: Literal["output", "event"] = "output"
    progress_thread: bool | None = None  # NIXL's progress thread (None: TransportConfig's choice per backend)
    # Consumer, push: when the local prefix cache leaves at most this many prompt tokens uncomputed, the decode
    # computes them itself and registers nothing (the producer is told and releases that KV once ready).
    # 0: always receive.  256 = 16 blocks of 16, 2 of 128: a turn's new tokens in a multi-turn chat.
    local_prefill_max_tokens: int = 256
    # Producer, push: WRITE each layer's KV while the prefill runs (EndpointConfig.stream_layers)
    stream_layers: bool = False
    stream_wake_every: int = 1  # EndpointConfig.stream_wake_every
    # The interpreter's GIL switch interval for this worker process (sys.setswitchinterval; None: leave
    # Python's 5 ms), process-wide.  An experiment on kvpush's worker waiting for a busy engine thread's GIL
    # after a hand-over: on the H200 (compiled) 1 ms and 0.2 ms changed neither that wake (~0.4 ms) nor any
    # end-to-end number (docs/benchmarks/h200-gil-wake.md); eager mode not tried.
    gil_switch_interval_s: float | None = None
    # Ask vLLM (>= 0.26 CUDA, model runner V1, FlashAttention / FlashInfer / Triton, one uniform attention group)
    # for its cross-layer KV cache: block b of every layer in one span, so a run of consecutive blocks is one NIXL
    # descriptor instead of one per layer.  On the H200 (real vLLM 0.26, Qwen3-8B shape, 16k prompts) a push's
    # WRITE took 3.4 ms instead of 44 ms on average (docs/benchmarks/h200-cross-layer.md).  None: on for
    # whole-request transfers over UCX; off with stream_layers (a layer's blocks are then one descriptor each)
    # and on LIBFABRIC (the one registration would pass EFA's 4 GiB cap).  vLLM ignores the wish where it cannot
    # grant it (0.26's default model runner V2 never does; VLLM_USE_V2_MODEL_RUNNER=0 selects V1).
    cross_layer_blocks: bool | None = None

    def wants_cross_layer_blocks(self) -> bool:
        if self.cross_layer_blocks is not None:
            return self.cross_layer_blocks
        return not self.stream_layers and self.backend == "UCX"

    @classmethod
    def from_vllm(cls, vllm_config) -> "ConnectorSettings":
        kt = vllm_config.kv_transfer_config
        extra = dict(kt.kv_connector_extra_config or {})
        if kt.kv_role == "kv_producer":
            role = "producer"
        elif kt.kv_role == "kv_consumer":
            role = "consumer"
        else:
            raise ValueError(f"KVPushConnector needs kv_role kv_producer or kv_consumer, got {kt.kv_role!r}")
        secret = extra.get("secret") or os.environ.get("KVPUSH_SECRET")
        periods = {k: float(extra[k]) for k in ("lease_s", "reg_ttl_s", "heartbeat_s", "write_timeout_s",
                                                 "transfer_timeout_s", "handshake_timeout_s",
                                                 "poll_s", "idle_poll_s", "wire_poll_s", "write_poll_s", "timer_slack_s")
                   if k in extra}
        model_config = vllm_config.model_config
        mode = str(extra.get("mode", "push"))
        if mode not in ("push", "pull"):
            raise ValueError(f"kv_connector_extra_config.mode must be push or pull, got {mode!r}")
        return cls(
            role=role,
            mode=mode,
            engine_id=str(kt.engine_id),
            # the compatibility hash names the model by what clients call it, so that a control run can
            # pair a prefill instance serving other weights under the same name
            model=str(extra.get("model_id") or model_config.served_model_name or model_config.model),
            tp_size=vllm_config.parallel_config.tensor_parallel_size,
            total_kv_heads=model_config.get_total_num_kv_heads(),
            host=str(extra.get("host", os.environ.get("KVPUSH_SIDE_CHANNEL_HOST", "127.0.0.1"))),
            port=int(extra.get("port", os.environ.get("KVPUSH_SIDE_CHANNEL_PORT", 5700))),
            secret=secret.encode() if isinstance(secret, str) else secret,
            backend=str(extra.get("backend", "UCX")),
            backend_params={k: str(v) for k, v in dict(extra.get("backend_params") or {}).items()},
            periods=periods,
            ready_delay_s=float(extra.get("debug_ready_delay_s", 0.0)),
            register_delay_s=float(extra.get("debug_register_delay_s", 0.0)),
            metrics_port=int(extra.get("metrics_port", 0)),
            kv_fence=_choice(extra, "kv_fence", ("output", "event")),
            progress_thread=_flag(extra, "progress_thread"),
            local_prefill_max_tokens=_non_negative(extra, "local_prefill_max_tokens", 256),
            stream_layers=bool(_flag(extra, "stream_layers")),
            stream_wake_every=_at_least_one(extra, "stream_wake_every"),
            gil_switch_interval_s=_switch_interval(extra, "gil_switch_interval_s"),
            cross_layer_blocks=_flag(extra, "cross_layer_blocks"),
            staging={k: int(extra[k]) for k in ("staging_bytes", "staging_chunk_bytes", "staging_min_descs",
                                                "staging_partitions") if k in extra},
        )

    def identity(self) -> ProducerIdentity:
        return ProducerIdentity(engine_id=self.engine_id, host=self.host, port=self.port, tp_size=self.tp_size)

    def endpoint_config(self, rank: int) -> EndpointConfig:
        return EndpointConfig(engine_id=self.engine_id, rank=rank, tp_size=self.tp_size,
                              total_kv_heads=self.total_kv_heads, model=self.model, mode=self.mode, host=self.host,
                              base_port=self.port, transport=TransportConfig(backend=self.backend, backend_params=dict(self.backend_params),
                                                        progress_thread=self.progress_thread),
                              secret=self.secret, stream_layers=self.stream_layers,
                              stream_wake_every=self.stream_wake_every, **self.periods, **self.staging)


def _choice(extra: dict, key: str, allowed: tuple[str, ...]) -> str:
    value = str(extra.get(key, allowed[0]))
    if value not in allowed:
        raise ValueError(f"kv_connector_extra_config.{key} must be one of {', '.join(allowed)}, got {value!r}")
    return value


def _non_negative(extra: dict, key: str, default: int) -> int:
    try:
        value = int(extra.get(key, default))
    except (TypeError, ValueError):
        value = -1
    if value < 0:
        raise ValueError(f"kv_connector_extra_config.{key} must be a whole number >= 0, got {extra.get(key)!r}")
    return value


def _at_least_one(extra: dict, key: str) -> int:
    value = _non_negative(extra, key, 1)
    if value < 1:
        raise ValueError(f"kv_connector_extra_config.{key} must be at least 1, got {value}")
    return value


def _switch_interval(extra: dict, key: str) -> float | None:
    """None when unset; else seconds in [10 us, 100 ms] (below, the engine thread would mostly hand the GIL
    around; above, longer than Python's own default by far)."""
    value = extra.get(key)
    if value is None:
        return None
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = -1.0
    if not 1e-5 <= seconds <= 0.1:
        raise ValueError(f"kv_connector_extra_config.{key} must be seconds between 1e-05 and 0.1, got {value!r}")
    return seconds


def _flag(extra: dict, key: str) -> bool | None:
    value = extra.get(key)
    if value is None or isinstance(value, bool):
        return value
    raise ValueError(f"kv_connector_extra_config.{key} must be true or false, got {value!r}")
