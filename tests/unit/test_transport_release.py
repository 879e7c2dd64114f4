"""Issue 16 item 4: a running transfer is released only where releasing stops it.  NIXL 1.5.1's LIBFABRIC
backend deletes the request on release without cancelling its posted operations, so a running LIBFABRIC
transfer is kept (release says False) and polled until it ends; UCX cancels its requests first."""

from kvpush_common.transport.nixl import NixlTransport, TransportConfig


class Agent:
    def __init__(self, state):
        self.state, self.released = state, []

    def check_xfer_state(self, handle):
        return self.state

    def release_xfer_handle(self, handle):
        self.released.append(handle)


def transport(backend, state):
    t = NixlTransport.__new__(NixlTransport)  # no real agent: only release() is under test
    t.config, t._agent = TransportConfig(backend=backend), Agent(state)
    return t


def test_a_running_libfabric_transfer_is_never_released():
    t = transport("LIBFABRIC", "PROC")
    assert t.release("h") is False and t._agent.released == []
    t._agent.state = "DONE"
    assert t.release("h") is True and t._agent.released == ["h"]


def test_a_running_ucx_transfer_is_never_released_either():
    """UCX cancels its requests on release, yet bytes kept landing up to 0.3 s later (release_window.py)."""
    t = transport("UCX", "PROC")
    assert t.release("h") is False and t._agent.released == []


def test_ended_transfers_are_released():
    for backend, state in (("LIBFABRIC", "ERR"), ("LIBFABRIC", "DONE"), ("UCX", "ERR"), ("UCX", "DONE")):
        t = transport(backend, state)
        assert t.release("h") is True and t._agent.released == ["h"], (backend, state)
