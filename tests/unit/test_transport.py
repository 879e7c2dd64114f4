"""Transport configuration (incl. the LIBFABRIC path that cannot run here) and the fault wrapper."""

import numpy as np
import pytest

from kvpush_common.testing.faults import FaultPlan, FaultyTransport
from kvpush_common.transport.nixl import NixlTransport, TransportConfig, TransportError


def test_progress_thread_defaults_follow_measurements():
    ucx = TransportConfig(backend="UCX")
    assert not ucx.progress_thread_for("producer") and not ucx.progress_thread_for("consumer")
    lf = TransportConfig(backend="LIBFABRIC")
    # push: the consumer is the passive WRITE target; pull: the producer is the READ target
    assert lf.progress_thread_for("consumer", "push") and not lf.progress_thread_for("producer", "push")
    assert lf.progress_thread_for("producer", "pull") and not lf.progress_thread_for("consumer", "pull")


def test_init_params_carry_threads_and_backend_params():
    cfg = TransportConfig(backend="LIBFABRIC", num_threads=4, backend_params={"striping_threshold": 131072})
    assert cfg.init_params() == {"striping_threshold": "131072", "num_threads": "4"}
    assert TransportConfig(num_threads=2, backend_params={"num_threads": "8"}).init_params() == {"num_threads": "8"}


def test_libfabric_without_a_usable_libfabric_fails_with_a_clear_error():
    """This machine has no libfabric exporting FABRIC_1.10: creation must fail loudly, naming the backend."""
    with pytest.raises(TransportError, match="LIBFABRIC"):
        NixlTransport("lf-probe", TransportConfig(backend="LIBFABRIC"))


def test_ucx_agent_registers_and_exports_metadata():
    t = NixlTransport("ucx-probe", TransportConfig())
    buf = np.zeros(1 << 16, dtype=np.uint8)
    h = t.register(np.array([[buf.ctypes.data, buf.nbytes, 0]], dtype=np.uint64), "DRAM")
    md = t.metadata()
    assert isinstance(md, bytes) and len(md) > 100
    t.deregister(h)
    t.close()


class FakeInner:
    """Records calls; stands in for NIXL only inside the wrapper's own unit tests."""

    name = "fake"

    def __init__(self):
        self.queue: dict[str, list[bytes]] = {}
        self.posts = []

    def get_notifs(self):
        out, self.queue = self.queue, {}
        return out

    def post(self, *args):
        self.posts.append(args)
        return ("h", len(self.posts))

    def state(self, h):
        return "DONE"

    def release(self, h):
        return True


def _args():
    z = np.zeros((1, 3), dtype=np.uint64)
    return ("WRITE", "peer", z, z, "DRAM", "DRAM", b"n")


def test_fault_wrapper_drop_dup_delay_reorder():
    clock = [0.0]
    inner = FakeInner()
    ft = FaultyTransport(inner, FaultPlan(drop_notif=1.0), clock=lambda: clock[0])
    inner.queue = {"a": [b"1", b"2"]}
    assert ft.get_notifs() == {} and ft.counts["drop"] == 2

    ft = FaultyTransport(inner, FaultPlan(dup_notif=1.0), clock=lambda: clock[0])
    inner.queue = {"a": [b"1"]}
    assert ft.get_notifs() == {"a": [b"1", b"1"]}

    ft = FaultyTransport(inner, FaultPlan(delay_notif=1.0, delay_s=(1.0, 1.0)), clock=lambda: clock[0])
    inner.queue = {"a": [b"1"]}
    assert ft.get_notifs() == {}
    clock[0] = 2.0
    assert ft.get_notifs() == {"a": [b"1"]}

    ft = FaultyTransport(inner, FaultPlan(reorder_notif=1.0, match=lambda m: m == b"1"), clock=lambda: clock[0])
    inner.queue = {"a": [b"1", b"2"]}
    assert ft.get_notifs() == {"a": [b"2", b"1"]}  # the held message comes after a later one


def test_fault_wrapper_post_faults():
    clock = [0.0]
    inner = FakeInner()
    with pytest.raises(TransportError, match="injected"):
        FaultyTransport(inner, FaultPlan(fail_post=1.0)).post(*_args())
    ft = FaultyTransport(inner, FaultPlan(err_xfer=1.0))
    h = ft.post(*_args())
    assert ft.state(h) == "ERR" and ft.release(h) and inner.posts == []

    ft = FaultyTransport(inner, FaultPlan(post_delay_s=1.0), clock=lambda: clock[0])
    h = ft.post(*_args())
    assert ft.state(h) == "PROC" and not ft.release(h) and inner.posts == []  # held: not cancellable
    clock[0] = 1.5
    assert ft.state(h) == "DONE" and len(inner.posts) == 1 and ft.release(h)
