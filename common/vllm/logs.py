"""kvpush's log lines in vLLM's server log.

vLLM configures only its own `vllm` logger (handler, format, level) and leaves the root logger alone,
so records of `kvpush_common.*`, `kvpush_cuda.*` and `kvpush_neuron.*` (failed sends, handshakes,
refusals) reached no handler but Python's last-resort one: warnings as bare text, info not at all.
"""

from __future__ import annotations

import logging

PACKAGES = ("kvpush_common", "kvpush_cuda", "kvpush_neuron")


def share_vllm_handlers(source: str = "vllm") -> bool:
    """Give kvpush's package loggers the handlers and level of vLLM's logger, once per process (a process
    runs a scheduler-side and a worker-side connector).  False (nothing changed) when vLLM's logger has no
    handler (VLLM_CONFIGURE_LOGGING=0: the application configured logging itself) or a package logger
    already has handlers of its own."""
    vllm_logger = logging.getLogger(source)
    if not vllm_logger.handlers:
        return False
    changed = False
    for name in PACKAGES:
        ours = logging.getLogger(name)
        if ours.handlers:
            continue
        for handler in vllm_logger.handlers:
            ours.addHandler(handler)
        ours.setLevel(vllm_logger.level or logging.INFO)
        ours.propagate = False  # vLLM's handlers print it; the root logger would print it twice if configured
        changed = True
    return changed
