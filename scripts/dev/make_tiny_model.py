"""Make a small random-weight Llama model and its tokenizer locally (nothing is downloaded).

Deterministic by seed: the tokenizer is a byte-level BPE trained on Python's own standard-library
sources (sorted, first 200 files), the weights come from torch's seeded generator.  A different
seed gives the same shapes and tokenizer with other weights (the control in the vLLM tests).

    python scripts/dev/make_tiny_model.py OUT_DIR [--seed 0]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvpush_common.testing.tokenizer import train_tokenizer


def make_model(out: Path, seed: int, vocab: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
                      initializer_range=0.2, bos_token_id=0, eos_token_id=1, pad_token_id=2,
                      tie_word_embeddings=False, torch_dtype="bfloat16")
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=1024)
    args = ap.parse_args()
    out = Path(args.out)
    stamp = out / "kvpush-tiny.json"
    want = {"seed": args.seed, "vocab": args.vocab, "version": 1}
    if stamp.exists() and json.loads(stamp.read_text()) == want:
        print(f"{out}: up to date")
        return
    out.mkdir(parents=True, exist_ok=True)
    train_tokenizer(out, args.vocab)
    make_model(out, args.seed, args.vocab)
    stamp.write_text(json.dumps(want))
    print(f"{out}: tiny Llama (seed {args.seed}) and tokenizer written")


if __name__ == "__main__":
    main()
