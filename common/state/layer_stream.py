"""Layer streaming on a producer rank: what of one request's KV has gone, layer by layer, to each
destination rank before the request's whole KV is ready (pure state; no NIXL, time passed in).

While a request is still being prefilled, each attention layer's KV for the tokens computed so far is
ready once its device fence passes (`LayerChunk`).  Every destination rank that has registered gets the
ready layers it does not hold yet in one batch of WRITEs without a notification (`spans_for`); one batch
per destination is in flight at a time, so a later batch never races an earlier one over a shared block.
When the whole KV is ready (`complete`) the push sends only the spans still missing, as one WRITE with
WriteDone riding on it (or WriteDone alone): the consumer's rule (usable only after WriteDone from every
producer rank) is unchanged, so no consumer change and no handshake field is needed.  A batch that fails
only ends streaming into that destination (`streamed` is then false): the push sends it every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from kvpush_common.state.rendezvous import Dest


@dataclass(frozen=True)
class LayerChunk:
    """Layers [first, end) hold tokens [0, num_tokens) of the request in `block_ids` once `fence` passed."""

    first: int
    end: int
    block_ids: tuple[int, ...]
    num_tokens: int
    fence: object = None


@dataclass(frozen=True)
class LayerSpan:
    """One WRITE of a batch: tokens [from_token, num_tokens) of layers [first, end)."""

    first: int
    end: int
    from_token: int
    num_tokens: int
    block_ids: tuple[int, ...]


@dataclass
class LayerStream:
    num_layers: int
    started: float
    ready: list[int] = field(default_factory=list)  # tokens ready per layer (fence passed)
    block_ids: tuple[int, ...] = ()  # the newest ready chunk's blocks (each chunk extends the previous list)
    waiting: list[LayerChunk] = field(default_factory=list)  # fence not passed yet
    landed: dict[Dest, list[int]] = field(default_factory=dict)  # tokens per layer whose WRITE completed
    posting: dict[Dest, tuple[LayerSpan, ...]] = field(default_factory=dict)  # the batch in flight
    broken: set[Dest] = field(default_factory=set)  # a batch failed: streaming into it stopped
    closed: bool = False  # the whole-request push took over (or the request ended): post nothing more

    def __post_init__(self):
        self.ready = self.ready or [0] * self.num_layers

    def add(self, chunk: LayerChunk) -> None:
        if not 0 <= chunk.first < chunk.end <= self.num_layers:
            raise ValueError(f"layers [{chunk.first}, {chunk.end}) out of range for {self.num_layers} layers")
        self.waiting.append(chunk)

    def settle(self, written: Callable[[object], bool]) -> None:
        """Chunks whose fence passed become ready (each fence is asked; they pass in any order)."""
        passed = [c for c in self.waiting if written(c.fence)]
        if not passed:
            return
        self.waiting = [c for c in self.waiting if c not in passed]
        for c in passed:
            for layer in range(c.first, c.end):
                self.ready[layer] = max(self.ready[layer], c.num_tokens)
            if len(c.block_ids) >= len(self.block_ids):
                self.block_ids = c.block_ids

    def spans_for(self, dest: Dest, first_token: int, num_tokens: int, align: int) -> list[LayerSpan]:
        """The next batch into `dest` (registered for tokens [first_token, num_tokens)); empty while one is
        in flight, after a failure, or once the whole push took over.  A span restarts at a multiple of
        `align` (a block both sides share: the block a chunk boundary cut goes again, now complete)."""
        if self.closed or dest in self.broken or dest in self.posting:
            return []
        landed = self.landed.get(dest, [0] * self.num_layers)
        spans: list[LayerSpan] = []
        for layer in range(self.num_layers):
            to = min(self.ready[layer], num_tokens)
            start = max(first_token, landed[layer] // align * align)
            if to <= start or landed[layer] >= to:
                continue
            last = spans[-1] if spans else None
            if last is not None and last.end == layer and (last.from_token, last.num_tokens) == (start, to):
                spans[-1] = LayerSpan(last.first, layer + 1, start, to, self.block_ids)
            else:
                spans.append(LayerSpan(layer, layer + 1, start, to, self.block_ids))
        return spans

    def posted(self, dest: Dest, spans: list[LayerSpan]) -> None:
        self.posting[dest] = tuple(spans)

    def ended(self, dest: Dest, ok: bool) -> None:
        """The batch in flight into `dest` ended (every WRITE of it, DONE or not)."""
        spans = self.posting.pop(dest, ())
        if not ok:
            self.broken.add(dest)
            self.landed.pop(dest, None)
            return
        landed = self.landed.setdefault(dest, [0] * self.num_layers)
        for s in spans:
            for layer in range(s.first, s.end):
                landed[layer] = max(landed[layer], s.num_tokens)

    def complete(self, num_tokens: int, block_ids: tuple[int, ...]) -> None:
        """The whole KV is ready (every layer holds every token): what is still missing is sent now."""
        self.ready = [num_tokens] * self.num_layers
        self.block_ids = tuple(block_ids)
        self.waiting.clear()

    def streamed(self, dest: Dest) -> bool:
        """Some batch landed in `dest` and none failed: the whole push may send only what is missing."""
        return dest in self.landed and dest not in self.broken

    def busy(self, dest: Dest | None = None) -> bool:
        """A batch is in flight (into `dest`, or into any destination)."""
        return bool(self.posting) if dest is None else dest in self.posting
