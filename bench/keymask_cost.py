"""What per-token rows would cost `key_mask_grad` (docs/context.md, "Key-mask gradient"): per-key gradients for
every response token (T backward passes, or one batched backward) against one backward of the whole response's
summed log-probability, and ContextCite with 32 ablations on the same input.

    python bench/keymask_cost.py --sizes 400 1500 --threads 1

The context: Lee background news joined and cut at a sentence end within the size (`perf_context.context_example`,
its ~32-token response given as text), the query "Summarize the first article in one sentence.". Per size, in
this process, after one warm-up of each path: (a) `key_mask_rows` (one forward, one backward of sum_t log p_t),
(b) T backward passes through one forward (the graph kept between them), (c) one batched backward
(`torch.autograd.grad(..., is_grads_batched=True)`, the T one-hot output gradients as a batch), (d)
`attribute_context(..., methods=["contextcite"], ablations={"n": 32})`'s ContextCite seconds. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's ctxmix
sys.path.insert(0, str(Path(__file__).resolve().parent))

QUERY = "Summarize the first article in one sentence."


def per_token_seconds(model, ids, P, impl, batched: bool) -> float:
    """Seconds for the per-key gradients of every response token: one forward with the bias leaf, then T
    backward passes (or one batched backward)."""
    import torch

    from ctxmix.methods.context.keymask import gated_log_probs

    n, T = len(ids), len(ids) - P
    t0 = time.perf_counter()
    with torch.enable_grad():
        b = torch.zeros(n, dtype=torch.float32, requires_grad=True)
        lp = gated_log_probs(model, ids, P, b, impl)
        if batched:
            (g,) = torch.autograd.grad(lp, b, grad_outputs=torch.eye(T, dtype=lp.dtype), is_grads_batched=True)
            assert g.shape == (T, n)
        else:
            for t in range(T):
                torch.autograd.grad(lp[t], b, retain_graph=t < T - 1)
    return time.perf_counter() - t0


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[400, 1500])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--skip-batched", action="store_true")
    a = ap.parse_args(argv)
    import torch
    from perf_context import context_example

    import ctxmix
    from ctxmix.methods.context.keymask import gate_attention, key_mask_rows

    if a.threads:
        torch.set_num_threads(a.threads)
    model = ctxmix.load_model("smollm2", device="cpu")
    rows = []
    for size in a.sizes:
        context, response = context_example(model.tokenizer, size)
        ca = ctxmix.attribute_context(
            model, context, QUERY, response=response, methods=["contextcite"], ablations={"n": 32}, progress=False
        )
        cc = ca.cost["contextcite"]["seconds"]
        ids, P = ca.prompt_ids + ca.response_ids, len(ca.prompt_ids)
        gated = [j for toks in ca.source_tokens for j in toks]
        impl = gate_attention(model, len(ids))
        key_mask_rows(model, ids[: P + 2], P, gated)  # warm-up
        t0 = time.perf_counter()
        whole = key_mask_rows(model, ids, P, gated)
        one = time.perf_counter() - t0
        loop = per_token_seconds(model, ids, P, impl, batched=False)
        try:
            batched = None if a.skip_batched else per_token_seconds(model, ids, P, impl, batched=True)
        except RuntimeError as e:  # vmap over a backward an operator does not support
            print(f"batched backward failed: {e}", file=sys.stderr)
            batched = None
        row = {
            "context tokens": len(ids) - len(ca.response_ids),
            "T": len(ca.response_ids),
            "attention": whole["cost"]["attention"],
            "one backward (s)": one,
            "T backward (s)": loop,
            "batched backward (s)": batched,
            "ContextCite-32 (s)": cc,
        }
        rows.append(row)
        print(row, flush=True)
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(f"{v:.1f}" if isinstance(v, float) else str(v) for v in r.values()) + " |")


if __name__ == "__main__":
    main()
