"""The GPU check: one process, the real Llama-3-8B config with random bf16 weights built once on the GPU, each
row's time, peak memory over the model and `estimate_memory`'s estimate printed as one JSON line as it finishes.

Made to run in one short loan of a GPU machine (under 6 minutes, the model's build included):

    python bench/gpu_check.py                    # on CUDA; writes nothing but stdout (tee it into $OUT)
    python bench/gpu_check.py --tiny             # a dry run on this CPU: 2 layers of d 256, small sizes

Rows (the per-call issue's table; the GPU-rate issue adds its rows here):
- one forward pass with the fast kernel (SDPA), at 4,096 and 32,768 tokens: the baselines of the ratios;
- attribute_context with `logit`, with `at2_exact`, with ContextCite (32 ablations) at ~4,100 tokens;
  `logit` + `attention` and ContextCite-32 at ~32,800 tokens (the window raised to 131,072);
- explain(alti) at 8,192 tokens, routes at 4,096, scope_maps at 512.
The last line is a summary: one-pass time / ContextCite-32 time at 4k (goal <= 1/8) and the 32k one-pass time
(goal <= 10 s within its estimate), every estimate / measured ratio (goal [0.75, 1.33]).

`--rate` runs the GPU-rate issue's rows instead, on bench/perf.py's BERT-base-sized random models (no 8B build):
perf.py's sections vz, flops (with explain), batch, corpus and predict, each row a JSON line, then where the time of
scope maps and value zeroing goes (bench/profile_passes.py's categories):

    python bench/gpu_check.py --rate                         # on CUDA
    python bench/gpu_check.py --rate --tiny --only vz profile  # a dry run on this CPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
HERE = Path(__file__).resolve().parent
for p in (str(HERE.parent), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

import torch  # noqa: E402

RESPONSE = " It rained and the fire went out."
QUERY = "What happened?"


def _model(tiny: bool, device: str):
    import transformers as T
    from perf_scale import random_llama

    import ctxmix

    widths = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2) if tiny else {}
    hf = random_llama(2 if tiny else 32, torch.bfloat16, device, max_position_embeddings=131_072, **widths)
    tok = T.AutoTokenizer.from_pretrained(ctxmix.engine.embedded.minilm_path())
    tok.model_max_length = 131_072
    return ctxmix.model_from_hf(hf, tok, name="random-llama3-8b")


def _peak(device: str):
    """(reset, read) of the peak memory over what is allocated now: CUDA's allocator, else VmHWM."""
    from perf_common import peak_rss_mb, reset_peak_rss, rss_mb

    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        return lambda: (torch.cuda.synchronize(), torch.cuda.max_memory_allocated() - base)[1]
    reset_peak_rss()
    base = rss_mb()
    return lambda: (peak_rss_mb() - base) * 2**20


RATE_SECTIONS = ("vz", "flops", "batch", "corpus", "predict", "profile")


def _profile_rows(n: int, device: str) -> list[dict]:
    """Where the time of scope maps and value zeroing goes on this device (bench/profile_passes.py): seconds per
    category of op, and the FLOP rate over the whole call and over its products alone / the matmul rate."""
    from perf import vz_flops
    from perf_common import bert_base, ids_for, matmul_rates, widths
    from profile_passes import by_category, profile

    from ctxmix.engine.trace import trace_ids
    from ctxmix.methods.mixing import scope_layer_maps, value_zeroing_maps

    m = bert_base(device)
    L, d, dff = widths(m)
    ids = ids_for(n)
    rate = matmul_rates(device, 8192 if device.startswith("cuda") else 2048)[0]
    calls = {
        "scope_maps": (lambda: scope_layer_maps(trace_ids(m, ids)), L * 2 * n * n * d * dff),
        "value_zeroing": (lambda: value_zeroing_maps(trace_ids(m, ids)), vz_flops(m, n)),
    }
    rows = []
    for name, (fn, flops) in calls.items():
        by = by_category(profile(fn, device)[0])
        total = sum(by.values())
        out = {"target": f"profile {name} n={n}", **{k: round(v, 4) for k, v in by.items()}}
        out["whole call / matmul rate"] = round(flops / total / rate, 3)
        out["products alone / matmul rate"] = round(flops / max(by["matrix products"], 1e-9) / rate, 3)
        rows.append(out)
    return rows


def rate_rows(device: str, tiny: bool, only: list[str] | None) -> None:
    """The GPU-rate issue's rows, one JSON line each as its section finishes: bench/perf.py's sections vz, flops
    (with explain), batch, corpus (float32, tf32, bf16) and predict on its BERT-base-sized random models, then the
    profile's breakdown. `tiny`: perf.py's --quick sizes (a dry run on a CPU)."""
    import perf

    args = ["--device", device] + (["--quick", "--predict-sizes", "64", "--batch", "2"] if tiny else [])
    a = perf.build_parser(quick=tiny).parse_args(args)
    dev = torch.device(device)
    sections = {
        "vz": lambda: perf.bench_value_zeroing(a, dev),
        "flops": lambda: perf.bench_flops_and_explain(a, dev, ["flops", "explain"]),
        "batch": lambda: perf.bench_batch(a, dev),
        "corpus": lambda: perf.bench_corpus(a, dev),
        "predict": lambda: perf.bench_predict(a, dev),
        "profile": lambda: _profile_rows(a.n, device),
    }
    t0 = time.perf_counter()
    for name, fn in sections.items():
        if only and name not in only:
            continue
        try:
            rows = fn()
        except Exception as e:  # noqa: BLE001 - the row says what happened; the other sections still run
            rows = [{"target": name, "error": f"{type(e).__name__}: {str(e)[:200]}"}]
        for r in rows:
            r = {k: (float(v) if hasattr(v, "item") else v) for k, v in r.items()}
            print(json.dumps({"section": name, **r}, default=str), flush=True)
    print(json.dumps({"row": "summary", "total_seconds": round(time.perf_counter() - t0, 1)}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="a dry run on the CPU: a small model, small sizes")
    ap.add_argument("--only", nargs="*", help="row names to run (default: all); with --rate, sections")
    ap.add_argument(
        "--rate",
        action="store_true",
        help=f"the GPU-rate issue's rows instead (sections {', '.join(RATE_SECTIONS)}), on BERT-base-sized models",
    )
    a = ap.parse_args()
    if a.rate:
        rate_rows("cpu" if a.tiny or not torch.cuda.is_available() else "cuda", a.tiny, a.only)
        return
    import gc

    import ctxmix
    from ctxmix.engine.attention import output_only

    device = "cpu" if a.tiny or not torch.cuda.is_available() else "cuda"
    scale = 16 if a.tiny else 1
    t0 = time.perf_counter()
    m = _model(a.tiny, device)
    print(json.dumps({"row": "build", "seconds": round(time.perf_counter() - t0, 2), "device": device}), flush=True)
    texts: dict[int, str] = {}

    def text(n):
        """Lee news prose, repeated as needed, cut to about n tokens."""
        if n not in texts:
            from ctxmix.data import lee_background

            words = " ".join(lee_background()).split()
            words = words * (1 + 2 * n // len(words))
            lo, hi = 1, min(len(words), 2 * n)
            while lo < hi:  # the longest prefix of words within n tokens
                mid = (lo + hi + 1) // 2
                if len(m.tokenizer(" ".join(words[:mid]))["input_ids"]) <= n:
                    lo = mid
                else:
                    hi = mid - 1
            texts[n] = " ".join(words[:lo])
        return texts[n]

    def ctx(methods, n, **kw):
        def run():
            return ctxmix.attribute_context(
                m, text(n // scale - 48), QUERY, response=RESPONSE, methods=methods, progress=False, **kw
            )

        est = dict(call="attribute_context", methods=methods)
        if "ablations" in kw:
            est["n_ablations"] = kw["ablations"]["n"]
        return run, est

    def forward(n):
        ids = torch.tensor([m.tokenizer(text(n // scale))["input_ids"]], device=m.device)

        def run():
            with torch.no_grad(), output_only(m):
                return m.hf(input_ids=ids, logits_to_keep=1, use_cache=False)

        return run, None

    def call(fn, est_kw):
        return lambda n: (lambda: fn(text(n // scale)), est_kw)

    # cheap rows first: the lines printed before a time limit are kept
    rows = {
        "forward_4k": (forward, 4_096),
        "logit_4k": (lambda n: ctx(["logit"], n), 4_096),
        # a random model has no trained AT2 weights: untrained ones cost the same pass
        "at2_exact_4k": (lambda n: ctx(["at2_exact"], n, at2={"weights": "untrained"}), 4_096),
        "contextcite32_4k": (lambda n: ctx(["contextcite"], n, ablations={"n": 32}), 4_096),
        "forward_32k": (forward, 32_768),
        "logit_attention_32k": (lambda n: ctx(["logit", "attention"], n), 32_768),
        "routes_4k": (call(lambda t: ctxmix.routes(m, t), {"call": "routes"}), 4_096),
        "scope_maps_512": (call(lambda t: ctxmix.scope_maps(m, t), {"call": "scope_maps"}), 512),
        "contextcite32_32k": (lambda n: ctx(["contextcite"], n, ablations={"n": 32}), 32_768),
        "explain_alti_8k": (
            call(lambda t: ctxmix.explain(m, t, ["alti"]), {"call": "explain", "methods": ["alti"]}),
            8_192,
        ),
    }
    got: dict[str, dict] = {}
    for name, (make, n) in rows.items():
        if a.only and name not in a.only:
            continue
        run, est_kw = make(n)
        out: dict = {"row": name, "tokens": n // scale}
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        read = _peak(device)
        t = time.perf_counter()
        try:
            res = run()
        except Exception as e:  # noqa: BLE001 - the row says what happened (out of memory included)
            out["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            print(json.dumps(out), flush=True)
            got[name] = out
            continue
        if device == "cuda":
            torch.cuda.synchronize()
        out["seconds"] = round(time.perf_counter() - t, 3)
        peak = read()
        out["peak_gib"] = round(peak / 2**30, 3)
        if est_kw is not None:
            if hasattr(res, "response_ids"):
                n_tok = len(res.prompt_ids) + len(res.response_ids)
                est_kw = {**est_kw, "n_response": len(res.response_ids)}
            else:
                n_tok = len(m.tokenizer(text(n // scale))["input_ids"])
            out["tokens"] = n_tok
            est = ctxmix.estimate_memory(m, n_tok, **est_kw)
            out["estimate_gib"] = round(est.peak_bytes / 2**30, 3)
            out["estimate/measured"] = round(est.peak_bytes / max(peak, 1), 3)
        print(json.dumps(out), flush=True)
        got[name] = out
        del res
    summary: dict = {"row": "summary", "total_seconds": round(time.perf_counter() - t0, 1)}
    if "seconds" in got.get("logit_4k", {}) and "seconds" in got.get("contextcite32_4k", {}):
        summary["logit / contextcite32 at 4k (goal <= 0.125)"] = round(
            got["logit_4k"]["seconds"] / got["contextcite32_4k"]["seconds"], 3
        )
    for k in ("logit_4k", "logit_attention_32k"):
        base = got.get("forward_4k" if k.endswith("4k") else "forward_32k", {})
        if "seconds" in got.get(k, {}) and "seconds" in base:
            summary[f"{k} / one forward"] = round(got[k]["seconds"] / base["seconds"], 2)
    ratios = {k: v["estimate/measured"] for k, v in got.items() if "estimate/measured" in v}
    summary["estimates within [0.75, 1.33]"] = all(0.75 <= r <= 1.33 for r in ratios.values())
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
