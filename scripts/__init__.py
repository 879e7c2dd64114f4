"""The repository's scripts, a package so that the benchmarks under scripts/bench import each other by package
name (`from scripts.bench.handoff.kvslab import ...`).  Run them from the repository root with `python3 -m`."""
