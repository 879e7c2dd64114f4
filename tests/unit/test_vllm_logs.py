"""kvpush's loggers print through vLLM's handlers (common/vllm/logs.py)."""

from __future__ import annotations

import logging

from kvpush_common.vllm.logs import PACKAGES, share_vllm_handlers


class Collect(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def _reset(*names):
    for name in names:
        lg = logging.getLogger(name)
        lg.handlers.clear()
        lg.setLevel(logging.NOTSET)
        lg.propagate = True


def test_kvpush_records_reach_the_engines_handler_once():
    names = (*PACKAGES, "fake_vllm", "own_app")
    _reset(*names)
    try:
        assert share_vllm_handlers("fake_vllm") is False  # the engine configured no logging: leave ours alone
        seen = Collect()
        logging.getLogger("fake_vllm").addHandler(seen)
        logging.getLogger("fake_vllm").setLevel(logging.INFO)
        assert share_vllm_handlers("fake_vllm") is True
        assert share_vllm_handlers("fake_vllm") is False  # the second connector in a process adds nothing
        logging.getLogger("kvpush_common.endpoint.consumer").info("handshake with %s", "p0")
        logging.getLogger("kvpush_cuda.connector").warning("layout")
        logging.getLogger("kvpush_common.x").debug("below the engine's level")
        assert [r.getMessage() for r in seen.records] == ["handshake with p0", "layout"]
        assert logging.getLogger("kvpush_common").handlers == [seen]
    finally:
        _reset(*names)
