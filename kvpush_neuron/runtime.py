"""The device interface: every Neuron runtime call kvpush makes, behind one protocol.

`RealNeuronRuntime` works on torch's `neuron` device as the vLLM Neuron plugin's stack provides it:
PyTorch's PrivateUse1 backend renamed `neuron` by `libtorch_neuronx_lite` (the plugin's dependency in
Neuron SDK 2.32-2.34) or by the native `torch_neuronx` (TorchNeuron, >= 2.13, from SDK 2.33).  It
imports neither when the device is already there (inside the plugin's worker it is); a KV tensor's
address is its `data_ptr()`, as the plugin's own NIXL connector registers it.  `SimulatedNeuronRuntime`
keeps "HBM" in host memory with the same shapes and strides and enforces the documented rules, so the
backend's start-up checks and the conformance suite run on CPU.  Sources: docs/neuron.md.
"""

from __future__ import annotations

import importlib
import os
import time
from typing import Literal, MutableMapping, Protocol

import numpy as np

from kvpush_common.device.ranges import parse_range
from kvpush_common.transport.fabric_start import libfabric_started_at

MemKind = Literal["NEURON", "SYSTEM"]


class NeuronUnavailableError(RuntimeError):
    """The real Neuron runtime cannot be used in this process (torch has no `neuron` device here)."""


# The packages that register torch's `neuron` device, in the order the plugin's stack ships them.
# torch-neuronx 2.9 (PyTorch/XLA, SDK <= 2.31) registers no such device: its tensors have no HBM address.
NEURON_DEVICE_PROVIDERS = ("libtorch_neuronx_lite", "torch_neuronx")


def neuron_device_registered(torch) -> bool:
    """torch's PrivateUse1 backend is the `neuron` device (what both providers register)."""
    try:
        return torch._C._get_privateuse1_backend_name() == "neuron"
    except (AttributeError, RuntimeError):
        return False


def ensure_neuron_device(torch, importer=importlib.import_module) -> str:
    """Which package registered torch's `neuron` device: "already" when it was there before kvpush looked
    (the plugin imports its provider first), else the first provider whose import registers it."""
    if neuron_device_registered(torch):
        return "already"
    tried = []
    for module in NEURON_DEVICE_PROVIDERS:
        try:
            importer(module)
        except ImportError as e:
            tried.append(f"{module}: {e}")
            continue
        if neuron_device_registered(torch):
            return module
        tried.append(f"{module}: imported, but torch has no `neuron` device after it (not the native backend)")
    raise NeuronUnavailableError(
        "the Neuron runtime is not available here: torch has no `neuron` device (" + "; ".join(tried) + "). "
        "kvpush_neuron runs inside the vLLM Neuron plugin's environment on a trn2/trn3 host, where "
        "libtorch-neuronx-lite (Neuron SDK 2.32-2.34) or torch-neuronx >= 2.13 (TorchNeuron, SDK >= 2.33) "
        "provides that device; on CPU use kvpush_common.vllm.connector.KVPushConnector")


class NeuronRuntimeError(RuntimeError):
    """A documented Neuron runtime rule was broken (the simulation raises what the real stack would)."""


def map_hbm_enabled(env) -> bool:
    """NEURON_RT_MAP_HBM is "true" or a positive number (what the runtime accepts)."""
    value = str(env.get("NEURON_RT_MAP_HBM", "")).strip().lower()
    return value == "true" or (value.isdigit() and int(value) > 0)


# "0-3", "32-63", "0,2,4-5" -> core ids (NEURON_VISIBLE_DEVICES / NEURON_RT_VISIBLE_CORES syntax)
parse_core_list = parse_range


def core_visibility_problem(env) -> str | None:
    """The one rule for choosing cores: the 0.2x plugin selects them with NEURON_VISIBLE_DEVICES and refuses
    NEURON_RT_VISIBLE_CORES from the user (its worker sets one core itself, next to the former)."""
    if env.get("NEURON_RT_VISIBLE_CORES") and not env.get("NEURON_VISIBLE_DEVICES"):
        return (f"NEURON_RT_VISIBLE_CORES={env['NEURON_RT_VISIBLE_CORES']} is set: the vLLM Neuron plugin (0.2x) "
                "refuses it; unset it and use NEURON_VISIBLE_DEVICES for the server's logical cores (e.g. 0-3)")
    return None


class NeuronRuntime(Protocol):
    """What kvpush needs from the Neuron runtime; nothing else touches torch-neuronx."""

    env: MutableMapping[str, str]

    @property
    def mem_type(self) -> Literal["DRAM", "VRAM"]:
        """NIXL memory type of device tensors: real HBM is "VRAM" (LIBFABRIC, FI_HMEM_NEURON); the
        simulation's host memory is "DRAM" because that is what NIXL UCX can move on a CPU host."""

    def is_initialized(self) -> bool: ...

    def init(self) -> None:
        """Initialise the runtime (maps HBM when NEURON_RT_MAP_HBM is set).  Before any NIXL agent."""

    def visible_devices(self) -> list[int]:
        """Logical cores from NEURON_VISIBLE_DEVICES (empty: not set)."""

    def allocate(self, nbytes: int, core: int = 0) -> tuple[object, int]:
        """A uint8 device tensor of `nbytes` on local device `core` and its address (0: HBM not mapped)."""

    def data_ptr(self, tensor) -> int:
        """Device VA of `tensor` for NIXL (0 when HBM is not mapped)."""

    def device_index(self, tensor) -> int: ...

    def claim_agent(self, core: int, owner: object) -> None:
        """Record that `owner` creates the one NIXL agent of local device `core`; a second owner raises."""

    def device_memory_kind(self) -> MemKind:
        """How libfabric will register device memory: "SYSTEM" if it was started in this process
        before the runtime was initialised (or before kvpush saw it initialised)."""

    def to_host(self, tensor) -> np.ndarray:
        """The bytes of a uint8 device tensor (a copy)."""

    def from_host(self, tensor, data: np.ndarray, offset: int = 0) -> None:
        """Write `data` into a uint8 device tensor at byte `offset` and wait for it."""

    def fence(self) -> object:
        """A token for the device work issued so far (None: nothing to wait for)."""

    def fence_done(self, token: object) -> bool: ...


class _AgentOrder:
    """libfabric picks its HMEM interfaces when the process first starts it: started before the
    runtime was initialised, it leaves FI_HMEM_NEURON out and HBM silently registers as host memory.
    The runtime's start is when `init()` or the first allocation ran here, or, for tensors the
    plugin's worker allocated, when kvpush first saw them (`adopt`): an upper bound, so libfabric
    started before that counts as too early, which it most likely was."""

    def __init__(self):
        self._initialized_at: float | None = None
        self._agents: dict[int, object] = {}

    def _mark_initialized(self) -> None:
        if self._initialized_at is None:
            self._initialized_at = time.monotonic()

    def is_initialized(self) -> bool:
        return self._initialized_at is not None

    def device_memory_kind(self) -> MemKind:
        started = libfabric_started_at()
        if started is not None and self._initialized_at is not None and started < self._initialized_at:
            return "SYSTEM"
        return "NEURON"

    def claim_agent(self, core: int, owner: object) -> None:
        held = self._agents.setdefault(core, owner)
        if held is not owner:
            raise NeuronRuntimeError(f"a NIXL agent already serves Neuron device {core} in this process: one agent "
                                     "per rank (one vLLM worker per logical core, one kvpush endpoint per worker)")

    def visible_devices(self) -> list[int]:
        return parse_core_list(self.env.get("NEURON_VISIBLE_DEVICES", ""))

    def fence(self) -> object:
        return None

    def fence_done(self, token: object) -> bool:
        return True


class SimulatedNeuronRuntime(_AgentOrder):
    """Host memory standing in for HBM, same tensor shapes; raises or returns what the real stack does:

    - `data_ptr()` is 0 unless NEURON_RT_MAP_HBM was set at the first allocation (latched then);
    - libfabric started (through NIXL) before `init()` makes `device_memory_kind()` "SYSTEM" (silent in reality);
    - `init()` refuses NEURON_RT_VISIBLE_CORES without NEURON_VISIBLE_DEVICES (the 0.2x plugin raises);
    - allocating before `init()` is refused;
    - device work runs asynchronously, in issue order, on the simulated device's one queue (`issue`): the plugin's
      compiled model writes the KV into HBM while the host goes on; `fence()` is a token for the work issued so
      far and `sync()` waits for all of it.
    """

    mem_type = "DRAM"

    def __init__(self, env: MutableMapping[str, str] | None = None):
        super().__init__()
        self.env = {} if env is None else env
        self._hbm_mapped: bool | None = None  # latched at the first allocation
        self._allocations: list[tuple[int, int]] = []
        self._keep: list[object] = []
        self._queue = None  # the simulated device's queue (one thread, started at the first issue)
        self._last = None  # the Future of the last work issued

    def init(self) -> None:
        problem = core_visibility_problem(self.env)
        if problem:
            raise NeuronRuntimeError(problem)
        self._mark_initialized()

    def allocate(self, nbytes: int, core: int = 0) -> tuple[object, int]:
        import torch

        if not self.is_initialized():
            raise NeuronRuntimeError("device allocation before the Neuron runtime was initialised")
        if self._hbm_mapped is None:
            self._hbm_mapped = map_hbm_enabled(self.env)
        tensor = torch.zeros(nbytes, dtype=torch.uint8)
        self._allocations.append((tensor.data_ptr(), nbytes))
        self._keep.append(tensor)
        return tensor, self.data_ptr(tensor)

    def data_ptr(self, tensor) -> int:
        ptr = tensor.data_ptr()
        if not any(a <= ptr < a + n for a, n in self._allocations):
            raise NeuronRuntimeError("tensor was not allocated by this (simulated) Neuron runtime")
        return ptr if self._hbm_mapped else 0

    def device_index(self, tensor) -> int:
        return 0

    def issue(self, work) -> object:
        """Run `work()` on the simulated device's queue, after everything issued before it; returns its Future."""
        if self._queue is None:
            from concurrent.futures import ThreadPoolExecutor

            self._queue = ThreadPoolExecutor(1, thread_name_prefix="sim-neuron-device")
        self._last = self._queue.submit(work)
        return self._last

    def fence(self) -> object:
        return self._last

    def fence_done(self, token: object) -> bool:
        return token is None or token.done()

    def sync(self) -> None:
        """Wait for every piece of device work issued so far (raising what it raised)."""
        if self._last is not None:
            self._last.result()

    def to_host(self, tensor) -> np.ndarray:
        return tensor.numpy().copy()

    def from_host(self, tensor, data: np.ndarray, offset: int = 0) -> None:
        import torch

        tensor[offset:offset + data.size].copy_(torch.from_numpy(np.ascontiguousarray(data, dtype=np.uint8)))


class RealNeuronRuntime(_AgentOrder):
    """torch's `neuron` device as the vLLM Neuron plugin's stack provides it (see the module docstring).

    Only `neuron` device tensors are accepted: XLA-device tensors have no documented data_ptr and
    VLLM_NEURON_CPU_MODE tensors are host memory (use KVPushConnector for those).
    """

    mem_type = "VRAM"

    def __init__(self, env: MutableMapping[str, str] | None = None, *, importer=importlib.import_module):
        super().__init__()
        self.env = os.environ if env is None else env
        import torch

        self.provider = ensure_neuron_device(torch, importer)
        self._torch = torch

    def init(self) -> None:
        """What vllm-neuron's worker does before KV transfer starts (maps HBM for RDMA): the standalone
        smoke check calls it; inside vLLM the worker has already, and `adopt` records that."""
        if not self.is_initialized():
            runtime_cls = getattr(getattr(self._torch.classes, "neuron", None), "Runtime", None)
            if runtime_cls is None:
                raise NeuronUnavailableError(f"torch.classes.neuron.Runtime is missing (`neuron` device from "
                                             f"{self.provider}): install the Neuron SDK's runtime stack")
            runtime_cls().initialize()
            self._mark_initialized()

    def adopt(self, tensor) -> None:
        """Tensors already on the device prove the runtime was initialised (by the plugin's worker)."""
        self._check_device(tensor)
        self._mark_initialized()

    def allocate(self, nbytes: int, core: int = 0) -> tuple[object, int]:
        tensor = self._torch.zeros(nbytes, dtype=self._torch.uint8, device=f"neuron:{core}")
        self._mark_initialized()
        return tensor, self.data_ptr(tensor)

    def _check_device(self, tensor) -> None:
        if tensor.device.type != "neuron":
            raise NeuronRuntimeError(f"KV tensor is on device {tensor.device}, not a Neuron device: kvpush_neuron "
                                     "registers Neuron HBM only")

    def data_ptr(self, tensor) -> int:
        self._check_device(tensor)
        return int(tensor.data_ptr())

    def device_index(self, tensor) -> int:
        return tensor.device.index or 0

    def to_host(self, tensor) -> np.ndarray:
        return tensor.cpu().numpy().copy()

    def from_host(self, tensor, data: np.ndarray, offset: int = 0) -> None:
        src = self._torch.from_numpy(np.ascontiguousarray(data, dtype=np.uint8))
        tensor[offset:offset + data.size].copy_(src.to(tensor.device))
        tensor[offset:offset + 1].cpu()  # reading back waits for the copy (no documented device synchronize)
