"""The one small interface kvpush needs from NIXL, and its real implementation.

Only the worker thread of an endpoint calls a Transport (NIXL agents are not documented as
thread-safe).  Descriptors are (N, 3) uint64 arrays `[addr, length, device_id]`.  NIXL's own
`get_serialized_descs` pickles; nothing here serialises descriptors: peers exchange layouts in the
msgspec handshake and each side builds the remote descriptors itself.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np

from kvpush_common.transport.fabric_start import note_libfabric_backend

Backend = Literal["UCX", "LIBFABRIC"]
XferState = Literal["DONE", "PROC", "ERR"]


class TransportError(RuntimeError):
    """A NIXL call failed; the message names the call and NIXL's error."""


@dataclass(frozen=True)
class TransportConfig:
    """NIXL agent settings.  NIXL's progress thread follows from the backend (`progress_thread_for`).

    NIXL 1.5.1's progress thread busy-spins a full core (pthrDelay=0).  UCX over cma/shm/RDMA makes
    progress inside our own polling calls, so it is off.  LIBFABRIC's passive target (the side that
    is written into) needs it to make progress; the active side does not.
    """

    backend: Backend = "UCX"
    num_threads: int = 0
    backend_params: dict[str, str] = field(default_factory=dict)

    def progress_thread_for(self, role: Literal["producer", "consumer"], mode: Literal["push", "pull"] = "push") -> bool:
        if self.backend == "UCX":
            return False
        # LIBFABRIC: the side that is the target of one-sided operations needs passive progress.
        target = "consumer" if mode == "push" else "producer"
        return role == target

    def init_params(self) -> dict[str, str]:
        params = {k: str(v) for k, v in self.backend_params.items()}
        if self.num_threads:
            params.setdefault("num_threads", str(self.num_threads))
        return params


class Transport(Protocol):
    name: str

    def register(self, regions: np.ndarray, mem_type: str) -> object: ...
    def deregister(self, handle: object) -> None: ...
    def metadata(self) -> bytes: ...
    def add_peer(self, metadata: bytes) -> str: ...
    def remove_peer(self, name: str) -> None: ...
    def post(self, op: Literal["WRITE", "READ"], peer: str, local: np.ndarray, remote: np.ndarray,
             mem_type: str, remote_mem_type: str, notif: bytes) -> object: ...
    def prep(self, peer: str | None, descs: np.ndarray, mem_type: str) -> object: ...
    def post_prepped(self, op: Literal["WRITE", "READ"], local: object, local_idx: np.ndarray, remote: object,
                     remote_idx: np.ndarray, notif: bytes) -> object: ...
    def release_prepped(self, handle: object) -> None: ...
    def state(self, handle: object) -> XferState: ...
    def release(self, handle: object) -> bool: ...
    def send_notif(self, peer: str, msg: bytes) -> None: ...
    def get_notifs(self) -> dict[str, list[bytes]]: ...
    def close(self) -> None: ...


def _quiet_ucx_env() -> None:
    # The wheel's UCX loads libuct_ib when ibverbs-providers is installed, which crashes at exit
    # (duplicate libnl-route-3); kvpush never uses IB verbs through UCX on hosts without RDMA NICs.
    if not os.path.exists("/sys/class/infiniband") or not os.listdir("/sys/class/infiniband"):
        os.environ.setdefault("UCX_MODULES", "^ib")


# The NIXL release kvpush installs where nothing else pins one (its own venv, the CUDA target; scripts read it
# from here).  The `nixl` meta wheel requires both CUDA variants, so it goes in with --no-deps beside the CUDA 13
# build.  Where a platform pins its own NIXL (the vLLM Neuron plugin: nixl==1.3.2), kvpush uses that one and
# installs nothing over it: every call below is the same in 1.3.2 and 1.5.1 (their nixl/_api.py compared).
NIXL_VERSION = "1.5.1"
NIXL_TESTED = ("1.3.2", NIXL_VERSION)  # the releases kvpush's tests run on (1.3.2: tests/libfabric, SDK pair)
# Backends whose release of a running transfer does not stop its bytes: LIBFABRIC cancels nothing (NIXL
# source); UCX cancels its requests, yet bytes already handed to the wire or copied land anyway, up to a few
# hundred ms after release over tcp.  So no running transfer is released.
UNCANCELLABLE = ("LIBFABRIC", "UCX")
NIXL_INSTALL = f"pip install --no-deps nixl=={NIXL_VERSION} nixl-cu13=={NIXL_VERSION}"


class NixlTransport:
    """A NIXL agent with one backend."""

    def __init__(self, name: str, config: TransportConfig, *, progress_thread: bool = False):
        _quiet_ucx_env()
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as e:  # pragma: no cover - nixl is a hard dependency
            raise TransportError(f"nixl is not installed: {NIXL_INSTALL}") from e
        self.name = name
        self.config = config
        conf = nixl_agent_config(enable_prog_thread=progress_thread, enable_listen_thread=False, backends=[])
        self._agent = nixl_agent(name, conf)
        if config.backend == "LIBFABRIC":
            note_libfabric_backend(self._agent)
        try:
            self._agent.create_backend(config.backend, config.init_params())
        except Exception as e:
            raise TransportError(f"NIXL could not start backend {config.backend}: {e!r}") from e
        self._backends = [config.backend]
        self._regs: list[object] = []
        self.cpu_s = 0.0  # the calling thread's CPU time inside NIXL calls (thread clock), for the worker's metrics

    def _call(self, what: str, fn, *args, **kwargs):
        t0 = time.thread_time()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise TransportError(f"NIXL {what} failed: {type(e).__name__}: {e}") from e
        finally:
            self.cpu_s += time.thread_time() - t0

    def register(self, regions: np.ndarray, mem_type: str) -> object:
        descs = self._call("get_reg_descs", self._agent.get_reg_descs, np.ascontiguousarray(regions, dtype=np.uint64), mem_type)
        handle = self._call("register_memory", self._agent.register_memory, descs, backends=self._backends)
        if handle is None:
            raise TransportError(f"NIXL register_memory returned nothing for {len(regions)} {mem_type} regions")
        self._regs.append(handle)
        return handle

    def deregister(self, handle: object) -> None:
        self._call("deregister_memory", self._agent.deregister_memory, handle, backends=self._backends)
        self._regs.remove(handle)

    def metadata(self) -> bytes:
        return bytes(self._call("get_agent_metadata", self._agent.get_agent_metadata))

    def add_peer(self, metadata: bytes) -> str:
        name = self._call("add_remote_agent", self._agent.add_remote_agent, metadata)
        return name.decode() if isinstance(name, (bytes, bytearray)) else str(name)

    def remove_peer(self, name: str) -> None:
        self._call("remove_remote_agent", self._agent.remove_remote_agent, name)

    def post(self, op, peer, local, remote, mem_type, remote_mem_type, notif):
        ldescs = self._call("get_xfer_descs", self._agent.get_xfer_descs, np.ascontiguousarray(local, dtype=np.uint64), mem_type)
        rdescs = self._call("get_xfer_descs", self._agent.get_xfer_descs, np.ascontiguousarray(remote, dtype=np.uint64), remote_mem_type)
        handle = self._call("initialize_xfer", self._agent.initialize_xfer, op, ldescs, rdescs, peer, notif, backends=self._backends)
        return self._start(handle, f"transfer({op}) to {peer}")

    def _start(self, handle, what: str):
        """Post a created handle; on failure release it (nothing was sent) and raise."""
        t0 = time.thread_time()
        try:
            state = self._agent.transfer(handle)
        except Exception as e:
            self.release(handle)
            raise TransportError(f"NIXL {what} failed: {type(e).__name__}: {e}") from e
        finally:
            self.cpu_s += time.thread_time() - t0
        if state == "ERR":
            self.release(handle)
            raise TransportError(f"NIXL {what} returned ERR at post")
        return handle

    def prep(self, peer: str | None, descs: np.ndarray, mem_type: str) -> object:
        """Prepare a descriptor list once (peer None: our own memory); index it per request."""
        return self._call("prep_xfer_dlist", self._agent.prep_xfer_dlist, peer or "NIXL_INIT_AGENT",
                          np.ascontiguousarray(descs, dtype=np.uint64), mem_type, backends=self._backends)

    def post_prepped(self, op, local, local_idx, remote, remote_idx, notif):
        handle = self._call("make_prepped_xfer", self._agent.make_prepped_xfer, op, local, local_idx, remote,
                            remote_idx, notif, backends=self._backends)
        return self._start(handle, f"transfer({op}) of prepped lists")

    def release_prepped(self, handle) -> None:
        self._call("release_dlist_handle", self._agent.release_dlist_handle, handle)

    def state(self, handle) -> XferState:
        return self._call("check_xfer_state", self._agent.check_xfer_state, handle)

    def release(self, handle) -> bool:
        """False when the transfer may still move bytes after this call: the caller keeps polling it.

        NIXL 1.5.1's LIBFABRIC backend cancels nothing on release (`releaseReqH` deletes the request while
        its posted fi_write/fi_read may still complete); UCX cancels its requests, but measured bytes still
        land after the release.  So a running transfer is never released: it is kept until DONE or ERR, and
        the endpoint reports nothing about its memory until then."""
        if self.config.backend in UNCANCELLABLE:
            try:
                if self._agent.check_xfer_state(handle) == "PROC":
                    return False
            except Exception:
                pass  # ERR: released below
        try:
            self._agent.release_xfer_handle(handle)
            return True
        except Exception:
            return False

    def send_notif(self, peer: str, msg: bytes) -> None:
        self._call("send_notif", self._agent.send_notif, peer, msg)

    def get_notifs(self) -> dict[str, list[bytes]]:
        raw = self._call("get_new_notifs", self._agent.get_new_notifs)
        return {(k.decode() if isinstance(k, bytes) else k): list(v) for k, v in raw.items()}

    def close(self) -> None:
        for handle in list(self._regs):
            try:
                self.deregister(handle)
            except TransportError:
                pass
