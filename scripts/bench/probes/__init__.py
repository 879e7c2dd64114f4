"""One-question probes: each measures one thing and writes one JSON (rows in docs/benchmarks/README.md)."""
