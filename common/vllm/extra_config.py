"""The keys kvpush reads from `kv_transfer_config.kv_connector_extra_config`, as typed structs parsed once.

`ExtraConfig` holds the user settings (README's table); `Tuning` (the `tuning` key) holds internal poll periods
and timer slack kept for tests and benchmarks, with defaults in `EndpointConfig`: users leave it out.  A key kvpush
does not know is refused with the list of those it does, so that a typo does not silently run with a default; a
key kvpush no longer reads is refused naming it as removed, with why (`endpoint.config.REMOVED_SETTINGS`).  vLLM's own NIXL connectors' keys are accepted as well, so that a config written for them starts
kvpush unchanged: `backends` names the NIXL backend (kvpush uses one), the others are logged as not used.
"""

from __future__ import annotations

import logging
from typing import Annotated, Literal

import msgspec

from kvpush_common.endpoint.config import removed_setting_error

log = logging.getLogger("kvpush")

Seconds = Annotated[float, msgspec.Meta(gt=0)]
Count = Annotated[int, msgspec.Meta(ge=0)]
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
ParamValue = str | int | float | bool

# kv_connector_extra_config keys of vLLM's NixlConnector / NixlPushConnector (vllm/distributed/kv_transfer/
# kv_connector/v1/nixl/*.py, get_from_extra_config, vLLM 0.32) that kvpush has no use for, with why
NIXL_CONNECTOR_KEYS = {
    "bidirectional_kv_xfer": "kvpush moves KV from prefill to decode only",
    "decoder_kv_blocks_ttl": "kvpush's registrations end with reg_ttl_s",
    "enforce_handshake_compat": "kvpush always checks the model, layout and version at its handshake",
    "engine_ttl": "kvpush forgets a silent peer on its own schedule",
    "kv_lease_duration": "kvpush's prefill leases end with lease_s",
    "kv_recompute_threshold": "see local_prefill_max_tokens",
    "num_threads": "set backend_params.num_threads",
    "push_registration_timeout": "kvpush's registrations end with reg_ttl_s",
}


class Tuning(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Internal: worker poll periods and timer slack (None: defaults)."""

    poll_s: Seconds | None = None
    idle_poll_s: Seconds | None = None
    wire_poll_s: Seconds | None = None
    write_poll_s: Seconds | None = None
    timer_slack_s: Annotated[float, msgspec.Meta(ge=0, le=0.01)] | None = None

    def endpoint_fields(self) -> dict:
        """The EndpointConfig fields this sets."""
        names = ("poll_s", "idle_poll_s", "wire_poll_s", "write_poll_s", "timer_slack_s")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}


class ExtraConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """User settings; None: the default README names (often from the environment or vLLM's config)."""

    mode: Literal["push", "pull"] = "push"
    host: str | None = None
    port: Port | None = None
    secret: str | None = None
    allow_unauthenticated: bool = False
    backend: str | None = None
    backend_params: dict[str, ParamValue] = {}
    model_id: str | None = None
    metrics_port: Port = 0
    local_prefill_max_tokens: Count = 256
    kv_fence: Literal["output", "event"] = "output"
    cross_layer_blocks: bool | None = None
    same_host: bool = True  # Neuron: P and D on one host (NIXL's intra-node path)
    lease_s: Seconds | None = None
    reg_ttl_s: Seconds | None = None
    heartbeat_s: Seconds | None = None
    write_timeout_s: Seconds | None = None
    transfer_timeout_s: Seconds | None = None
    handshake_timeout_s: Seconds | None = None
    tuning: Tuning = Tuning()

    def endpoint_fields(self) -> dict:
        """The EndpointConfig fields this sets (timeouts, tuning)."""
        names = ("lease_s", "reg_ttl_s", "heartbeat_s", "write_timeout_s", "transfer_timeout_s",
                 "handshake_timeout_s")
        return {**{n: getattr(self, n) for n in names if getattr(self, n) is not None}, **self.tuning.endpoint_fields()}


KNOWN_KEYS = tuple(ExtraConfig.__struct_fields__)


def parse_extra_config(extra) -> ExtraConfig:
    """`extra` (a mapping, from JSON) as ExtraConfig; a ValueError naming the key for anything kvpush cannot use.
    Numbers and flags given as strings ("0.5", "true") are read as such, as vLLM's CLI may pass them."""
    raw = dict(extra or {})
    for key in [k for k in raw if k in NIXL_CONNECTOR_KEYS]:
        log.warning("kvpush: kv_connector_extra_config.%s (a vLLM NIXL connector setting) is not used: %s",
                    key, NIXL_CONNECTOR_KEYS[key])
        del raw[key]
    if "backends" in raw:
        raw = nixl_backends(raw)
    tuning = raw.get("tuning")
    for where, keys in (("", raw), ("tuning.", tuning if isinstance(tuning, dict) else {})):
        err = removed_setting_error(keys, f"kv_connector_extra_config.{where}")
        if err is not None:
            raise err
    unknown = sorted(str(k) for k in raw if k not in KNOWN_KEYS)
    internal = [k for k in unknown if k in Tuning.__struct_fields__]
    if internal:
        raise ValueError(f"kv_connector_extra_config: {', '.join(internal)} go(es) under `tuning` (internal)")
    if unknown:
        raise ValueError(f"kv_connector_extra_config: unknown key(s) {', '.join(unknown)}; kvpush reads "
                         f"{', '.join(KNOWN_KEYS)}")
    try:
        return msgspec.convert(raw, ExtraConfig, strict=False)
    except msgspec.ValidationError as e:
        raise ValueError(f"kv_connector_extra_config.{plain(e)}") from None


def nixl_backends(raw: dict) -> dict:
    """NixlConnector's `backends` (a list; kvpush uses one backend) as kvpush's `backend`."""
    backends = raw.pop("backends")
    if isinstance(backends, str):
        backends = [backends]
    if not isinstance(backends, (list, tuple)) or not backends or not all(isinstance(b, str) for b in backends):
        raise ValueError(f"kv_connector_extra_config.backends must be a list of NIXL backend names, got {backends!r}")
    if "backend" in raw and str(raw["backend"]).upper() != backends[0].upper():
        raise ValueError(f"kv_connector_extra_config: backend {raw['backend']!r} and backends {backends!r} disagree")
    if len(backends) > 1:
        log.warning("kvpush: kv_connector_extra_config.backends %s: kvpush uses one NIXL backend, %s",
                    backends, backends[0])
    return {**raw, "backend": backends[0]}


def plain(e: msgspec.ValidationError) -> str:
    """msgspec's "Expected `int`, got `str` - at `$.tuning.poll_s`" as "tuning.poll_s: expected `int`, got `str`"."""
    text, _, where = str(e).rpartition(" - at `$.")
    if not text:
        return str(e)
    return f"{where.rstrip('`')}: {text[:1].lower()}{text[1:]}"
