"""atheris (libFuzzer) driver for the fuzz targets in fuzz_targets.py.

    python tests/chaos/fuzz_atheris.py TARGET [libFuzzer flags, e.g. -runs=100000 -rss_limit_mb=1024]

TARGET is one of wire, handshake, router, registrations.  A crash (any exception other than the
target's expected refusals), a leak past -rss_limit_mb or a hang past -timeout fails the run.
"""

import os
import sys

import atheris  # noqa: E402
import logging  # noqa: E402

logging.disable(logging.CRITICAL)  # refusals are logged per input: quiet, or the log dwarfs the run

with atheris.instrument_imports():
    import fuzz_targets  # noqa: E402


def seed_corpus(name: str) -> str:
    """Valid inputs to start from (msgpack bodies get framed and signed by the targets)."""
    import tempfile

    import msgspec

    from kvpush_common.protocol.wire import Heartbeat, KeyRef, Register, WriteDone

    d = tempfile.mkdtemp(prefix=f"kvpush-fuzz-{name}-")
    msgs = [Register(transfer_id="t", attempt=0, consumer_engine="D", consumer_rank=0, consumer_tp=1,
                     block_ids=[2, 3], first_token=0, num_tokens=8, ttl_ms=1000),
            Heartbeat(consumer_engine="D", consumer_rank=0, keys=[KeyRef("t", 0)]),
            WriteDone(transfer_id="t", attempt=0, producer_engine="P", producer_rank=0, nbytes=8, num_descs=1)]
    if name == "handshake":
        fuzz_targets.handshake(b"")
        msgs = [fuzz_targets._P.local_hello()]
    seeds = [msgspec.msgpack.encode(m) for m in msgs] + [fuzz_targets.SIGNED.encode(m) for m in msgs]
    if name == "router":
        seeds = [b'{"model": "tiny", "prompt": "a", "stream": true, "kv_transfer_params": {"kvpush": "decode", '
                 b'"transfer_id": "t", "attempt": 0, "producer": {"engine_id": "P", "host": "h", "port": 1, '
                 b'"tp_size": 1}}}', b'{"choices": [], "kv_transfer_params": {"kvpush_identity": {}}}']
    for i, seed in enumerate(seeds):
        with open(os.path.join(d, f"seed{i}"), "wb") as f:
            f.write(seed)
    return d


def main() -> None:
    name = sys.argv[1]
    target = fuzz_targets.TARGETS[name]
    flags = sys.argv[2:]
    if not any(not f.startswith("-") for f in flags):  # no corpus given: start from valid inputs
        flags.append(seed_corpus(name))
    atheris.Setup([sys.argv[0]] + flags, target)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
