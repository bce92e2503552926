"""Peak memory of one ablation pass (`response_logit_probs`, 8 sequences of 768 tokens, one batch) on a random Llama
with 32 heads, eager attention against the memory-efficient attention the pass now runs, each in a fresh process
(peak resident memory over the model's). Usage: python bench/ablation_memory.py [--n 768] [--heads 32]."""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # this checkout's ctxmix, not an installed one
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def child(attn: str, n: int, heads: int) -> dict:
    import numpy as np
    import torch
    import transformers as T

    import ctxmix
    from ctxmix.methods.context.ablation import response_logit_probs

    torch.manual_seed(0)
    cfg = T.LlamaConfig(
        vocab_size=1024,
        hidden_size=8 * heads,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        intermediate_size=16 * heads,
        max_position_embeddings=2 * n,
    )
    hf = T.LlamaForCausalLM._from_config(cfg, attn_implementation="eager").eval()
    tok = T.AutoTokenizer.from_pretrained(ctxmix.engine.embedded.minilm_path())
    model = dataclasses.replace(ctxmix.model_from_hf(hf, tok), output_attention=attn)
    g = np.random.RandomState(0)
    prompts = [g.randint(0, 1024, n - 8 - i).tolist() for i in range(8)]
    response = g.randint(0, 1024, 8).tolist()
    response_logit_probs(model, prompts[:1], response, batch_size=8)  # warm up at a small size
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    lp = response_logit_probs(model, prompts, response, batch_size=8)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"attn": attn, "n": n, "heads": heads, "extra_mb": (peak - before) / 1024, "value": float(lp.sum())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=768)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--child", default=None)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.n, a.heads)))
        return
    for attn in ("eager", "sdpa"):
        cmd = [sys.executable, __file__, "--child", attn, "--n", str(a.n), "--heads", str(a.heads)]
        print(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
