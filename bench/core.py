"""Time and peak memory of `explain` (every context-mixing method) and `scope_maps`.

    python bench/core.py                       # n = 32, 128, 512 on BERT-base (random) and MiniLM
    python bench/core.py --sizes 32 128 --models minilm

Each measurement runs in a fresh subprocess so that peak memory (ru_maxrss on CPU,
torch.cuda.max_memory_allocated on CUDA) belongs to that measurement alone; "extra" is the
peak minus the memory held right after loading the model. Prints one table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

MIXING = ["attention", "attention_rollout", "norm", "norm_res", "norm_res_ln", "globenc", "alti", "value_zeroing"]


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def load(name: str, device: str):
    import torch
    import transformers as T

    import ctxmix

    if name == "minilm":
        return ctxmix.load_model("minilm", device=device)
    if name == "bert-base":
        torch.manual_seed(0)
        hf = T.BertModel(T.BertConfig(), add_pooling_layer=False).eval()
        hf.set_attn_implementation("eager")
        tok = T.AutoTokenizer.from_pretrained(ctxmix.engine.embedded.minilm_path())
        dev = ctxmix.engine.placement.resolve_device(device)
        return ctxmix.model_from_hf(hf.to(dev), tok, name="bert-base (random)")
    raise SystemExit(f"unknown bench model {name}")


def one(model_name: str, n: int, what: str, device: str) -> dict:
    """Measure one (model, n, what) in this process."""
    import torch

    import ctxmix

    m = load(model_name, device)
    ids = [101] + [1000 + (7 * i) % 20000 for i in range(n - 2)] + [102]
    cuda = m.device.type == "cuda"
    # warm up kernels on a short input so the timing is of the work, not of first calls
    ctxmix.explain(m, None, MIXING, input_ids=ids[:8] + [102])
    base = torch.cuda.memory_allocated() / 2**20 if cuda else _rss_mb()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    if what == "explain":
        ctxmix.explain(m, None, MIXING, input_ids=ids)
    else:
        ctxmix.scope_maps(m, input_ids=ids)
    if cuda:
        torch.cuda.synchronize()
    sec = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else _rss_mb()
    return {
        "model": model_name,
        "n": n,
        "what": what,
        "seconds": round(sec, 3),
        "peak_MB": round(peak),
        "extra_MB": round(peak - base),
        "device": str(m.device),
        "threads": torch.get_num_threads(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["bert-base", "minilm"])
    ap.add_argument("--sizes", nargs="+", type=int, default=[32, 128, 512])
    ap.add_argument("--what", nargs="+", default=["explain", "scope_maps"], choices=["explain", "scope_maps"])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    from ctxmix.engine.budget import keep_cpu_buffers

    keep_cpu_buffers()  # as the CLI does: this process is ours (measured 15-25 % on value zeroing)
    if a.child:
        print(json.dumps(one(*json.loads(a.child))))
        return
    rows = []
    for model_name in a.models:
        for n in a.sizes:
            for what in a.what:
                arg = json.dumps([model_name, n, what, a.device])
                r = subprocess.run(
                    [sys.executable, __file__, "--child", arg],
                    capture_output=True,
                    text=True,
                    env={**os.environ, "HF_HUB_OFFLINE": "1"},
                )
                if r.returncode:
                    print(r.stderr[-2000:], file=sys.stderr)
                    rows.append({"model": model_name, "n": n, "what": what, "seconds": "failed"})
                    continue
                rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
                print(rows[-1], file=sys.stderr, flush=True)
    import pandas as pd

    print(pd.DataFrame(rows).to_string(index=False))


if __name__ == "__main__":
    main()
