"""Peak memory of the rows trace (`ctxmix.engine.rows.trace_rows`: the forward pass and every layer rebuilt at the
response rows) on a float32 random Llama (d 1,024, 8 heads, 2 layers, vocabulary 32,000) at 4,096 tokens, each
in a fresh process: the fast kernel's outputs and the response rows' probabilities (`rows`, what trace_rows runs),
against another checkout's trace_rows (`--old-root`, e.g. the commit whose rows trace ran each family's eager
function over blocks of every row, or the earlier one that ran eager attention over all rows). Peak resident
memory (VmHWM) over the process's resident memory before the trace, the model's size beside it.
Usage: python bench/rows_memory.py [--n 4096] [--heads 8] [--d 1024] [--old-root PATH]"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # this checkout's ctxmix, not an installed one


def _kib(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key))


def child(mode: str, root: str, n: int, heads: int, d: int) -> dict:
    sys.path.insert(0, root)
    import numpy as np
    import torch
    import transformers as T

    import ctxmix
    from ctxmix.engine import rows

    torch.manual_seed(0)
    cfg = T.LlamaConfig(
        vocab_size=32000,
        hidden_size=d,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        intermediate_size=4 * d,
        max_position_embeddings=n,
    )
    hf = T.LlamaForCausalLM._from_config(cfg, attn_implementation="eager").eval()
    model = ctxmix.model_from_hf(hf, T.AutoTokenizer.from_pretrained(ctxmix.engine.embedded.minilm_path()))
    ids = np.random.RandomState(0).randint(0, 32000, n).tolist()
    response = list(range(n - 33, n - 1))  # 32 response rows
    _ = rows.trace_rows(model, ids[:64], list(range(56, 63))).reconstruction_error  # warm up at a small size
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM from here on
    before = _kib("VmRSS")
    tr = rows.trace_rows(model, ids, response)
    err = tr.reconstruction_error  # every layer built
    peak = _kib("VmHWM")
    model_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    return {
        "mode": mode,
        "n": n,
        "extra_mib": (peak - before) / 1024,
        "model_mib": model_bytes / 2**20,
        "one_map_mib": heads * n * n * 4 / 2**20,
        "reconstruction_error": err,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--old-root", default=None)
    ap.add_argument("--child", default=None)
    ap.add_argument("--root", default=str(ROOT))
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.root, a.n, a.heads, a.d)))
        return
    runs = [("rows", str(ROOT))] + ([("old", a.old_root)] if a.old_root else [])
    print(f"{'path':<8} {'n':>6} {'peak over before (MiB)':>23} {'model (MiB)':>12} {'one H x n x n (MiB)':>20}")
    for mode, root in runs:
        cmd = [sys.executable, __file__, "--child", mode, "--root", root, "--n", str(a.n)]
        cmd += ["--heads", str(a.heads), "--d", str(a.d)]
        r = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
        print(f"{mode:<8} {r['n']:>6} {r['extra_mib']:>23.0f} {r['model_mib']:>12.0f} {r['one_map_mib']:>20.0f}")


if __name__ == "__main__":
    main()
