"""Plots of an engine_loop.py result: TTFT and TPOT vs load per input length, and timeline bars.

    python3 -m scripts.bench.handoff.plot_engine_loop docs/benchmarks/h200.json --out docs/benchmarks/h200
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"push": "tab:green", "kvpush-pull": "tab:blue", "vllm-pull": "tab:red"}


def load_plot(points: list[dict], metric: str, label: str, out: Path, block_size: int) -> None:
    lengths = sorted({p["tokens"] for p in points if p["block_size"] == block_size})
    fig, axes = plt.subplots(1, len(lengths), figsize=(3.3 * len(lengths), 3.2), squeeze=False)
    for ax, tokens in zip(axes[0], lengths):
        for mode, color in COLORS.items():
            pts = sorted((p for p in points if p["mode"] == mode and p["tokens"] == tokens
                          and p["block_size"] == block_size), key=lambda p: p["rate"])
            if not pts:
                continue
            x = [p["rate"] for p in pts]
            ax.plot(x, [p[f"{metric}_p50"] for p in pts], "-o", color=color, label=f"{mode} p50", ms=3)
            ax.plot(x, [p[f"{metric}_p99"] for p in pts], "--", color=color, label=f"{mode} p99", lw=1)
        ax.set_title(f"{tokens // 1024}k tokens")
        ax.set_xlabel("QPS")
        ax.set_yscale("log")
    axes[0][0].set_ylabel(label)
    axes[0][-1].legend(fontsize=6)
    fig.suptitle(f"{label} vs load, block size {block_size} (H200 pair, Qwen3-32B TP=8 rank)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


STAGES = [("prefill_start", "prefill_done", "prefill", "tab:gray"),
          ("prefill_done", "kv_usable", "handoff", "tab:orange"),
          ("kv_usable", "generation_start", "wait for step", "tab:purple"),
          ("generation_start", "first_token", "first decode step", "tab:green")]


def timeline_plot(points: list[dict], out: Path, tokens: int, block_size: int) -> None:
    rows = []
    for mode in COLORS:
        pts = [p for p in points if p["mode"] == mode and p["tokens"] == tokens and p["block_size"] == block_size]
        if pts:
            top = max(pts, key=lambda p: p["rate"])
            rows += [(f"{mode} #{i}", t) for i, t in enumerate(top["timelines"])]
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(rows) + 1.2))
    for y, (name, t) in enumerate(rows):
        ax.barh(y, t.get("prefill_start", 0), left=0, color="whitesmoke", edgecolor="lightgray")
        for a, b, label, color in STAGES:
            if a in t and b in t:
                ax.barh(y, t[b] - t[a], left=t[a], color=color, label=label if y == 0 else None)
        if "decode_registered" in t:
            ax.plot([t["decode_registered"]], [y], "k|", ms=10)
    ax.set_yticks(range(len(rows)), [r[0] for r in rows], fontsize=7)
    ax.set_xlabel("ms since arrival (| = decode blocks registered / READ posted)")
    ax.set_xscale("symlog", linthresh=10)
    ax.invert_yaxis()
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title(f"First requests at the most loaded {tokens // 1024}k point, block size {block_size}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("result")
    ap.add_argument("--out", required=True, help="file name prefix for the PNGs")
    args = ap.parse_args()
    doc = json.loads(Path(args.result).read_text())
    points = [p for r in doc["results"] for p in r["points"]]
    prefix = Path(args.out)
    bs = min(p["block_size"] for p in points)
    load_plot(points, "ttft_ms", "TTFT (ms)", prefix.with_name(prefix.name + "-ttft.png"), bs)
    load_plot(points, "tpot_ms", "TPOT (ms)", prefix.with_name(prefix.name + "-tpot.png"), bs)
    timeline_plot(points, prefix.with_name(prefix.name + "-timeline.png"), max(p["tokens"] for p in points), bs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
