"""Prefill and decode engine processes shaped like vLLM's loop: schedule, connector hooks, forward,
completion polling.  The driver (engine_loop.py) talks to them over a pipe in msgpack (no pickle).

Prefill: FCFS, one request per step: allocate blocks, run the prompt's forward (calibrated GPU work
plus writing the request's byte pattern into its blocks), sync (sampling), `kv_ready`.
Decode: every step admits newly arrived requests (allocate blocks, connector `start`), polls the
connector for usable KV, then runs one decode forward over the running batch, sync, one token each.
Time spent inside the connector hooks is measured per step.
"""

from __future__ import annotations

import collections
import os
import time
from dataclasses import dataclass, field

import msgspec

from handoff_modes import decode_side, prefill_side
from kvslab import QWEN3_32B_RANK, BlockPool, KVSlab, blocks_for, pattern
from workmodel import GpuWork, SleepWork, StepCost

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
    if device is not None:
        import torch

        torch.cuda.set_device(device)
        work = GpuWork(device)
    else:
        work = SleepWork(opts.get("cpu_time_scale", 1.0))
    slab = KVSlab(block_size=opts["block_size"], num_blocks=opts["num_blocks"], device=device, geometry=geometry)
    cost = StepCost(**opts.get("cost", {}))
    return work, slab, cost


def prefill_main(conn, opts: dict) -> None:
    work, slab, cost = _setup(opts)
    side = prefill_side(opts["mode"])(slab, opts["mode"], opts["poll_s"], opts.get("staging_mib", 0))
    pool = BlockPool(slab.num_blocks)
    send(conn, ev="hello", unit_ms=work.unit_ms, **side.hello())
    waiting: collections.deque = collections.deque()
    held: dict[str, list[int]] = {}
    try:
        while True:
            msgs = inbox(conn)
            if any(m["op"] == "stop" for m in msgs):
                return
            waiting.extend(m for m in msgs if m["op"] == "prefill")
            for tid in side.poll():
                if tid in held:
                    pool.release(held.pop(tid))
            if not waiting:
                time.sleep(IDLE_S)
                continue
            req = waiting[0]
            blocks = pool.allocate(blocks_for(req["tokens"], slab.block_size))
            if blocks is None:  # wait for a transfer to hand blocks back
                time.sleep(IDLE_S)
                continue
            waiting.popleft()
            t0 = time.time()
            work.run(cost.prefill_ms(req["tokens"]))
            slab.fill(blocks, pattern(req["seq"]))
            work.sync()
            t1 = time.time()
            held[req["tid"]] = blocks
            side.kv_ready(req["tid"], blocks, req["tokens"])
            send(conn, ev="prefilled", tid=req["tid"], t_prefill_start=t0, t_prefill_done=t1,
                 blocks=blocks if opts["mode"] == "vllm-pull" else None, free_blocks=len(pool.free))
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


def decode_main(conn, opts: dict) -> None:
    work, slab, cost = _setup(opts)
    send(conn, ev="alive", unit_ms=work.unit_ms)
    hello = next(m for m in _wait(conn) if m["op"] == "hello")
    side = decode_side(opts["mode"])(slab, opts["mode"], opts["poll_s"], hello, opts.get("staging_mib", 0))
    pool = BlockPool(slab.num_blocks)
    send(conn, ev="ready")
    arrived: collections.deque = collections.deque()
    waiting_kv: dict[str, _Req] = {}
    running: list[_Req] = []
    steps: list[tuple[float, float, int, int]] = []  # (hook us, forward ms, batch, admitted)
    verify_planes = slice(None) if opts.get("verify") == "all" else slice(0, None, 31)
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
            admitted, hook_ns = 0, 0
            while arrived:  # scheduler: allocate prompt + output blocks, then the connector's hook
                r = arrived[0]
                blocks = pool.allocate(blocks_for(r.tokens + r.out_tokens, slab.block_size))
                if blocks is None:
                    break
                arrived.popleft()
                r.blocks = blocks
                h0 = time.perf_counter_ns()
                side.start(r.tid, blocks[:blocks_for(r.tokens, slab.block_size)], r.tokens, r.remote_blocks)
                hook_ns += time.perf_counter_ns() - h0
                r.t_started = time.time()
                waiting_kv[r.tid] = r
                admitted += 1
            h0 = time.perf_counter_ns()
            finished = side.poll()
            hook_ns += time.perf_counter_ns() - h0
            now = time.time()
            for tid, ok, reason in finished:
                r = waiting_kv.pop(tid)
                r.t_usable_seen = now
                if ok:
                    running.append(r)
                else:
                    pool.release(r.blocks)
                    send(conn, ev="finished", tid=tid, ok=False, reason=reason, t_started=r.t_started)
            if not running:
                if admitted or finished:
                    steps.append((hook_ns / 1e3, 0.0, 0, admitted))
                time.sleep(IDLE_S)
                continue
            t_step = time.time()
            context = sum(r.tokens + r.generated for r in running)
            work.run(cost.decode_ms(len(running), context))
            work.sync()
            t_end = time.time()
            steps.append((hook_ns / 1e3, (t_end - t_step) * 1e3, len(running), admitted))
            done = []
            for r in running:
                if r.generated == 0:
                    r.t_gen_start, r.t_first = t_step, t_end
                r.generated += 1
                if r.generated >= r.out_tokens:
                    done.append(r)
            for r in done:
                running.remove(r)
                prompt = r.blocks[:blocks_for(r.tokens, slab.block_size)]
                wrong = slab.count_wrong(prompt, pattern(r.seq), verify_planes) if opts.get("verify") else -1
                pool.release(r.blocks)
                send(conn, ev="finished", tid=r.tid, ok=True, reason="", t_started=r.t_started,
                     t_usable_seen=r.t_usable_seen, t_gen_start=r.t_gen_start, t_first=r.t_first, t_last=t_end,
                     wrong_bytes=wrong)
    finally:
        side.close()


def _wait(conn):
    while True:
        if conn.poll(1.0):
            yield _dec.decode(conn.recv_bytes())
