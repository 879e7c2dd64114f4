"""Real Trainium tests (trn2.48xlarge, SDK >= 2.31, torch-neuronx, EFA, NIXL >= 0.10 LIBFABRIC).

Skipped off Neuron hosts by conftest.  Each test runs in a fresh Python process, because
NEURON_RT_MAP_HBM must be in the environment before the process's first device allocation and the
Neuron runtime must be initialised before any NIXL agent.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.neuron, pytest.mark.nixl]

ENV = {"NEURON_RT_MAP_HBM": "1", "NEURON_VISIBLE_DEVICES": "0", "NEURON_RT_VISIBLE_CORES": "0",
       "FI_EFA_USE_DEVICE_RDMA": "1", "FI_EFA_ENABLE_SHM_TRANSFER": "0"}


def run_fresh(code: str, env: dict | None = None, timeout: float = 300) -> dict:
    """Run `code` in a new interpreter; it prints one JSON line last."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **ENV, **(env or {})})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_real_runtime_allocates_mapped_hbm():
    out = run_fresh("""
        import json
        from kvpush_neuron.runtime import RealNeuronRuntime
        rt = RealNeuronRuntime()
        rt.init()
        t, ptr = rt.allocate(1 << 20)
        import numpy as np
        rt.from_host(t, np.arange(256, dtype=np.uint8), offset=4096)
        back = rt.to_host(t)
        print(json.dumps({"ptr": ptr, "device": str(t.device), "ok": bool((back[4096:4352] == np.arange(256)).all()),
                          "kind": rt.device_memory_kind()}))
    """)
    assert out["ptr"] != 0 and out["device"].startswith("neuron") and out["ok"] and out["kind"] == "NEURON"


def test_without_map_hbm_the_backend_refuses():
    out = run_fresh("""
        import json
        from kvpush_neuron.runtime import RealNeuronRuntime
        from kvpush_neuron.slab import NeuronSlab
        from kvpush_neuron.startup import NeuronStartupError
        rt = RealNeuronRuntime()
        rt.init()
        try:
            NeuronSlab(runtime=rt, num_layers=2, num_heads=2, head_dim=64, num_blocks=8)
            print(json.dumps({"refused": False}))
        except NeuronStartupError as e:
            print(json.dumps({"refused": True, "msg": str(e)}))
    """, env={"NEURON_RT_MAP_HBM": "0"})
    assert out["refused"] and "NEURON_RT_MAP_HBM=1" in out["msg"]


def test_plugin_layout_registers_with_nixl_libfabric_as_vram():
    out = run_fresh("""
        import json
        from kvpush_common.transport.nixl import NixlTransport
        from kvpush_neuron.efa import neuron_transport
        from kvpush_neuron.runtime import RealNeuronRuntime
        from kvpush_neuron.slab import NeuronSlab
        cfg = neuron_transport({}, __import__("os").environ)
        rt = RealNeuronRuntime()
        rt.init()
        slab = NeuronSlab(runtime=rt, num_layers=4, num_heads=2, head_dim=128, num_blocks=64)
        slab.bind_thread()
        transport = NixlTransport("hw-reg", cfg, progress_thread=False)
        transport.register(slab.registration_regions(), slab.layout().mem_type)
        print(json.dumps({"mem_type": slab.layout().mem_type, "regions": len(slab.registration_regions())}))
    """)
    assert out == {"mem_type": "VRAM", "regions": 8}


def test_two_process_push_between_chips_over_efa():
    """Producer on core 0 (chip 0), consumer on core 4 (chip 1): one push, every block compared."""
    from kvpush_neuron.hwcheck import run_pair

    out = run_pair(sim=False, cores=(0, 4), timeout=300)
    assert out["producer"]["outcome"] == "done", out
    assert out["consumer"]["ok"] and out["consumer"]["mismatched_blocks"] == [], out
    assert out["consumer"]["mem_type"] == "VRAM"
