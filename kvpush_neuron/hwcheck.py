"""One push between two processes through the Neuron backend, bytes checked: the first-run smoke
check on a trn2 host (real runtime, LIBFABRIC/EFA) and, with --sim, the same code on CPU (UCX, DRAM).

    python -m kvpush_neuron.hwcheck pair [--sim]   # spawns producer and consumer, prints one JSON line

Each side starts the documented way: NEURON_RT_MAP_HBM=1 in its environment, runtime init, KV
allocation, preflight, then the NIXL agent.  The producer fills its KV from a seed; the consumer
rebuilds those bytes from the same seed and compares the destination blocks.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

GEO = dict(num_layers=4, num_heads=2, head_dim=64, num_blocks=16, block_size=32)
P_BLOCKS, D_BLOCKS, TOKENS, SEED = [3, 9, 1], [12, 0, 7], 96, 1234


def _side(sim: bool, core: int):
    """(slab, transport config) after the start-up sequence."""
    from kvpush_common.transport.nixl import TransportConfig

    from .runtime import RealNeuronRuntime
    from .slab import NeuronSlab, ready_sim_runtime

    if sim:
        return NeuronSlab(runtime=ready_sim_runtime(), **GEO), TransportConfig(backend="UCX")
    from .efa import neuron_transport

    transport = neuron_transport({}, os.environ)
    runtime = RealNeuronRuntime()
    runtime.init()
    return NeuronSlab(runtime=runtime, core=0, **GEO), transport


def _wait(ep, seconds: float = 60.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done = ep.take_finished()
        if done:
            return done[0]
        time.sleep(0.01)
    raise TimeoutError("no result within %.0f s" % seconds)


def run_producer(sim: bool, core: int) -> dict:
    from kvpush_common.endpoint.config import EndpointConfig
    from kvpush_common.endpoint.producer import ProducerEndpoint

    slab, transport = _side(sim, core)
    slab.write_bytes(np.random.default_rng(SEED).integers(0, 256, slab.read_bytes().size, dtype=np.uint8))
    ep = ProducerEndpoint(EndpointConfig(engine_id="P", total_kv_heads=GEO["num_heads"], transport=transport),
                          slab).start()
    print(json.dumps({"port": ep.address[1]}), flush=True)
    ep.kv_ready("hw", 0, P_BLOCKS, TOKENS)
    release = _wait(ep)
    ep.close()
    return {"role": "producer", "outcome": release.outcome.value, "reason": release.reason}


def run_consumer(sim: bool, core: int, port: int) -> dict:
    from kvpush_common.endpoint.config import EndpointConfig
    from kvpush_common.endpoint.consumer import ConsumerEndpoint
    from kvpush_common.protocol.legs import ProducerIdentity

    slab, transport = _side(sim, core)
    slab.write_bytes(np.full(slab.read_bytes().size, 0xAB, dtype=np.uint8))
    ep = ConsumerEndpoint(EndpointConfig(engine_id="D", total_kv_heads=GEO["num_heads"], transport=transport),
                          slab).start()
    ep.expect("hw", 0, ProducerIdentity(engine_id="P", host="127.0.0.1", port=port, tp_size=1), D_BLOCKS, TOKENS)
    result = _wait(ep)
    ep.close()
    src = np.random.default_rng(SEED).integers(0, 256, slab.read_bytes().size, dtype=np.uint8)
    dst, layout, base = slab.read_bytes(), slab.layout(), slab.slab_base
    bad = [(r, p, d) for r, reg in enumerate(layout.regions) for p, d in zip(P_BLOCKS, D_BLOCKS)
           if not np.array_equal(src[reg.base - base + p * reg.block_stride:][:layout.block_bytes],
                                 dst[reg.base - base + d * reg.block_stride:][:layout.block_bytes])]
    return {"role": "consumer", "ok": result.ok, "reason": result.reason, "mismatched_blocks": bad[:8],
            "mem_type": layout.mem_type}


def run_pair(sim: bool, cores=(0, 4), timeout: float = 120.0) -> dict:
    """Spawn producer and consumer (cores on different trn2 chips by default) and collect both results."""
    def env(core):  # one core per process, as the plugin's worker pins it
        return {**os.environ, "NEURON_RT_MAP_HBM": "1", "NEURON_VISIBLE_DEVICES": str(core),
                "NEURON_RT_VISIBLE_CORES": str(core), "FI_EFA_USE_DEVICE_RDMA": "1", "FI_EFA_ENABLE_SHM_TRANSFER": "0"}

    base = [sys.executable, "-m", "kvpush_neuron.hwcheck"] + (["--sim"] if sim else [])
    prod = subprocess.Popen(base + ["producer", "--core", str(cores[0])], stdout=subprocess.PIPE, text=True,
                            env=env(cores[0]))
    try:
        port = _json_line(prod.stdout, "port")
        cons = subprocess.run(base + ["consumer", "--core", str(cores[1]), "--port", str(port)], capture_output=True,
                              text=True, timeout=timeout, env=env(cores[1]))
        out, _ = prod.communicate(timeout=timeout)
    finally:
        if prod.poll() is None:
            prod.kill()
    if cons.returncode:
        raise RuntimeError(f"hwcheck consumer failed (rc={cons.returncode}): {cons.stderr[-2000:]}")
    return {"producer": _json_line(out.splitlines(), "role"), "consumer": _json_line(cons.stdout.splitlines(), "role")}


def _json_line(lines, key: str) -> object:
    """The first JSON object line holding `key` (NIXL logs to stdout too)."""
    for line in lines:
        if line.startswith("{") and key in (obj := json.loads(line)):
            return obj[key] if key == "port" else obj
    raise RuntimeError(f"hwcheck: a side exited without reporting {key!r}; see its stderr")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sim", action="store_true", help="simulated runtime, UCX over DRAM (CPU hosts)")
    ap.add_argument("role", choices=["pair", "producer", "consumer"])
    ap.add_argument("--core", type=int, default=0)
    ap.add_argument("--port", type=int, default=0)
    a = ap.parse_args(argv)
    if a.role == "pair":
        out = run_pair(a.sim)
    elif a.role == "producer":
        out = run_producer(a.sim, a.core)
    else:
        out = run_consumer(a.sim, a.core, a.port)
    print(json.dumps(out), flush=True)
    os._exit(0)  # skip NIXL teardown at exit


if __name__ == "__main__":
    main()
