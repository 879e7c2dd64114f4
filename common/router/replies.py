"""Typed views of untrusted JSON (client bodies, upstream answers) and of the first bytes of a stream.

The router never re-encodes what it relays: these views read the few fields it acts on and ignore the rest.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import msgspec

from kvpush_common.protocol.legs import ProducerIdentity, RecvReport

FIRST_EVENT_MAX_BYTES = 64 << 10  # a stream is looked at up to its first token event (or error) before relaying
ERROR_ANSWER_MAX_BYTES = 64 << 10  # what is kept of a streamed error answer, to pass it on as it came


class IdentityParams(msgspec.Struct):
    kvpush_identity: ProducerIdentity


class RecvParams(msgspec.Struct):
    kvpush_recv: RecvReport | None = None  # absent: the instance does not report receives (not kvpush, older)


class UpstreamReply(msgspec.Struct):
    """The part of a vLLM completion answer the router reads; everything else is ignored."""

    kv_transfer_params: dict[str, Any] | None = None


class _Model(msgspec.Struct):
    id: str


class ModelList(msgspec.Struct):
    data: list[_Model]


class ClientFields(msgspec.Struct):
    """The fields of a client body the router acts on; the body itself passes through untouched."""

    stream: bool | None = False


class _StreamChoice(msgspec.Struct):
    delta: dict[str, Any] | None = None
    finish_reason: str | None = None


class StreamEvent(msgspec.Struct):
    """The parts of one streamed event that tell a chat stream's role preamble and an error apart."""

    error: dict[str, Any] | None = None
    choices: list[_StreamChoice] = []

    @property
    def preamble(self) -> bool:
        """vLLM's chat stream opens with a role-only delta per choice, sent before it looks at the output
        (an error comes after it); a completion stream has none."""
        return (self.error is None and bool(self.choices)
                and all(c.finish_reason is None and c.delta is not None and set(c.delta) <= {"role", "content"}
                        and not c.delta.get("content") for c in self.choices))


def openai_error(message: str, status: int, kind: str = "upstream_error") -> dict:
    return {"error": {"message": message, "type": kind, "code": status}}


def _events(data: bytes) -> list[bytes]:
    """The complete SSE `data:` payloads in `data` (an unfinished last event is left out)."""
    out = []
    for event in data.split(b"\n\n")[:-1]:
        for line in event.splitlines():
            if line.startswith(b"data:"):
                out.append(line[5:].strip())
    return out


def _parse_event(payload: bytes) -> StreamEvent | None:
    try:
        return msgspec.json.decode(payload, type=StreamEvent)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None  # [DONE], or not what vLLM streams: nothing to tell


async def first_event(resp: aiohttp.ClientResponse, data: bytes) -> bytes:
    """A stream's bytes up to its first event that is not a chat role preamble (or FIRST_EVENT_MAX_BYTES):
    an error there means nothing was served, and the client has seen nothing yet."""
    while data and len(data) < FIRST_EVENT_MAX_BYTES:
        parsed = [_parse_event(p) for p in _events(data)]
        if any(e is None or not e.preamble for e in parsed):
            return data
        more = await resp.content.readany()
        if not more:
            return data
        data += more
    return data


def failed_start(data: bytes) -> str | None:
    """How a stream's first bytes say nothing was served: "error_event" (an error before any output, after any
    chat role preamble), "empty_stream" (it ended -- [DONE], or no bytes at all -- before any output: vLLM before
    0.30 streams a completion that failed before its first token this way, a failed KV load included, since its
    check for finish_reason "error" comes after it skips empty chunks), or None (output, or not yet known)."""
    for payload in _events(data):
        if payload == b"[DONE]":
            return "empty_stream"
        event = _parse_event(payload)
        if event is None or not event.preamble:
            return "error_event" if event is not None and event.error is not None else None
    return None if data else "empty_stream"


async def rest_of(resp: aiohttp.ClientResponse, data: bytes) -> bytes:
    """The rest of a short error answer (vLLM sends [DONE] after its error event), bounded in size and time."""
    try:
        while len(data) < ERROR_ANSWER_MAX_BYTES:
            more = await asyncio.wait_for(resp.content.readany(), 1.0)
            if not more:
                break
            data += more
    except (aiohttp.ClientError, asyncio.TimeoutError):
        pass
    finally:
        resp.close()
    return data
