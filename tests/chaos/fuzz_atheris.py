"""atheris (libFuzzer) driver for the fuzz targets in fuzz_targets.py.

    python tests/chaos/fuzz_atheris.py TARGET [libFuzzer flags, e.g. -runs=100000 -rss_limit_mb=1024]

TARGET is one of wire, handshake, router, registrations.  A crash (any exception other than the
target's expected refusals), a leak past -rss_limit_mb or a hang past -timeout fails the run.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import atheris  # noqa: E402
import logging  # noqa: E402

logging.disable(logging.CRITICAL)  # refusals are logged per input: quiet, or the log dwarfs the run

with atheris.instrument_imports():
    import fuzz_targets  # noqa: E402


def main() -> None:
    name = sys.argv[1]
    target = fuzz_targets.TARGETS[name]
    atheris.Setup([sys.argv[0]] + sys.argv[2:], target)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
