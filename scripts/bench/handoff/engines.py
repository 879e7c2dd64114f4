"""Prefill and decode engine processes shaped like vLLM's loop: schedule, connector hooks, forward,
completion polling.  The driver (engine_loop.py) talks to them over a pipe in msgpack (no pickle).

Prefill: FCFS, one request per step: allocate blocks, run the prompt's forward (calibrated GPU work
plus writing the request's byte pattern into its blocks), sync (sampling), `kv_ready`.
Decode: every step admits newly arrived requests (allocate blocks, connector `start`), polls the
connector for usable KV, then runs one decode forward over the running batch, sync, one token each.
Time spent inside the connector hooks is measured per step.

Tensor parallelism: an engine of several ranks is one process per rank.  Rank 0 (the leader) talks to
the driver and schedules, as vLLM's engine core does; it sends each step to the other ranks (the
followers) and waits for all of them after the forward (lockstep, as a TP forward is).  Every rank
has its own kvpush endpoint and KV share (its heads); a prefill rank frees a request's blocks once
every rank's transfer ended, and decode KV is usable once every rank received it.
"""

from __future__ import annotations

import collections
import os
import time
from dataclasses import dataclass, field

import msgspec

from scripts.bench.handoff.handoff_modes import decode_side, prefill_side
from scripts.bench.handoff.kvslab import QWEN3_32B_RANK, BlockPool, KVSlab, blocks_for
from scripts.bench.handoff.workmodel import GpuWork, SleepWork, StepCost

_enc, _dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder()
IDLE_S = 0.0002


def send(conn, **msg) -> None:
    conn.send_bytes(_enc.encode(msg))


def inbox(conn) -> list[dict]:
    out = []
    while conn.poll():
        out.append(_dec.decode(conn.recv_bytes()))
    return out


def _setup(opts: dict):
    if opts.get("event_dir"):
        os.environ["KVPUSH_EVENT_DIR"] = opts["event_dir"]
    device = opts["device"]
    geometry = {**QWEN3_32B_RANK, **opts.get("geometry", {})}
    head_offset = 0
    if opts.get("ranks"):  # this rank's share of the engine's KV heads
        from kvpush_common.protocol.topology import local_heads

        r = opts["ranks"]
        head_offset, geometry["num_heads"] = local_heads(r["total_kv_heads"], r["tp_size"], r["rank"])
    if device is not None:
        import torch

        torch.cuda.set_device(device)
        work = GpuWork(device)
    else:
        work = SleepWork(opts.get("cpu_time_scale", 1.0))
    slab = KVSlab(block_size=opts["block_size"], num_blocks=opts["num_blocks"], device=device, geometry=geometry,
                  head_offset=head_offset)
    cost = StepCost(**opts.get("cost", {}))
    return work, slab, cost


class Followers:
    """The leader's pipes to the other ranks of its engine."""

    def __init__(self, conns):
        self.conns = list(conns)

    def send(self, **msg) -> None:
        data = _enc.encode(msg)
        for c in self.conns:
            c.send_bytes(data)

    def drain(self, handle) -> None:
        """Hand every message that has arrived to `handle(msg)`."""
        for c in self.conns:
            for m in inbox(c):
                handle(m)

    def wait_all(self, ev: str, handle) -> list[dict]:
        """Block until each rank sent `ev` once (other messages go to `handle`); their `ev` messages."""
        got: list[dict] = []
        for c in self.conns:
            while True:
                m = _dec.decode(c.recv_bytes())
                if m["ev"] == ev:
                    got.append(m)
                    break
                handle(m)
        return got

    def stop(self) -> None:
        try:
            self.send(op="stop")
        except (OSError, BrokenPipeError):
            pass


def prefill_main(conn, opts: dict, follower_conns=()) -> None:
    """Rank 0 of the prefill engine: `conn` is the driver; `follower_conns` reach ranks 1.."""
    work, slab, cost = _setup(opts)
    side = prefill_side(opts["mode"])(slab, opts["mode"], opts["poll_s"], opts.get("ranks"))
    followers = Followers(follower_conns)
    tp = 1 + len(followers.conns)
    pool = BlockPool(slab.num_blocks)
    send(conn, ev="hello", unit_ms=work.unit_ms, tp=tp, **side.hello())
    followers.wait_all("ready", lambda m: None)  # started once the driver gave them our port
    send(conn, ev="ready")
    waiting: collections.deque = collections.deque()
    held: dict[str, list[int]] = {}
    ended: collections.Counter = collections.Counter()  # tid -> ranks whose transfer ended

    def transfer_ended(tid: str) -> None:
        ended[tid] += 1
        if ended[tid] == tp:
            del ended[tid]
            pool.release(held.pop(tid))

    def on_follower(m: dict) -> None:
        for tid in m.get("tids", ()):
            transfer_ended(tid)

    try:
        while True:
            msgs = inbox(conn)
            if any(m["op"] == "stop" for m in msgs):
                return
            waiting.extend(m for m in msgs if m["op"] == "prefill")
            followers.drain(on_follower)
            for tid in side.poll():
                if tid in held:
                    transfer_ended(tid)
            if not waiting:
                time.sleep(IDLE_S)
                continue
            req = waiting[0]
            blocks = pool.allocate(blocks_for(req["tokens"], slab.block_size))
            if blocks is None:  # wait for a transfer to hand blocks back
                time.sleep(IDLE_S)
                continue
            waiting.popleft()
            held[req["tid"]] = blocks
            t0 = time.time()
            followers.send(op="step", tid=req["tid"], seq=req["seq"], tokens=req["tokens"], blocks=blocks)
            work.run(cost.prefill_ms(req["tokens"]))
            slab.fill(blocks, req["seq"])
            work.sync()
            side.kv_ready(req["tid"], blocks, req["tokens"])
            followers.wait_all("stepped", on_follower)
            t1 = time.time()
            send(conn, ev="prefilled", tid=req["tid"], t_prefill_start=t0, t_prefill_done=t1,
                 blocks=blocks if opts["mode"] == "vllm-pull" else None, free_blocks=len(pool.free))
    finally:
        followers.stop()
        side.close()


def prefill_follower_main(conn, opts: dict) -> None:
    """Prefill rank > 0: runs each step the leader sends, reports the requests whose transfer ended."""
    work, slab, cost = _setup(opts)
    side = prefill_side(opts["mode"])(slab, opts["mode"], opts["poll_s"], opts["ranks"])

    def on_step(m: dict) -> None:
        work.run(cost.prefill_ms(m["tokens"]))
        slab.fill(m["blocks"], m["seq"])
        work.sync()
        side.kv_ready(m["tid"], m["blocks"], m["tokens"])
        send(conn, ev="stepped")

    _follow(conn, side, on_step, lambda tids: send(conn, ev="ended", tids=tids))


def _follow(conn, side, on_op, on_side) -> None:
    """A follower rank's loop: the leader's ops (until "stop"), and its own connector side's results."""
    send(conn, ev="ready")
    try:
        while True:
            if conn.poll(IDLE_S):
                for m in inbox(conn):
                    if m["op"] == "stop":
                        return
                    on_op(m)
            got = side.poll()
            if got:
                on_side(got)
    finally:
        side.close()


@dataclass
class _Req:
    tid: str
    seq: int
    tokens: int
    out_tokens: int
    remote_blocks: list | None
    blocks: list = field(default_factory=list)
    generated: int = 0
    t_started: float = 0.0
    t_usable_seen: float = 0.0
    t_gen_start: float = 0.0
    t_first: float = 0.0


def decode_main(conn, opts: dict, follower_conns=()) -> None:
    """Rank 0 of the decode engine: schedules, measures hook time, and reports to the driver."""
    work, slab, cost = _setup(opts)
    followers = Followers(follower_conns)
    tp = 1 + len(followers.conns)
    send(conn, ev="alive", unit_ms=work.unit_ms)
    hello = next(m for m in _wait(conn) if m["op"] == "hello")
    followers.send(**hello)
    side = decode_side(opts["mode"])(slab, opts["mode"], opts["poll_s"], hello, opts.get("ranks"))
    followers.wait_all("ready", lambda m: None)
    pool = BlockPool(slab.num_blocks)
    send(conn, ev="ready")
    arrived: collections.deque = collections.deque()
    waiting_kv: dict[str, _Req] = {}
    reports: dict[str, list] = collections.defaultdict(list)  # tid -> (ok, reason) of each rank so far
    verifying: dict[str, list] = {}  # tid -> [finished message, ranks still checking, blocks]
    running: list[_Req] = []
    steps: list[tuple[float, float, int, int]] = []  # (hook us, forward ms, batch, admitted)
    verify_planes = _verify_planes(opts)

    def finish(tid: str) -> None:
        msg, _, blocks = verifying.pop(tid)
        pool.release(blocks)  # every rank has checked them: they may take the next request's KV
        send(conn, **msg)

    def on_follower(m: dict) -> None:
        if m["ev"] == "usable":
            for tid, ok, reason in m["items"]:
                reports[tid].append((ok, reason))
        elif m["ev"] == "verified":
            v = verifying[m["tid"]]
            v[0]["wrong_bytes"] += m["wrong"]  # only sent when verifying: every count is >= 0
            v[1] -= 1
            if v[1] == 0:
                finish(m["tid"])

    try:
        while True:
            for m in inbox(conn):
                if m["op"] == "stop":
                    return
                if m["op"] == "stats":
                    send(conn, ev="stats", steps=steps, free_blocks=len(pool.free))
                    steps = []
                elif m["op"] == "decode":
                    arrived.append(_Req(m["tid"], m["seq"], m["tokens"], m["out_tokens"], m.get("remote_blocks")))
            followers.drain(on_follower)
            admitted, hook_ns = 0, 0
            while arrived:  # scheduler: allocate prompt + output blocks, then the connector's hook
                r = arrived[0]
                blocks = pool.allocate(blocks_for(r.tokens + r.out_tokens, slab.block_size))
                if blocks is None:
                    break
                arrived.popleft()
                r.blocks = blocks
                prompt = blocks[:blocks_for(r.tokens, slab.block_size)]
                followers.send(op="start", tid=r.tid, blocks=prompt, tokens=r.tokens, remote_blocks=r.remote_blocks)
                h0 = time.perf_counter_ns()
                side.start(r.tid, prompt, r.tokens, r.remote_blocks)
                hook_ns += time.perf_counter_ns() - h0
                r.t_started = time.time()
                waiting_kv[r.tid] = r
                admitted += 1
            h0 = time.perf_counter_ns()
            for tid, ok, reason in side.poll():
                reports[tid].append((ok, reason))
            hook_ns += time.perf_counter_ns() - h0
            now = time.time()
            finished = [tid for tid in waiting_kv if len(reports.get(tid, ())) == tp]  # every rank has ended
            for tid in finished:
                r = waiting_kv.pop(tid)
                got = reports.pop(tid)
                r.t_usable_seen = now
                if all(ok for ok, _ in got):
                    running.append(r)
                else:
                    pool.release(r.blocks)
                    send(conn, ev="finished", tid=tid, ok=False, reason="; ".join(x for ok, x in got if not ok),
                         t_started=r.t_started)
            if not running:
                if admitted or finished:
                    steps.append((hook_ns / 1e3, 0.0, 0, admitted))
                time.sleep(IDLE_S)
                continue
            last = [r for r in running if r.generated + 1 >= r.out_tokens]
            check = [[r.tid, r.seq, r.blocks[:blocks_for(r.tokens, slab.block_size)]] for r in last]
            t_step = time.time()
            context = sum(r.tokens + r.generated for r in running)
            followers.send(op="forward", batch=len(running), context=context,
                           verify=check if opts.get("verify") else [])
            work.run(cost.decode_ms(len(running), context))
            work.sync()
            followers.wait_all("stepped", on_follower)
            t_end = time.time()
            steps.append((hook_ns / 1e3, (t_end - t_step) * 1e3, len(running), admitted))
            for r in running:
                if r.generated == 0:
                    r.t_gen_start, r.t_first = t_step, t_end
                r.generated += 1
            for r in last:
                running.remove(r)
                wrong = slab.count_wrong(check[last.index(r)][2], r.seq, verify_planes) \
                    if opts.get("verify") else -1
                verifying[r.tid] = [dict(ev="finished", tid=r.tid, ok=True, reason="", t_started=r.t_started,
                                         t_usable_seen=r.t_usable_seen, t_gen_start=r.t_gen_start, t_first=r.t_first,
                                         t_last=t_end, wrong_bytes=wrong),
                                    tp - 1 if opts.get("verify") else 0, r.blocks]
                if verifying[r.tid][1] == 0:
                    finish(r.tid)
    finally:
        followers.stop()
        side.close()


def decode_follower_main(conn, opts: dict) -> None:
    """Decode rank > 0: registers what the leader admits, runs each forward, reports usable KV and
    the bytes it checked."""
    work, slab, cost = _setup(opts)
    hello = next(m for m in _wait(conn) if m.get("op") == "hello")
    side = decode_side(opts["mode"])(slab, opts["mode"], opts["poll_s"], hello, opts["ranks"])
    verify_planes = _verify_planes(opts)

    def on_op(m: dict) -> None:
        if m["op"] == "start":
            side.start(m["tid"], m["blocks"], m["tokens"], m.get("remote_blocks"))
        elif m["op"] == "forward":
            work.run(cost.decode_ms(m["batch"], m["context"]))
            work.sync()
            send(conn, ev="stepped")
            for tid, seq, blocks in m["verify"]:
                send(conn, ev="verified", tid=tid, wrong=slab.count_wrong(blocks, seq, verify_planes))

    _follow(conn, side, on_op, lambda items: send(conn, ev="usable", items=items))


def _verify_planes(opts: dict) -> slice:
    """Planes (layer x K/V) whose bytes a decode rank checks: all, or every 31st (sample)."""
    return slice(None) if opts.get("verify") == "all" else slice(0, None, 31)


def _wait(conn):
    while True:
        if conn.poll(1.0):
            yield _dec.decode(conn.recv_bytes())
