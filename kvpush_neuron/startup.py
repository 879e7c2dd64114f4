"""Start-up rules of Neuron HBM transfers, checked in the order a worker starts, each naming its fix.

A Neuron worker that breaks one of them does not fail by itself: NIXL registers address 0, or
registers HBM as host memory, or the plugin picks other cores.  So kvpush checks before it registers.
"""

from __future__ import annotations

from .runtime import NeuronRuntime, core_visibility_problem, map_hbm_enabled


class NeuronStartupError(RuntimeError):
    pass


def check_launch_env(env) -> None:
    """1. Launch: cores are chosen with NEURON_VISIBLE_DEVICES (`core_visibility_problem`)."""
    problem = core_visibility_problem(env)
    if problem:
        raise NeuronStartupError(problem)


def check_runtime_ready(runtime: NeuronRuntime) -> None:
    """2. The Neuron runtime is initialised, and no NIXL agent was created before it was."""
    if not runtime.is_initialized():
        raise NeuronStartupError(
            "the Neuron runtime is not initialised: initialise it (torch.classes.neuron.Runtime().initialize(), as "
            "vllm-neuron's worker does) before creating the NIXL agent, else FI_HMEM_NEURON is missing")
    if runtime.device_memory_kind() != "NEURON":
        raise NeuronStartupError(
            "libfabric was started in this process (a NIXL agent with a LIBFABRIC backend, kvpush's or another "
            "component's) before the Neuron runtime was initialised, or before kvpush saw it initialised: libfabric "
            "then registers Neuron HBM as host memory (FI_HMEM_SYSTEM) without an error; initialise the runtime "
            "before any NIXL agent and let kvpush's connector create the worker's only agent (restart the worker)")


def check_hbm_mapped(runtime: NeuronRuntime, addresses: list[int]) -> None:
    """3. Every KV tensor has a device VA: data_ptr() is 0 unless NEURON_RT_MAP_HBM was set before the
    first device allocation (NIXL would then fail with "Failed to retrieve placement for VA: (nil)")."""
    if all(addresses):
        return
    when = ("is set now but was not at the first device allocation" if map_hbm_enabled(runtime.env)
            else "is not set")
    raise NeuronStartupError(
        f"Neuron KV tensors have data_ptr() == 0: NEURON_RT_MAP_HBM {when}; set NEURON_RT_MAP_HBM=1 in the "
        "environment before the first Neuron device allocation (vllm-neuron's worker sets it)")
