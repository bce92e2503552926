"""`bench/perf.py --only context`: context attribution's speed and memory on smollm2.
(A module of its own: perf.py is over 1,000 lines already; perf.py imports this section from here.)

A fixed ~32-token response (the first words of the first article, given as `response=`, so no
generation is timed with a method) over contexts of 512, 1,024, 2,048 and 4,096 tokens joined from
gensim's shipped Lee background news texts (`ctxmix.data.lee_background`), cut at a sentence end, one
source per sentence, the query "Summarize the first article in one sentence.". Each row runs in a fresh
process (the model loaded, a short warm-up call of the same method, peak RSS reset, then timed):

- every method alone (`attribute_context(..., methods=[m])`, ContextCite with 32 ablations): seconds,
  peak memory over the loaded model, the ratio to ContextCite-32's seconds at the same size in the same
  run, and the growth exponents of time and memory from the previous size (log-log, by tokens);
- generation of 32 new tokens from the same prompt, timed apart (greedy, EOS not stopping it);
- `logit`'s user call against the engine's `run_one_pass` on the same ids (the call's overhead);
- LDS of every method (`ContextAttribution.evaluate`, `--context-heldout` held-out ablations with seeds
  disjoint from ContextCite's, k = 1), measured in one more fresh process on ContextCite's saved
  attribution with the other methods' scores added;
- the moonshot: a method within 0.05 of ContextCite-32's LDS at 1/8 of its time, met or not (else the
  closest: the highest LDS among methods at <= 1/8 of the time, else the highest LDS).

Targets: `logit` and `attention` at most 1/4 of ContextCite-32's time from 1,024 tokens up.

    python bench/perf.py --only context                          # 512 .. 4,096 tokens
    python bench/perf.py --only context --sizes 512 1024 --out ctx.csv
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from perf_common import log, row, timed_pair, timed_peak, user_row

CONTEXT_METHODS = ["contextcite", "logit", "alti_logit", "attention", "at2_exact", "grad_x_input", "leave_one_out"]
CONTEXT_SIZES = [512, 1024, 2048, 4096]
QUERY = "Summarize the first article in one sentence."
RESPONSE_TOKENS = 32
N_ABLATIONS = 32  # ContextCite's budget the ratios are taken against
QUARTER_FROM = 1024  # the 1/4 target applies from this many context tokens up
QUARTER_METHODS = ("logit", "attention", "at2_exact")
MOONSHOT_GAP, MOONSHOT_RATIO = 0.05, 1 / 8
ROW_SECONDS = 900  # a row longer than this is stopped and reported as such


def add_arguments(ap) -> None:
    ap.add_argument("--context-child", help=argparse.SUPPRESS)
    ap.add_argument("--context-eval-child", help=argparse.SUPPRESS)
    ap.add_argument(
        "--context-sizes",
        "--sizes",
        dest="context_sizes",
        type=int,
        nargs="+",
        help="context tokens for --only context (default 512 1024 2048 4096)",
    )
    ap.add_argument(
        "--context-methods",
        nargs="+",
        default=CONTEXT_METHODS,
        choices=CONTEXT_METHODS,
        help="methods --only context measures (contextcite is always run: the ratios need it)",
    )
    ap.add_argument("--context-heldout", type=int, default=64, help="held-out ablations of the LDS (--only context)")


# ----------------------------------------------------------------------------- the example


def context_example(tokenizer, n_tokens: int) -> tuple[str, str]:
    """(context, response): Lee background articles joined with blank lines and cut at the last sentence
    end within n_tokens tokens; the response is the first RESPONSE_TOKENS tokens of the first article."""
    from ctxmix.data import lee_background

    arts = lee_background()
    resp_ids = tokenizer(arts[0], add_special_tokens=False)["input_ids"][:RESPONSE_TOKENS]
    response = tokenizer.decode(resp_ids).strip()
    text, k = "", 0
    while len(tokenizer(text, add_special_tokens=False)["input_ids"]) < n_tokens + 64 and k < len(arts):
        text += ("\n\n" if text else "") + arts[k]
        k += 1
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    end = enc["offset_mapping"][min(n_tokens, len(enc["input_ids"])) - 1][1]
    cut = max(text.rfind(". ", 0, end), text.rfind(".\n", 0, end))
    return (text[: cut + 1] if cut > 0 else text[:end]), response


def _load(device: str):
    import transformers

    import ctxmix

    transformers.utils.logging.disable_progress_bar()
    return ctxmix.load_model("smollm2", device=device)


# ----------------------------------------------------------------------------- children


def context_child(size: int, method: str, device: str, save: str | None) -> dict:
    """One method (or "generation") at one size in this fresh process."""
    import ctxmix

    m = _load(device)
    ctx, resp = context_example(m.tokenizer, size)
    small, _ = context_example(m.tokenizer, 96)
    out: dict = {"size": size, "method": method}
    if method == "generation":
        from ctxmix.engine.generate import generate
        from ctxmix.methods.context.prompt import PromptBuilder
        from ctxmix.methods.context.sources import make_sources

        b = PromptBuilder(m, QUERY, None, False)
        ids = b.encode(make_sources(ctx, "sentence")).ids
        generate(m, input_ids=ids[:32], max_new_tokens=2, greedy=True, stop_at_eos=False)  # warm-up
        run = lambda: generate(m, input_ids=ids, max_new_tokens=RESPONSE_TOKENS, greedy=True, stop_at_eos=False)  # noqa: E731
        out.update(P=len(ids), T=RESPONSE_TOKENS)
    else:
        kw = dict(response=resp, methods=[method], ablations={"n": N_ABLATIONS}, progress=False)
        ctxmix.attribute_context(m, small, QUERY, **{**kw, "n_ablations": 2})  # warm-up (imports, kernels)
        run = lambda: ctxmix.attribute_context(m, ctx, QUERY, **kw)  # noqa: E731
    res, out["seconds"], out["extra_MB"] = timed_peak(run, device)
    if method != "generation":
        ca = res
        P, T = len(ca.prompt_ids), len(ca.response_ids)
        out.update(P=P, T=T, d=ca.n_sources, scores=[float(x) for x in ca.scores[method]])
        out["cost"] = {k: v for k, v in ca.cost[method].items() if isinstance(v, (int, float, str, bool))}
        if save:
            ca.save(save)
        if method == "logit":  # the user's call against the engine function on the same ids
            from ctxmix.methods.context.onepass import run_one_pass

            ids = list(ca.prompt_ids) + list(ca.response_ids)
            te, tu, _, _ = timed_pair(lambda: run_one_pass(m, ["logit"], ids, P, "log_prob"), run, device, repeat=1)
            out["engine_pair"] = [te, tu]
    out["n"] = out["P"] + out["T"]
    return out


def context_eval_child(path: str, scores: dict, n_heldout: int, device: str) -> dict:
    """LDS (and top-1 drop) of every method on ContextCite's saved attribution, the others' scores added."""
    import ctxmix

    m = _load(device)
    ca = ctxmix.load_context_attribution(path)
    for name, s in scores.items():
        if name not in ca.methods:
            ca.methods.append(name)
        ca.scores[name] = np.asarray(s, dtype=np.float64)
    t0 = time.perf_counter()
    tab = ca.evaluate(m, k=1, n_ablations=n_heldout, progress=False)
    return {
        "lds": {r.method: float(r.lds) for r in tab.itertuples()},
        "seconds": time.perf_counter() - t0,
        "notes": tab.attrs.get("notes", []),
    }


def _run(args: list[str], timeout: float) -> dict:
    perf = Path(__file__).resolve().parent / "perf.py"
    r = subprocess.run([sys.executable, str(perf), *args], capture_output=True, text=True, timeout=timeout)
    if r.returncode:
        raise RuntimeError(r.stderr[-3000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- the section


def _exponent(a: float | None, b: float | None, na: int, nb: int) -> float | None:
    if a is None or b is None or a <= 0 or b <= 0:
        return None
    return float(np.log(b / a) / np.log(nb / na))


def moonshot(times: dict, lds: dict) -> tuple[bool, str]:
    """(met, text): the fastest method within MOONSHOT_GAP of ContextCite's LDS at <= MOONSHOT_RATIO of its
    time; else the closest (the highest LDS among those fast enough, else the highest LDS)."""
    t_cc, l_cc = times["contextcite"], lds.get("contextcite", float("nan"))
    cand = {k: (times[k] / t_cc, lds[k]) for k in times if k != "contextcite" and np.isfinite(lds.get(k, np.nan))}
    if not np.isfinite(l_cc) or not cand:
        return False, "no LDS to compare (see notes)"

    def say(k):
        r, v = cand[k]
        return f"{k}: LDS {v:.3f} vs {l_cc:.3f} (gap {l_cc - v:+.3f}), time {r:.3f} of ContextCite-32"

    met = [k for k, (r, v) in cand.items() if r <= MOONSHOT_RATIO and v >= l_cc - MOONSHOT_GAP]
    if met:
        return True, "met by " + say(min(met, key=lambda k: cand[k][0]))
    fast = [k for k, (r, _) in cand.items() if r <= MOONSHOT_RATIO]
    best = max(fast or cand, key=lambda k: cand[k][1])
    return False, "not met; closest " + say(best)


def bench_context(a, dev) -> list[dict]:
    """The section (module docstring)."""
    sizes = sorted(a.context_sizes or CONTEXT_SIZES)
    methods = ["contextcite"] + [m for m in a.context_methods if m != "contextcite"]
    rows: list[dict] = []
    prev: dict[str, dict] = {}
    tmp = tempfile.mkdtemp(prefix="ctxmix-perf-context-")
    for size in sizes:
        got: dict[str, dict] = {}
        for method in ["generation", *methods]:
            log(f"context: {method}, {size} context tokens (fresh process)")
            save = str(Path(tmp) / f"cc{size}.npz") if method == "contextcite" else None
            try:
                r = _run(["--context-child", json.dumps([size, method, str(dev), save])], ROW_SECONDS)
            except subprocess.TimeoutExpired:
                rows.append(row(f"context {method}, {size} tokens", f"over {ROW_SECONDS} s (stopped)", "-", None, "-"))
                continue
            except RuntimeError as e:
                rows.append(row(f"context {method}, {size} tokens", "failed", str(e).splitlines()[-1][:100]))
                continue
            got[method] = r
            log(f"context: {method} n={r['n']}: {r['seconds']:.2f} s, +{r['extra_MB']:.0f} MB, cost {r.get('cost')}")
        cc = got.get("contextcite")
        gen = got.pop("generation", None)
        if gen:
            rows.append(
                row(
                    f"context, generation of {RESPONSE_TOKENS} tokens (timed apart), prompt {gen['P']} tokens",
                    f"{gen['seconds']:.2f} s; +{gen['extra_MB']:.0f} MB",
                    "-" if not cc else f"ContextCite-32 {cc['seconds']:.1f} s",
                    None if not cc else gen["seconds"] / cc["seconds"],
                    "report",
                )
            )
        lds: dict = {}
        if cc:
            try:
                ev = _run(
                    [
                        "--context-eval-child",
                        json.dumps(
                            [
                                str(Path(tmp) / f"cc{size}.npz"),
                                {k: v["scores"] for k, v in got.items()},
                                a.context_heldout,
                                str(dev),
                            ]
                        ),
                    ],
                    ROW_SECONDS,
                )
                lds = ev["lds"]
                log(f"context: LDS at {size} tokens in {ev['seconds']:.0f} s: {lds}; notes {ev['notes']}")
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                log(f"context: LDS at {size} tokens failed: {str(e)[-300:]}")
        for method, r in got.items():
            p = prev.get(method)
            et = _exponent(p["seconds"], r["seconds"], p["n"], r["n"]) if p else None
            em = _exponent(p["extra_MB"], r["extra_MB"], p["n"], r["n"]) if p else None
            grow = "-" if et is None else f"exp. time {et:.2f}" + ("" if em is None else f", memory {em:.2f}")
            ratio = r["seconds"] / cc["seconds"] if cc else None
            target = method in QUARTER_METHODS and size >= QUARTER_FROM
            cost = r.get("cost", {})
            passes = f"{cost.get('forward', '?')} fwd, {cost.get('backward', 0)} bwd"
            rows.append(
                row(
                    f"context {method}, {size} tokens (n={r['n']}, {r['d']} sources): time; peak memory over model",
                    f"{r['seconds']:.2f} s; +{r['extra_MB'] / 1024:.2f} GB; LDS {lds.get(method, float('nan')):.3f}",
                    f"ContextCite-32 {cc['seconds']:.1f} s; {passes}; {grow}" if cc else passes,
                    ratio,
                    "<= 0.25 of ContextCite-32" if target else "report",
                    (ratio is not None and ratio <= 0.25) if target else None,
                )
            )
            if "engine_pair" in r:
                te, tu = r["engine_pair"]
                rows.append(user_row(f"context logit, {size} tokens", tu, te, "attribute_context", "run_one_pass"))
            prev[method] = r
        if cc:
            met, text = moonshot({k: v["seconds"] for k, v in got.items()}, lds)
            rows.append(
                row(
                    f"context moonshot, {size} tokens: LDS within {MOONSHOT_GAP} of ContextCite-32's at <= 1/8 of "
                    f"its time (held-out m={a.context_heldout})",
                    text,
                    f"ContextCite-32 {cc['seconds']:.1f} s",
                    None,
                    "moonshot",
                    met,
                )
            )
    return rows
