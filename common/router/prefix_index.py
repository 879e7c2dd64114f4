"""Where a prompt's prefix is probably cached: a bounded index per instance of the prefix hashes the router
sent there.

The router has no tokenizer, so a prompt is cut into fixed-size chunks of what it asks the engine to
prefill (text: `CHUNK_CHARS` characters; token-id prompts: `CHUNK_TOKENS` ids; chat: the messages in a
canonical JSON form) and each chunk's hash covers every chunk before it, as vLLM's block hashes do: two
prompts share the first k hashes exactly when they share the first k chunks.  Only whole chunks count
(vLLM caches whole blocks only).  An instance's index is a hint, not a mirror: vLLM evicts blocks it
never tells us about; a stale hit costs one tail-only registration, never a wrong answer.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any

import msgspec

CHUNK_CHARS = 256  # ~64 tokens of English or code
CHUNK_TOKENS = 64
CHARS_PER_TOKEN = CHUNK_CHARS // CHUNK_TOKENS  # how the router, without a tokenizer, estimates text in tokens
MAX_CHUNKS = 4096  # per prompt (1M characters): longer prompts are indexed by their first chunks
DEFAULT_CAPACITY = 1 << 17  # hashes per instance (8 bytes each: ~32 M characters of prefixes)


def _chain(pieces) -> list[bytes]:
    out, prev = [], b""
    for piece in pieces:
        prev = hashlib.blake2b(prev + piece, digest_size=8).digest()
        out.append(prev)
        if len(out) >= MAX_CHUNKS:
            break
    return out


def _text_chunks(text: str):
    data = text.encode("utf-8", "surrogatepass")
    size = CHUNK_CHARS
    return (data[i:i + size] for i in range(0, len(data) - size + 1, size))


def prompt_hashes(body: dict, chat: bool) -> list[bytes]:
    """The prefix hash chain of a completion or chat request (empty when there is no whole chunk)."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return []
        # each message as the same bytes whatever key order the client used; the template's own text is
        # the same for every request, so it shifts nothing between requests
        canon = _chat_bytes(messages)
        return _chain(canon[i:i + CHUNK_CHARS] for i in range(0, len(canon) - CHUNK_CHARS + 1, CHUNK_CHARS))
    prompt: Any = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return _chain(_text_chunks(prompt))
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        ids = [t & 0xFFFFFFFF for t in prompt]
        n = len(ids) - len(ids) % CHUNK_TOKENS
        return _chain(b"".join(t.to_bytes(4, "little") for t in ids[i:i + CHUNK_TOKENS])
                      for i in range(0, n, CHUNK_TOKENS))
    return []  # batches and other shapes: no prefix routing


def estimated_tokens(body: dict, chat: bool) -> int | None:
    """The prompt's length in tokens: exact for token ids, text bytes / `CHARS_PER_TOKEN` otherwise (the
    template's own tokens are not counted); None for shapes `prompt_hashes` does not index."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        return len(_chat_bytes(messages)) // CHARS_PER_TOKEN
    prompt: Any = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if isinstance(prompt, str):
        return len(prompt.encode("utf-8", "surrogatepass")) // CHARS_PER_TOKEN
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    return None


def uncached_tokens(prompt_tokens: int | None, matched_chunks: int) -> int | None:
    """About how many of the prompt's tokens an instance holding `matched_chunks` leading chunks computes."""
    return None if prompt_tokens is None else max(0, prompt_tokens - matched_chunks * CHUNK_TOKENS)


def _chat_bytes(messages: list) -> bytes:
    """Each message as the same bytes whatever key order the client used."""
    return b"".join(msgspec.json.encode(_sorted(m)) + b"\n" for m in messages)


def _sorted(value):
    if isinstance(value, dict):
        return {k: _sorted(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [_sorted(v) for v in value]
    return value


class PrefixIndex:
    """One instance's prefix hashes, least recently sent dropped first."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        self.capacity = capacity
        self._hashes: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._hashes)

    def matched(self, hashes: list[bytes]) -> int:
        """How many leading chunks of this prompt were sent here."""
        n = 0
        for h in hashes:
            if h not in self._hashes:
                break
            n += 1
        return n

    def record(self, hashes: list[bytes]) -> None:
        for h in hashes:
            self._hashes[h] = None
            self._hashes.move_to_end(h)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)
