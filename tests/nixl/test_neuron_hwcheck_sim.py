"""The trn2 smoke check (`python -m kvpush_neuron.hwcheck pair`) run here on the simulated Neuron runtime:
two processes, NIXL UCX, every block verified.  On a trn2 host: tests/hw/test_neuron_hw.py."""


def test_hwcheck_pair_pushes_and_verifies_on_the_simulated_runtime():
    from kvpush_neuron.hwcheck import run_pair

    out = run_pair(sim=True)
    assert out["producer"] == {"role": "producer", "outcome": "done", "reason": ""}
    assert out["consumer"]["ok"] and out["consumer"]["mismatched_blocks"] == []
    assert out["consumer"]["mem_type"] == "DRAM"
