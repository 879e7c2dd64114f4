"""A vLLM CPU pair (prefill P, decode D with kv_load_failure_policy=recompute) behind the kvpush
router, with process-level faults: SIGSTOP/SIGCONT and SIGKILL + restart of the prefill.  Used by
tests/chaos/test_chaos_vllm.py (short, CI) and scripts/chaos/chaos_load.py (minutes, scripts/chaos/chaos.sh).
`LoadStream` is the steady stream of client requests of the restart scenarios (tests/chaos/test_chaos_restarts.py)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request
from dataclasses import dataclass

import psutil

from kvpush_common.testing.vllm_cluster import (Router, VllmServer, free_port_pair, kvpush_metrics, make_model,
                                                post_json, wait_healthy)

GEN = {"model": "tiny", "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
# D's bound: transfer_timeout_s + fence_wait_s (reg_ttl_s + write_timeout_s + fence_grace_s 5) = 15 s
TIMEOUTS = {"reg_ttl_s": 3, "write_timeout_s": 2, "heartbeat_s": 1, "lease_s": 10, "transfer_timeout_s": 5,
            "handshake_timeout_s": 2}
ENGINE_ID = "chaos-prefill"  # fixed, so that a restarted prefill keeps the identity the router learned


class Pair:
    def __init__(self, work, env: dict | None = None):
        self.work = work
        self.env = env or {}
        self.model = make_model(work / "tiny", seed=0)
        self.p_port, self.d_metrics = free_port_pair(), free_port_pair()
        self.P = self._prefill()
        self.D = VllmServer("D", self.model, role="kv_consumer", log_dir=work, core="1", env=self.env,
                            failure_policy="recompute",
                            # every request receives its KV (repeated prompts included): the faults hit transfers
                            extra={**TIMEOUTS, "metrics_port": self.d_metrics, "local_prefill_max_tokens": 0})
        self.router = None
        self.restarts = 0

    def _prefill(self, port: int | None = None) -> VllmServer:
        kv = {"kv_connector": "KVPushConnector", "kv_connector_module_path": "kvpush_common.vllm.connector",
              "kv_role": "kv_producer", "engine_id": ENGINE_ID,
              "kv_connector_extra_config": {"port": self.p_port, **TIMEOUTS}}
        return VllmServer("P" if not getattr(self, "restarts", 0) else f"P{self.restarts}", self.model, role=None,
                          log_dir=self.work, core="0", env=self.env, kv_config=kv, port=port)

    def start(self, timeout: float = 600) -> "Pair":
        wait_healthy([self.P, self.D], timeout=timeout)
        self.router = Router(mode="push", prefill=[self.P.url], decode=[self.D.url], log_dir=self.work,
                             extra=["--retries", "1"])
        wait_healthy([self.router], timeout=120)
        return self

    def stop(self) -> None:
        for proc in (self.router, self.P, self.D):
            if proc is not None:
                if proc.alive():
                    proc.kill(signal.SIGCONT)
                proc.stop()

    def identity(self) -> dict:
        status, probe = post_json(self.P.url + "/v1/completions", {"model": "tiny", "prompt": "ping", "max_tokens": 1,
                                                                  "kv_transfer_params": {"kvpush": "identity"}})
        assert status == 200, probe
        return probe["kv_transfer_params"]["kvpush_identity"]

    def reference(self, prompt: str) -> str:
        status, body = post_json(self.P.url + "/v1/completions", {**GEN, "prompt": prompt})
        assert status == 200, body
        return body["choices"][0]["text"]

    def pause_prefill(self) -> None:
        self.P.kill(signal.SIGSTOP)

    def resume_prefill(self) -> None:
        self.P.kill(signal.SIGCONT)

    def restart_prefill(self, timeout: float = 600) -> None:
        """SIGKILL the prefill's process group and start it again on the same HTTP and side-channel ports."""
        port = self.P.port
        self.P.kill(signal.SIGKILL)
        self.P.stop()
        self.restarts += 1
        self.P = self._prefill(port)
        wait_healthy([self.P], timeout=timeout)

    def d_metrics_now(self) -> dict[str, float]:
        return kvpush_metrics(self.d_metrics)


def rss_mib(proc) -> float:
    """Resident memory of a server's whole process tree (API server, engine core, workers)."""
    try:
        root = psutil.Process(proc.proc.pid)
        procs = [root] + root.children(recursive=True)
        return sum(p.memory_info().rss for p in procs if p.is_running()) / (1 << 20)
    except psutil.Error:
        return float("nan")


def complete(url: str, prompt: str, timeout: float = 120) -> tuple[int, dict, float]:
    t0 = time.monotonic()
    status, body = post_json(url + "/v1/completions", {**GEN, "prompt": prompt}, timeout=timeout)
    return status, body, time.monotonic() - t0


def text_of(body: dict) -> str | None:
    try:
        return body["choices"][0]["text"]
    except (KeyError, IndexError, TypeError):
        return None


def env_with_events(work) -> dict:
    return {"KVPUSH_EVENT_DIR": str(work / "events"), **({"VLLM_LOGGING_LEVEL": "WARNING"}
                                                         if not os.environ.get("KVPUSH_VERBOSE") else {})}


@dataclass
class Outcome:
    """One client request through a router: when it ran (time.monotonic) and what came back."""

    router: str
    prompt: str
    stream: bool
    start: float
    end: float = 0.0
    status: int | None = None
    text: str | None = None
    error: str | None = None
    first_byte: bool = False  # streamed: a token reached the client before the request ended

    @property
    def answered(self) -> bool:
        return self.error is None and self.text is not None

    def in_flight_at(self, t: float) -> bool:
        return self.start <= t <= self.end


def ask(router: str, url: str, prompt: str, stream: bool, timeout: float, gen: dict = GEN) -> Outcome:
    """One completion through `url`, streamed or not; any failure (status, error event, broken connection)
    is kept as the outcome's error, never raised."""
    out = Outcome(router, prompt, stream, time.monotonic())
    body = {**gen, "prompt": prompt, "stream": stream}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            out.status = r.status
            if not stream:
                out.text = json.loads(r.read())["choices"][0]["text"]
            else:
                pieces = []
                for raw in r:
                    line = raw.decode().strip()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        raise RuntimeError(f"error event: {event['error']}")
                    pieces.append(event["choices"][0]["text"] if event.get("choices") else "")
                    out.first_byte = True
                out.text = "".join(pieces)
    except urllib.error.HTTPError as e:
        out.status, out.error = e.code, e.read()[:300].decode(errors="replace")
    except Exception as e:  # noqa: BLE001 - a broken or refused connection is an outcome here
        out.error = repr(e)[:300]
    out.end = time.monotonic()
    return out


class LoadStream:
    """`clients` threads sending requests back to back through one router (every other one streamed, the
    prompts in turn) until stopped; every outcome is kept."""

    def __init__(self, name: str, url: str, prompts: list[str], clients: int = 1, timeout: float = 120.0,
                 pause_s: float = 0.05):
        self.name, self.url, self.prompts, self.timeout, self.pause_s = name, url, prompts, timeout, pause_s
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]

    def start(self) -> "LoadStream":
        for t in self._threads:
            t.start()
        return self

    def _run(self, client: int) -> None:
        i = client
        while not self._stop.is_set():
            out = ask(self.name, self.url, self.prompts[i % len(self.prompts)], stream=i % 2 == 1, timeout=self.timeout)
            with self._lock:
                self.outcomes.append(out)
            i += 1
            self._stop.wait(self.pause_s)

    def done_since(self, t: float) -> int:
        with self._lock:
            return sum(o.start >= t for o in self.outcomes)

    def wait_done_since(self, t: float, n: int, limit_s: float) -> None:
        """Until `n` requests that started at or after `t` have ended (or `limit_s` passed)."""
        deadline = time.monotonic() + limit_s
        while self.done_since(t) < n and time.monotonic() < deadline:
            time.sleep(0.1)

    def stop(self) -> list[Outcome]:
        """Stop, and wait for the requests in flight (each ends within the client timeout)."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout=self.timeout + 30)
        if any(t.is_alive() for t in self._threads):
            raise AssertionError(f"{self.name}: a client request is still running {self.timeout + 30:.0f} s on")
        return list(self.outcomes)
