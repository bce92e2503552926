"""`bench/perf.py --only scale`: ctxmix at the widths of the models its users study, each row in a fresh
process (peak memory read from /proc/self/status's VmHWM, reset after the model is built; CUDA's peak
allocation on a GPU).

Rows (each in its own process):
- half precision, one layer at a time: a bf16 Llama with Llama-3-8B's widths (d 4,096, d' 14,336, 32 heads,
  8 KV heads, vocabulary 128,256) and 4 layers, built on `meta` then `to_empty` and filled in bf16 (never
  float32-then-cast): the peak over the loaded model during `explain(["logit"])` on 16 tokens, against one
  layer's float32 V/O/FF (the goal: about one layer's, not four; the old `Model.layers` held every layer's
  float32 copy for the model's life, 4.85 GiB over the model here).
- on CUDA only: the real Llama-3-8B config (32 layers, bf16, built on the GPU: no download), alone and split
  by a device_map over cuda:0 and the CPU (16 layers each), `attribute_context(logit)` on 4,096 tokens,
  `explain(["alti"])` on 1,024, `scope_maps` on 256 and `routes` on 2,048: time and peak memory (a row that
  runs out of memory says so). The memory estimate that will decide beforehand which rows fit belongs to the
  long-context work (`ctxmix.estimate_memory`).

    python bench/perf_scale.py                 # the rows, on CUDA when there is one
    python bench/perf.py --only scale          # the same rows in perf.py's table
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
HERE = Path(__file__).resolve().parent
for p in (str(HERE.parent), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

import torch  # noqa: E402
from perf_common import log, row, timed_peak  # noqa: E402

from ctxmix.methods.memory import REFERENCE_CONFIGS  # noqa: E402

# Llama-3-8B's widths (its published config), the layer count left to each row
LLAMA3_8B = {
    k: v for k, v in REFERENCE_CONFIGS["llama-3-8b"].items() if k not in ("model_type", "dtype", "num_hidden_layers")
}


def random_llama(n_layers: int, dtype: torch.dtype, device: str, **widths):
    """A random Llama of the given widths built on `meta`, then materialised on `device` in `dtype` (no float32
    copy at any point): weights N(0, 0.02), norms 1, the rotary buffers computed anew."""
    import transformers as T

    cfg = T.LlamaConfig(num_hidden_layers=n_layers, **{**LLAMA3_8B, **widths})
    with torch.device("meta"):
        hf = T.LlamaForCausalLM._from_config(cfg, attn_implementation="eager", dtype=dtype)
    hf = hf.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    with torch.device(device):  # the rotary frequencies are a computed buffer: to_empty left it garbage
        hf.model.rotary_emb = type(hf.model.rotary_emb)(config=cfg)
    return hf.eval()


def one_layer_float32_bytes(cfg: dict) -> int:
    """One layer's V, O and FF matrices in float32: what the engine copies when it reaches a bf16 layer."""
    d, dff, H, Hkv = (
        cfg["hidden_size"],
        cfg["intermediate_size"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
    )
    dh = d // H
    return 4 * (d * Hkv * dh + H * dh * d + 3 * d * dff)


def half_child(device: str, n_layers: int, n_tokens: int) -> dict:
    import transformers as T

    import ctxmix

    hf = random_llama(n_layers, torch.bfloat16, device)
    tok = T.AutoTokenizer.from_pretrained(ctxmix.engine.embedded.minilm_path())
    model = ctxmix.model_from_hf(hf, tok, name="random-llama3-8b-widths")
    words = "the cat sat on the mat and looked at the door for a long while".split()
    text = " ".join(words[: n_tokens - 2])
    assert len(model.encode(text)[0]) == n_tokens
    ex, sec, peak_mb = timed_peak(lambda: ctxmix.explain(model, text, ["logit"]), device)
    return {"seconds": sec, "peak_mb": peak_mb, "reconstruction_error": ex.reconstruction_error}


def _text(tok, n_tokens: int) -> str:
    """Lee news prose cut to about n_tokens tokens of `tok` (special tokens included)."""
    from ctxmix.data import lee_background

    words = " ".join(lee_background()).split()
    lo, hi = 1, len(words)
    while lo < hi:  # the longest prefix of words within n_tokens
        mid = (lo + hi + 1) // 2
        if len(tok(" ".join(words[:mid]))["input_ids"]) <= n_tokens:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(words[:lo])


CALLS = ("attribute_context", "explain_alti", "scope_maps", "routes")


def gpu_child(device: str, call: str, n_tokens: int, split: bool) -> dict:
    """The real Llama-3-8B config (32 layers, bf16) built on the GPU (no download), alone or split by a
    device_map: the first half of the layers on cuda:0, the rest on the CPU."""
    import transformers as T

    import ctxmix

    hf = random_llama(32, torch.bfloat16, "cpu" if split else device)
    if split:
        from accelerate import dispatch_model

        dm = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.norm": 0, "lm_head": 0}
        dm.update({f"model.layers.{i}": (0 if i < 16 else "cpu") for i in range(32)})
        hf = dispatch_model(hf, device_map=dm)
    tok = T.AutoTokenizer.from_pretrained(ctxmix.engine.embedded.minilm_path())
    tok.model_max_length = LLAMA3_8B["max_position_embeddings"]  # the model's window, not MiniLM's 512
    model = ctxmix.model_from_hf(hf, tok, name="random-llama3-8b")
    text = _text(tok, n_tokens)
    runs = {
        "attribute_context": lambda: ctxmix.attribute_context(
            model, text, "What happened?", response=" It rained.", methods=["logit"], progress=False
        ),
        "explain_alti": lambda: ctxmix.explain(model, text, ["alti"]),
        "scope_maps": lambda: ctxmix.scope_maps(model, text),
        "routes": lambda: ctxmix.routes(model, text),
    }
    _, sec, peak_mb = timed_peak(runs[call], device)
    return {"seconds": sec, "peak_mb": peak_mb}


GPU_ROWS = [("attribute_context", 4096), ("explain_alti", 1024), ("scope_maps", 256), ("routes", 2048)]

# the CPU rows: (call, tokens, bound on the peak over the model in GiB or None)
CPU_ROWS = [
    ("attribute_context", 4096, 1.5),
    ("contextcite", 4096, 4.0),
    ("explain_alti", 512, None),
    ("explain_alti", 1024, None),
    ("scope_maps", 256, None),
    ("routes", 2048, None),
]
RESPONSE = " It rained and the fire went out."


def _calls(ctxmix, model, text):
    """{row name: (the call, estimate_memory's keywords for it)}."""
    ask = dict(query="What happened?", response=RESPONSE, progress=False)
    return {
        "attribute_context": (
            lambda: ctxmix.attribute_context(model, text, methods=["logit", "attention"], **ask),
            dict(call="attribute_context", methods=["logit", "attention"]),
        ),
        "contextcite": (
            lambda: ctxmix.attribute_context(model, text, methods=["contextcite"], ablations={"n": 8}, **ask),
            dict(call="attribute_context", methods=["contextcite"], n_ablations=8),
        ),
        "explain_alti": (lambda: ctxmix.explain(model, text, ["alti"]), dict(call="explain", methods=["alti"])),
        "scope_maps": (lambda: ctxmix.scope_maps(model, text), dict(call="scope_maps")),
        "routes": (lambda: ctxmix.routes(model, text), dict(call="routes")),
    }


def cpu_child(call: str, n_tokens: int) -> dict:
    """A random Llama of Llama-3-8B's widths with 2 layers in float32 (built on `meta`, then `to_empty`) on the
    CPU: the call's time and peak over the model, beside `estimate_memory`'s estimate for the loaded model."""
    import transformers as T

    import ctxmix

    hf = random_llama(2, torch.float32, "cpu")
    tok = T.AutoTokenizer.from_pretrained(ctxmix.engine.embedded.minilm_path())
    tok.model_max_length = LLAMA3_8B["max_position_embeddings"]  # the model's window, not MiniLM's 512
    model = ctxmix.model_from_hf(hf, tok, name="random-llama3-8b-widths-2-layers")
    text = _text(tok, n_tokens if call in ("explain_alti", "scope_maps", "routes") else n_tokens - 16)
    run, kw = _calls(ctxmix, model, text)[call]
    n = len(tok(text)["input_ids"]) + (len(tok(RESPONSE)["input_ids"]) if kw["call"] == "attribute_context" else 0)
    if kw["call"] == "attribute_context":
        kw["n_response"] = len(tok(RESPONSE)["input_ids"])
    est = ctxmix.estimate_memory(model, n, **kw)
    _, sec, peak_mb = timed_peak(run, "cpu")
    name, _, size = est.largest
    return {
        "seconds": sec,
        "peak_mb": peak_mb,
        "n": n,
        "estimate_mb": est.peak_bytes / 2**20,
        "largest": f"{name} {size / 2**30:.2f} GiB",
    }


def _child(kind: str, *args) -> dict:
    """One row in a fresh process (its peak memory is its own)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps([kind, *args])]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        raise RuntimeError(r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def bench_scale(a, dev) -> list[dict]:
    rows = []
    n_layers, n_tokens = 4, 16
    if not getattr(a, "rows", None):
        log(f"scale: bf16 Llama-3-8B widths, {n_layers} layers, explain(['logit']) on {n_tokens} tokens")
        r = _child("half", str(dev), n_layers, n_tokens)
        goal_mb = one_layer_float32_bytes(LLAMA3_8B) / 2**20
        rows.append(
            row(
                f"bf16 Llama-3-8B widths x{n_layers} layers: explain(logit) {n_tokens} tok, peak over model",
                f"{r['peak_mb']:.0f} MB in {r['seconds']:.1f} s",
                f"one layer's float32 V/O/FF {goal_mb:.0f} MB",
                r["peak_mb"] / goal_mb,
                "<= ~1 layer (ratio <= 1.3)",
                r["peak_mb"] <= 1.3 * goal_mb,
            )
        )
    if dev.type == "cpu":
        only = set(getattr(a, "rows", None) or [])
        for call, n, bound in CPU_ROWS:
            if only and f"{call}:{n}" not in only and call not in only:
                continue
            log(f"scale: Llama-3-8B widths x 2 layers (float32, CPU), {call} on {n} tokens")
            try:
                r = _child("cpu", call, n)
            except RuntimeError as e:
                rows.append(row(f"8B widths x2 float32 CPU: {call} {n} tok", f"failed: {str(e)[:80]}", "-", None, "-"))
                continue
            ratio = r["estimate_mb"] / r["peak_mb"]
            ok = 0.75 <= ratio <= 1.33 and (bound is None or r["peak_mb"] <= bound * 1024)
            rows.append(
                row(
                    f"8B widths x2 float32 CPU: {call} {r['n']} tok, peak over the model (estimate / measured)",
                    f"{r['peak_mb']:.0f} MB in {r['seconds']:.0f} s",
                    f"estimate {r['estimate_mb']:.0f} MB (largest: {r['largest']})",
                    ratio,
                    "estimate in [0.75, 1.33]" + (f", peak <= {bound} GiB" if bound else ""),
                    ok,
                )
            )
    if dev.type == "cuda":
        for split in (False, True):
            for call, n in GPU_ROWS:
                where = "split cuda:0 + cpu" if split else "one GPU"
                log(f"scale: Llama-3-8B bf16 ({where}), {call} on {n} tokens")
                try:
                    r = _child("gpu", str(dev), call, n, split)
                    measured = f"{r['peak_mb'] / 1024:.1f} GiB peak over the model, {r['seconds']:.1f} s"
                except RuntimeError as e:  # out of memory (or anything else): the row says what happened
                    measured = f"failed: {str(e)[:80]}"
                rows.append(row(f"Llama-3-8B bf16 ({where}): {call} {n} tok", measured, "-", None, "report"))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--rows", nargs="*", help="CPU rows to run: call or call:tokens (default: all)")
    a = ap.parse_args()
    if a.child:
        kind, *args = json.loads(a.child)
        print(json.dumps({"half": half_child, "gpu": gpu_child, "cpu": cpu_child}[kind](*args)))
        return
    import pandas as pd
    from perf_common import table_text

    dev = torch.device(
        "cuda" if a.device == "auto" and torch.cuda.is_available() else ("cpu" if a.device == "auto" else a.device)
    )
    print(table_text(pd.DataFrame(bench_scale(a, dev))))


if __name__ == "__main__":
    main()
