"""The worker thread's timed waits end when asked: its timer slack is set to 1 us (Linux), in that thread only."""

import ctypes
import threading

from kvpush_common.endpoint.base import WORKER_TIMER_SLACK_NS, tighten_timer_slack

_PR_GET_TIMERSLACK = 30


def test_timer_slack_is_set_for_the_calling_thread_only():
    libc = ctypes.CDLL(None, use_errno=True)
    before = libc.prctl(_PR_GET_TIMERSLACK, 0, 0, 0, 0)
    seen = {}

    def worker():
        seen["set"] = tighten_timer_slack()
        seen["slack"] = libc.prctl(_PR_GET_TIMERSLACK, 0, 0, 0, 0)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == {"set": True, "slack": WORKER_TIMER_SLACK_NS}
    assert libc.prctl(_PR_GET_TIMERSLACK, 0, 0, 0, 0) == before  # this thread keeps its own
