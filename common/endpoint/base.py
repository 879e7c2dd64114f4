"""What producer and consumer endpoints share: the NIXL-owning worker thread, its inbox, the peer
table, notification decoding with sender checks, and the engine-facing outbox.

Threads per endpoint: the engine thread (only enqueues and drains), one worker thread (the only
caller of NIXL), and the handshake thread(s) (ZMQ only).
"""

from __future__ import annotations

import collections
import ctypes
import hashlib
import logging
import queue
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

from kvpush_common.endpoint.config import EndpointConfig
from kvpush_common.device.backend import DeviceBackend
from kvpush_common.endpoint.events import EventLog
from kvpush_common.protocol.layout import KVLayout, geometry_difference
from kvpush_common.endpoint.metrics import EndpointStats
from kvpush_common.endpoint.transfers import Settled
from kvpush_common.protocol.topology import local_heads
from kvpush_common.transport.nixl import NixlTransport, Transport, TransportError
from kvpush_common.protocol.wire import Codec, Hello, Message, WireError, compat_hash, layout_hash_facts

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Peer:
    engine_id: str
    rank: int
    tp_size: int
    agent: str
    layout: KVLayout
    write_timeout_s: float = 30.0  # the peer's bound on one transfer (Hello.write_timeout_ms)
    incarnation: str = ""  # digest of the peer's NIXL agent metadata: a restarted process has a new one


TransportFactory = Callable[[EndpointConfig, bool], Transport]

_PR_SET_TIMERSLACK = 29


def set_timer_slack(ns: int) -> bool:
    """How late the kernel may end the calling thread's timed waits (Linux `prctl(PR_SET_TIMERSLACK)`, per thread;
    0: the thread's default).  The default slack (50 us) may be added to every timed wait, longer than the worker's
    write poll itself, so its write and wire polls would come far less often than configured
    (scripts/bench/probes/timer_slack.py measures the waits).  Best effort: False where the call is not there."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_TIMERSLACK, ns, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def nixl_transport(cfg: EndpointConfig, progress_thread: bool) -> Transport:
    return NixlTransport(cfg.agent_name, cfg.transport, progress_thread=progress_thread)


class Endpoint:
    role: str = "abstract"

    def __init__(self, cfg: EndpointConfig, backend: DeviceBackend,
                 transport_factory: TransportFactory = nixl_transport, clock: Callable[[], float] = time.monotonic):
        self.cfg = cfg.validate()
        self.backend = backend
        self.layout = backend.layout()
        first, count = local_heads(cfg.total_kv_heads, cfg.tp_size, cfg.rank)
        if self.layout.num_heads != count or self.layout.head_offset != first:
            raise ValueError(
                f"backend layout holds heads [{self.layout.head_offset}, +{self.layout.num_heads}) but rank "
                f"{cfg.rank} of TP {cfg.tp_size} with {cfg.total_kv_heads} KV heads must hold [{first}, +{count})")
        self.codec = Codec(cfg.secret)
        self.clock = clock
        self.stats = EndpointStats(cfg.engine_id, self.role)
        self.event = EventLog.from_env(cfg.engine_id, self.role, cfg.rank)
        self.compat = compat_hash(mode=cfg.mode, model=cfg.model, num_layers=self.layout.num_layers,
                                  total_kv_heads=cfg.total_kv_heads, head_dim=self.layout.head_dim,
                                  dtype=self.layout.dtype, **layout_hash_facts(self.layout))
        self._transport_factory = transport_factory
        self.transport: Transport | None = None
        self._agent_md = b""
        self._peers: dict[tuple[str, int], Peer] = {}
        self._last_seen: dict[tuple[str, int], float] = {}  # peer -> last message from it (or to it)
        # peer -> why NIXL could not reach it, since the last message from it or send to it (liveness)
        self._unreachable: dict[tuple[str, int], str] = {}
        self._next_evict = 0.0
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._outbox: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        # when the worker last went to sleep and how long the step before took (a hand-over's wake-up, split
        # into arriving while it slept or while it was busy)
        self._slept_from = float("-inf")
        self._last_step_s = 0.0

    # ---- lifecycle -------------------------------------------------------------------------------
    def start(self) -> "Endpoint":
        """Create the agent and register KV memory on the worker thread, then serve."""
        self._thread = threading.Thread(target=self._main, name=f"kvpush-{self.role}-{self.cfg.rank}", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            raise self._start_error
        self._after_start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._before_close()

    def _after_start(self) -> None:
        pass

    def _before_close(self) -> None:
        pass

    def _main(self) -> None:
        set_timer_slack(round(self.cfg.timer_slack_s * 1e9))  # the polls below sleep as long as configured
        try:
            self.backend.bind_thread()
            self.event.bind_writer()
            progress = self.cfg.transport.progress_thread_for(self.role, self.cfg.mode)
            self.transport = self._transport_factory(self.cfg, progress)
            self.transport.register(self.backend.registration_regions(), self.layout.mem_type)
            self._agent_md = self.transport.metadata()
        except BaseException as e:  # reported to start()'s caller
            self._start_error = e
            self._started.set()
            return
        self._started.set()
        steps, cpu, nixl_cpu = self.stats.worker_steps, self.stats.worker_cpu, self.stats.worker_nixl_cpu
        while not self._stop.is_set():
            began = self.clock()
            cpu0, nixl0 = time.thread_time(), getattr(self.transport, "cpu_s", 0.0)
            try:
                busy = self._step()
            except Exception:  # keep serving; a bug in one message must not strand every request
                log.exception("kvpush %s worker step failed", self.role)
                self.stats.worker_errors.inc()
                busy = False
            self.event.flush()  # what the engine thread logged since the last step
            self._slept_from = self.clock()
            self._last_step_s = self._slept_from - began
            steps.inc()
            cpu.inc(time.thread_time() - cpu0)
            nixl_cpu.inc(getattr(self.transport, "cpu_s", 0.0) - nixl0)
            self._wake.wait(self._poll_period(busy))
            self._wake.clear()
        self.event.flush()
        try:
            self.transport.close()
        except Exception:
            log.exception("closing transport")

    def _step(self) -> bool:
        raise NotImplementedError

    def _poll_period(self, busy: bool) -> float:
        """How long the worker sleeps before its next step unless the engine wakes it."""
        return self.cfg.poll_s if busy else self.cfg.idle_poll_s

    # ---- engine-facing ---------------------------------------------------------------------------
    def _enqueue(self, item, wake: bool = True) -> None:
        self._inbox.put(item)
        if wake:
            self._wake.set()

    def engine_step(self) -> None:
        """Engine thread, once per step: a chance to wake the worker when it waits for something only a fetch
        of notifications can bring (the consumer's WriteDone).  Nothing here by default."""

    def take_finished(self) -> list:
        """Drain results (non-blocking; safe from the engine thread)."""
        out = []
        while self._outbox:
            out.append(self._outbox.popleft())
        return out

    # ---- worker helpers --------------------------------------------------------------------------
    def _drain_inbox(self) -> list:
        items = []
        while True:
            try:
                items.append(self._inbox.get_nowait())
            except queue.Empty:
                return items

    def local_hello(self) -> Hello:
        return Hello(engine_id=self.cfg.engine_id, role=self.role, rank=self.cfg.rank, tp_size=self.cfg.tp_size,
                     mode=self.cfg.mode, compat_hash=self.compat, total_kv_heads=self.cfg.total_kv_heads,
                     agent_name=self.cfg.agent_name, agent_metadata=self._agent_md, layout=self.layout,
                     write_timeout_ms=int(self.cfg.write_timeout_s * 1000))

    def check_peer_hello(self, hello: Hello, want_role: str) -> str | None:
        """Reason to refuse a peer, or None."""
        if hello.role != want_role:
            return f"expected a {want_role}, got a {hello.role}"
        if hello.mode != self.cfg.mode:
            return f"transfer mode mismatch: peer is {hello.mode}, this side is {self.cfg.mode}"
        if hello.compat_hash != self.compat:
            differ = geometry_difference(hello.layout, self.layout)
            if differ:  # e.g. vLLM's CPU cache (K|V rows in one region) against the Neuron plugin's planes
                return f"compatibility hash mismatch: KV geometry differs (peer vs here: {differ})"
            return "compatibility hash mismatch (protocol version or model differ)"
        if hello.total_kv_heads != self.cfg.total_kv_heads:
            return f"total KV heads differ: {hello.total_kv_heads} vs {self.cfg.total_kv_heads}"
        try:
            hello.layout.validate()
            first, count = local_heads(hello.total_kv_heads, hello.tp_size, hello.rank)
        except ValueError as e:
            return f"peer layout invalid: {e}"
        if (hello.layout.head_offset, hello.layout.num_heads) != (first, count):
            return "peer layout's heads do not match its TP rank"
        return None

    def _add_peer(self, hello: Hello) -> Peer:
        old = self._peers.pop((hello.engine_id, hello.rank), None)
        self._unreachable.pop((hello.engine_id, hello.rank), None)
        if old is not None:  # the peer restarted: forget its old agent (and connection) first
            try:
                self.transport.remove_peer(old.agent)
            except TransportError as e:
                log.warning("removing stale agent %s: %s", old.agent, e)
        agent = self.transport.add_peer(hello.agent_metadata)
        if agent != hello.agent_name:
            raise TransportError(f"peer agent metadata names {agent!r}, Hello claims {hello.agent_name!r}")
        peer = Peer(hello.engine_id, hello.rank, hello.tp_size, agent, hello.layout, hello.write_timeout_ms / 1000.0,
                    incarnation_of(hello))
        self._peers[(hello.engine_id, hello.rank)] = peer
        self._last_seen[(hello.engine_id, hello.rank)] = self.clock()
        return peer

    def _guard(self, fn, *args) -> list:
        """Run one unit of a worker step (an inbox item, a message, an action).  An unexpected exception
        is logged and counted, and costs only that unit: the rest of the step's work still happens, so
        no result (a `Received`, a `Release`) computed earlier in the step is lost."""
        try:
            return fn(*args) or []
        except Exception:
            log.exception("kvpush %s worker: %s failed", self.role, getattr(fn, "__name__", fn))
            self.stats.worker_errors.inc()
            return []

    def _evict_idle(self, now: float, busy: set[tuple[str, int]]) -> None:
        """Forget peers not heard from for `peer_idle_s` that no live work refers to (upstream S1): a
        peer that restarted under a new engine id would otherwise hold its NIXL agent for ever."""
        if now < self._next_evict:
            return
        self._next_evict = now + min(60.0, self.cfg.peer_idle_s / 4)
        for key, peer in list(self._peers.items()):
            if key in busy or now - self._last_seen.get(key, now) < self.cfg.peer_idle_s:
                continue
            self._forget_peer(key, "idle")

    def _forget_peer(self, key: tuple[str, int], why: str) -> None:
        peer = self._peers.pop(key, None)
        self._last_seen.pop(key, None)
        self._unreachable.pop(key, None)
        if peer is None:
            return
        log.info("kvpush %s: forgetting peer %s rank %d (%s)", self.role, key[0], key[1], why)
        self.stats.peers_evicted.inc()
        try:
            self.transport.remove_peer(peer.agent)
        except TransportError as e:
            log.warning("removing agent %s: %s", peer.agent, e)

    def _settle(self, handle, now: float, deadline: float) -> Settled | None:
        """Poll one posted NIXL transfer.  None while it runs, or while it runs past its deadline and cannot
        be cancelled yet (it may still write); else its handle is released and the end is returned:
        a `Settled`.  Only then may anything be said about the memory it touches."""
        try:
            state = self.transport.state(handle)
        except TransportError as e:
            log.warning("state of a %s transfer: %s", self.role, e)
            state = "ERR"
        if state == "PROC" and now < deadline:
            return None
        if not self.transport.release(handle) and state != "DONE":
            return None  # a DONE handle that cannot be released is freed by NIXL's destructor
        return Settled.DONE if state == "DONE" else Settled.ERR if state == "ERR" else Settled.TIMEOUT

    def _send(self, peer: Peer, msg: Message) -> bool:
        """Send one control message; False if it did not go.  A TransportError (NIXL could not reach the peer,
        e.g. NIXL_ERR_REMOTE_DISCONNECT) marks the peer unreachable until it is reached again."""
        key = (peer.engine_id, peer.rank)
        try:
            self.transport.send_notif(peer.agent, self.codec.encode(msg))
        except Exception as e:  # TransportError, WireError, or anything else: the message did not go
            self.stats.failed_notifs.inc()
            log.warning("could not send %s to %s: %s", type(msg).__name__, peer.agent, e)
            if isinstance(e, TransportError) and self._peers.get(key) is peer:
                self._unreachable[key] = str(e)
            return False
        self._unreachable.pop(key, None)
        return True

    def _receive(self, raw: dict[str, list[bytes]]) -> list[tuple[Peer, Message]]:
        """Decode fetched notifications; drop (and count) malformed, forged or unknown-sender ones."""
        out = []
        for agent, frames in raw.items():
            for frame in frames:
                try:
                    msg = self.codec.decode(frame)
                except WireError as e:
                    self.stats.rejected_msgs.labels(reason=type(e).__name__).inc()
                    log.warning("dropped notification from %s: %s", agent, e)
                    continue
                claimed = self._claimed_sender(msg)
                peer = self._peers.get(claimed) if claimed else None
                if peer is None or peer.agent != agent:
                    self.stats.rejected_msgs.labels(reason="unknown_sender").inc()
                    log.warning("dropped %s from %s: sender does not match a handshaken peer %s",
                                type(msg).__name__, agent, claimed)
                    continue
                self._last_seen[claimed] = self.clock()
                self._unreachable.pop(claimed, None)
                out.append((peer, msg))
        return out

    def _claimed_sender(self, msg: Message) -> tuple[str, int] | None:
        raise NotImplementedError


def incarnation_of(hello: Hello) -> str:
    """A process's NIXL agent metadata holds its own connection addresses: equal metadata, same process."""
    return hashlib.sha256(hello.agent_metadata).hexdigest()[:16]
