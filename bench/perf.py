"""ctxmix's performance targets, measured in one run, printed as one table.
(Over 500 lines: one function per target, each with its baseline; helpers live in perf_common.py,
the comparisons with other tools in perf_compare.py.)

    python bench/perf.py                          # every target; about 8 minutes on a 2-core CPU
    python bench/perf.py --device cuda --out $OUT/perf.csv   # on a GPU (adds the 16 GB card and embedded rows)
    python bench/perf.py --quick                  # smaller sizes (named in the table)
    python bench/perf.py --out perf.csv           # also write the table as CSV
    python bench/perf.py --inseq-venv /tmp/inseq-venv   # also compare with inseq 0.7.1 (see below)
    python bench/perf.py --only vz flops          # a subset: vz flops batch explain corpus memory budget ig
                                                  # inseq precision embedded flow predict long
    python bench/perf.py --only long              # long inputs on smollm2 (CUDA: a random 1.1B Llama to 8,192)
    python bench/perf.py --only context --sizes 512 1024   # context attribution on smollm2 (bench/perf_context.py)
    python bench/perf.py --only scale             # Llama-3-8B widths: bf16 one layer at a time (bench/perf_scale.py)
    python bench/perf.py --only onepass           # one-pass context methods at 16k tokens vs one forward (CPU too)

Columns: target, measured, baseline, ratio, goal, pass. "ratio" is a speed-up (baseline time /
ctxmix time) for the comparisons, a fraction of the measured matmul rate for the FLOP rates,
and ctxmix / sum of parts for `explain`. "pass" is "-" where a row has no goal, only a report.

Everything runs offline on random models built from configs (BERT-base sizes: d=768, d'=3072,
12 heads, 12 layers), on CUDA when there is one (`--device auto`), else on CPU.

Baselines written here:
- `value_zeroing_loop`: the official value-zeroing algorithm (Mohebbi et al. 2023, code in
  hmohebbi/ValueZeroing, `scoring/value_zeroing.py`): one Hugging Face layer call per
  zeroed token and layer, a forward hook on the value projection zeroing v_t (bias included) in
  every head, float64 cosine distance to the real layer output, rows normalised.
- captum's IntegratedGradients called directly on the word embeddings with the same target
  scalar, baseline and steps as `ctxmix.methods.saliency.integrated_gradients`.
- inseq 0.7.1's `value_zeroing` (optional): it needs transformers 4.46.3, so it runs in its own
  virtualenv (`--inseq-venv PATH`, e.g. made with `python3 -m venv /tmp/inseq-venv &&
  /tmp/inseq-venv/bin/pip install "transformers[sentencepiece,tokenizers]==4.46.3" torch safetensors
  captum jaxtyping "typeguard<=2.13.3" rich matplotlib tqdm treescope protobuf &&
  /tmp/inseq-venv/bin/pip install --no-deps inseq==0.7.1`; inseq 0.7.1 declares
  transformers>=4.53 and CUDA 11 wheels, hence --no-deps). A random GPT-2-base-sized model is built
  there, saved with safetensors, and loaded here, so both tools see the same weights and tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

if str(HERE) not in sys.path:  # perf_common sits next to this script
    sys.path.insert(0, str(HERE))

from perf_common import (  # noqa: E402
    bert_base,
    ids_for,
    log,
    machine,
    matmul_rates,
    paired_ratios,
    paired_rounds,
    peak_rss_mb,
    reset_peak_rss,
    row,
    rss_mb,
    sync,
    table_text,
    timed,
    timed_pair,
    timed_peak,
    tokenizer,
    user_row,
    value_zeroing_loop,
    widths,
)
from perf_compare import (  # noqa: E402
    MIXING,  # noqa: E402
    bench_ig,
    bench_inseq,
    bench_precision,
)
from perf_context import add_arguments as add_context_arguments  # noqa: E402
from perf_context import bench_context, context_child, context_eval_child  # noqa: E402
from perf_onepass import bench_onepass  # noqa: E402
from perf_scale import bench_scale  # noqa: E402

CPU_LAYERS_512 = 2  # layers of the n=512 memory model on CPU by default (12 layers there take ~2.5 min more)
SECTIONS = (
    "vz flops batch explain corpus memory budget ig inseq precision embedded flow predict long context scale onepass"
).split()
# by default on a CPU: the simulated card needs CUDA; embedded, long and context take minutes
CPU_SKIPS = {"budget", "embedded", "long", "context", "scale"}
CORPUS_TODAY_CPU = 0.218  # seq/s, sequence-at-a-time engine with scipy ranks (docs/performance.md, before batching)


# ----------------------------------------------------------------------------- targets


def vz_flops(m, n: int) -> int:
    """The FLOPs value zeroing cannot avoid once W_1 is factorised (ctxmix.engine.layer.value_zeroing_columns):
    per layer the W_2 product on the n^2 perturbed FF activations (2 n^2 d' d), mixing the
    projected head vectors B^h_t (2 n^2 H d') and the removed values (2 n^2 H d). Counting the
    unfactorised 4 n^2 d d' instead would credit ctxmix with FLOPs it does not run."""
    L, d, dff = widths(m)
    H = m.layers[0].n_heads
    return L * 2 * n * n * (d * dff + H * dff + H * d)


def bench_value_zeroing(a, dev) -> list[dict]:
    """Target 1: ctxmix's batched value zeroing against the per-token loop, same maps; and the call a
    user makes (`explain(m, ..., ["value_zeroing"])`) against the engine function, interleaved."""
    import ctxmix
    from ctxmix.engine.trace import trace_ids
    from ctxmix.methods.mixing import value_zeroing_maps

    n = a.vz_n
    m = bert_base(dev)
    ids = ids_for(n)
    short = ids_for(8)
    value_zeroing_loop(m, short)  # warm-up: first calls, allocator
    value_zeroing_maps(trace_ids(m, short))
    ctxmix.explain(m, None, ["value_zeroing"], input_ids=short)
    # ctxmix once at full size too: its chunk shapes are new to the allocator in a call's first run, while the loop
    # repeats one layer call's shapes 12 n times and warms itself within its first few
    value_zeroing_maps(trace_ids(m, ids))
    rounds = a.repeat + 1
    log(f"value zeroing n={n}: per-token loop ({m.n_layers * n} layer calls), engine and explain, {rounds} rounds")
    # each round runs the loop and both of ctxmix's calls back to back, so that each round's speed-up is a ratio of
    # two times taken under the same machine state (the loop's best time ranged 6.0-7.4 s over 13 runs on one machine)
    times, _, res = paired_rounds(
        {
            "loop": lambda: value_zeroing_loop(m, ids),
            "engine": lambda: value_zeroing_maps(trace_ids(m, ids)),
            "user": lambda: ctxmix.explain(m, None, ["value_zeroing"], input_ids=ids),
        },
        dev,
        0,
        rounds,
        seconds=0,
    )
    ref, got, ex = res["loop"], res["engine"], res["user"]
    t_loop, t_cm, t_user = (min(times[k]) for k in ("loop", "engine", "user"))
    per_round = [lo / e for lo, e in zip(times["loop"], times["engine"])]
    speed_up = float(np.median(per_round))
    log(f"  loop {t_loop:.1f} s, ctxmix {t_cm:.2f} s (best of {rounds})")
    diff = max(float(np.abs(ref - got).max()), float(np.abs(ref - ex.layer_maps["value_zeroing"]).max()))
    L, d, dff = widths(m)
    # per layer: the loop runs n layer calls on n tokens (Q, K, V, O and the FF, attention scores and
    # context); ctxmix runs the FF on n^2 perturbed vectors and mixes the removed values
    fl_loop = L * n * (2 * n * (4 * d * d + 2 * d * dff) + 4 * n * n * d)
    fl_cm = vz_flops(m, n)
    goal = 60.0 if torch.device(dev).type == "cuda" else 4.0  # the GPU rate issue's goals
    return [
        row(
            f"value zeroing n={n}, BERT-base (random): speed-up over the per-token loop, the loop's time over ctxmix's "
            f"in the same round (median of {rounds} rounds)",
            f"{t_cm:.2f} s (best)",
            f"{t_loop:.2f} s (loop, best; {m.n_layers * n} layer calls); rounds "
            + ", ".join(f"{r:.2f}" for r in per_round),
            speed_up,
            f">= {goal:g}x",
            speed_up >= goal,
        ),
        row(
            f"value zeroing n={n}: the best loop time over the best ctxmix time (two moments of a drifting machine: "
            "higher or lower than the rounds' median)",
            f"{t_cm:.2f} s",
            f"{t_loop:.2f} s (loop)",
            t_loop / t_cm,
            "report",
        ),
        row(
            f"value zeroing n={n}: the user's call explain(value_zeroing): speed-up over the per-token loop",
            f"{t_user:.2f} s",
            f"{t_loop:.2f} s (loop)",
            t_loop / t_user,
            "report",
        ),
        user_row(f"value zeroing n={n}", t_user, t_cm, "explain", "value_zeroing_maps(trace_ids)"),
        row(
            f"value zeroing n={n}: max |map difference| vs the loop (engine and explain)",
            f"{diff:.1e}",
            "-",
            None,
            "<= 1e-5",
            diff <= 1e-5,
        ),
        row(
            f"value zeroing n={n}: FLOPs of the loop / FLOPs of ctxmix (the speed-up at equal efficiency)",
            f"{fl_cm / 1e9:.0f} GFLOP",
            f"{fl_loop / 1e9:.0f} GFLOP (loop)",
            fl_loop / fl_cm,
            "report",
        ),
    ]


def bench_flops_and_explain(a, dev, sections) -> list[dict]:
    """Targets 2 and 3: FLOP rates of scope_maps and value zeroing at n=128 against the
    matmul rate, the straightforward scope path, and explain(all) against its parts.

    The matmul rate of a shared or virtual machine drifts, so it is measured before, between
    and after the timed methods, and the best of all (the strictest reference) is used."""
    import ctxmix
    from ctxmix.engine.trace import trace_ids
    from ctxmix.methods.mixing import scope_layer_maps

    n = a.n
    cuda = torch.device(dev).type == "cuda"
    m = bert_base(dev)
    L, d, dff = widths(m)
    ids = ids_for(n)
    ctxmix.explain(m, None, MIXING, input_ids=ids_for(8))  # warm-up
    ctxmix.scope_maps(m, input_ids=ids_for(8))
    size = a.gemm or (8192 if cuda else 2048)
    rates = [matmul_rates(dev, size)]
    parts: dict[str, float] = {}
    if "explain" in sections:
        for meth in MIXING:
            log(f"explain n={n}: {meth} alone")
            parts[meth], _ = timed(lambda: ctxmix.explain(m, None, [meth], input_ids=ids), dev)  # noqa: B023 - called at once
        rates.append(matmul_rates(dev, size))
    t_scope = t_vz = t_slow = t_all = None
    paired: dict[str, list[float]] = {}  # per round: FLOP rate / the matmul rate measured around that round
    if "flops" in sections:
        rounds = a.repeat + 1
        log(f"scope_maps n={n} (factorised): engine and user's call, {rounds} rounds, each followed by the matmul rate")
        calls = {
            "engine": lambda: scope_layer_maps(trace_ids(m, ids)),
            "user": lambda: ctxmix.scope_maps(m, input_ids=ids),
        }
        times, scope_rates, res = paired_rounds(calls, dev, size, rounds)
        t_scope_engine, t_scope, fast = min(times["engine"]), min(times["user"]), res["user"]
        paired["scope"] = paired_ratios(L * 2 * n * n * d * dff, times["user"], scope_rates)
        rates.append(matmul_rates(dev, size))
        log(f"value zeroing n={n}: {rounds} rounds, each followed by the matmul rate")
        times, vz_rates, _ = paired_rounds(
            {"user": lambda: ctxmix.explain(m, None, ["value_zeroing"], input_ids=ids)}, dev, size, rounds
        )
        t_vz = min(times["user"])  # best of the rounds, as the scope row: one run reads a shared machine's drift
        paired["vz"] = paired_ratios(vz_flops(m, n), times["user"], vz_rates)
        log(f"scope maps n={n}, straightforward FF product (factorised=False)")
        t_slow, slow = timed(lambda: scope_layer_maps(trace_ids(m, ids), factorised=False), dev)
        diff = max(float(np.abs(fast[k] - slow[k]).max()) for k in fast)
        scale = max(float(np.abs(slow[k]).max()) for k in slow)
    if "explain" in sections:
        log(f"explain n={n}: all {len(MIXING)} mixing methods together")
        t_all, _ = timed(lambda: ctxmix.explain(m, None, MIXING, input_ids=ids), dev)
        rates.append(matmul_rates(dev, size))
    rate = max(r[0] for r in rates)  # the best sustained rate: the strictest like-for-like reference
    peak = max(r[1] for r in rates)
    rows = [
        row(
            f"dense float32 matmul rate ({size}^3 back to back for 3 s, all FLOPs / all time; "
            f"measured {len(rates)} times in this section)",
            f"{rate / 1e9:.1f} GFLOP/s sustained",
            f"range {min(r[0] for r in rates) / 1e9:.0f}-{rate / 1e9:.0f}; "
            f"best single product {peak / 1e9:.0f} GFLOP/s",
            None,
            "reference for the FLOP rates",
        ),
    ]
    if t_scope is not None:
        fl, fl_vz = L * 2 * n * n * d * dff, vz_flops(m, n)
        goal = 0.60 if cuda else 0.75  # the GPU rate issue's goals: 0.60 of a GPU's rate, 0.75 of a CPU's
        for key, what, flops_text, t, fl_k, call in (
            ("scope", f"scope_maps n={n}", "2 n^2 d d' per layer", t_scope, fl, "scope_maps"),
            ("vz", f"value zeroing n={n}", "2 n^2 (d d' + H d' + H d) per layer", t_vz, fl_vz, "explain"),
        ):
            per_round = paired.get(key)
            if per_round:
                med = float(np.median(per_round))
                rows.append(
                    row(
                        f"{what}: achieved FLOP rate ({flops_text}) / the matmul rate measured around the same "
                        f"round (median of {len(per_round)} rounds)",
                        f"{fl_k / t / 1e9:.1f} GFLOP/s (best {t:.2f} s, {call})",
                        "rounds " + ", ".join(f"{r:.2f}" for r in per_round),
                        med,
                        f">= {goal:.2f}",
                        med >= goal,
                    )
                )
            rows.append(
                row(
                    f"{what}: the best time's FLOP rate / the best sustained matmul rate of the whole section "
                    "(strict: two moments of a drifting machine)",
                    f"{fl_k / t / 1e9:.1f} GFLOP/s ({t:.2f} s)",
                    f"{rate / 1e9:.1f} GFLOP/s ({fl_k / t / peak:.2f} of the best single product)",
                    fl_k / t / rate,
                    "report" if per_round else f">= {goal:.2f}",
                    None if per_round else fl_k / t / rate >= goal,
                )
            )
        rows += [
            user_row(f"scope maps n={n}", t_scope, t_scope_engine, "scope_maps", "scope_layer_maps(trace_ids)"),
            row(
                f"scope_maps n={n}: factorised W_1 vs the straightforward FF product (speed-up)",
                f"{t_scope:.2f} s",
                f"{t_slow:.2f} s (factorised=False)",
                t_slow / t_scope,
                "report",
            ),
            row(
                f"scope_maps n={n}: max |difference| factorised vs straightforward (float32)",
                f"{diff:.1e}",
                f"max |map| {scale:.1f}",
                None,
                "<= 1e-5",
                diff <= 1e-5,
            ),
        ]
    if t_all is not None:
        s = sum(parts.values())
        rows.append(
            row(
                f"explain n={n}, all {len(MIXING)} mixing methods / sum of each alone",
                f"{t_all:.2f} s",
                f"{s:.2f} s (" + ", ".join(f"{k} {v:.1f}" for k, v in parts.items()) + ")",
                t_all / s,
                "<= 1.3",
                t_all / s <= 1.3,
            )
        )
    return rows


def wiki_chunks(model, k: int, max_tokens: int = 128) -> list[str]:
    """k Wikipedia prose chunks of at most `max_tokens` tokens (special tokens included)."""
    try:
        from ctxmix.data import wiki_texts

        pool = wiki_texts(200)
    except Exception as e:  # the data module is another engineer's; fall back to plain prose
        log(f"ctxmix.data.wiki_texts unavailable ({e}); using built-in sentences")
        pool = [
            (
                "The keys to the cabinet are on the table, and the cat that the dogs chase sleeps on the mat "
                "while the children who live next door play in the garden. "
            )
            * 2
        ] * k
    out = [t for t in pool if len(model.encode(t)[0]) <= max_tokens]
    return out[:k]


def wiki_ids(model, n: int) -> list[int]:
    """n token ids of real prose: [CLS], the first n-2 word pieces of consecutive wiki chunks, [SEP]."""
    tok = model.tokenizer
    pieces: list[int] = []
    for text in wiki_chunks(model, 200, max_tokens=model.max_length):
        pieces += tok(text, add_special_tokens=False)["input_ids"]
        if len(pieces) >= n - 2:
            break
    return [tok.cls_token_id] + pieces[: n - 2] + [tok.sep_token_id]


def decompx_flops(L: int, n: int, d: int, dff: int) -> int:
    """DecompX's products per example: per layer the pieces through W_V and W_O (2 n^2 d^2 each),
    the attention mix (2 n^3 d) and the FF's two products (2 n^2 d d' each)."""
    return L * (4 * n * n * d * d + 2 * n**3 * d + 4 * n * n * d * dff)


def bench_predict(a, dev) -> list[dict]:
    """The prediction methods: DecompX's FLOP rate at n tokens on a BERT-base-sized classifier against
    the sustained matmul rate (the scope maps' target: the same n^2 d d' products), and ALTI-Logit's and
    Logit's time per n on a GPT-2-sized random causal LM (weighted sums and L1 distances, not GEMMs)."""
    import transformers as T

    import ctxmix

    n = a.n
    m = bert_base(dev, head=True)
    L, d, dff = widths(m)
    ctxmix.explain(m, None, ["decompx"], input_ids=ids_for(8))  # warm-up
    size = a.gemm or (8192 if torch.device(dev).type == "cuda" else 2048)
    rates = [matmul_rates(dev, size)]
    log(f"decompx n={n}")
    t, ex = timed(lambda: ctxmix.explain(m, None, ["decompx"], input_ids=ids_for(n)), dev)
    rates.append(matmul_rates(dev, size))
    rate = max(r[0] for r in rates)
    fl = decompx_flops(L, n, d, dff)
    rows = [
        row(
            f"decompx n={n} (BERT-base-sized classifier): achieved FLOP rate "
            "(4 n^2 d^2 + 2 n^3 d + 4 n^2 d d' per layer) / sustained matmul rate",
            f"{fl / t / 1e9:.1f} GFLOP/s ({t:.2f} s)",
            f"{rate / 1e9:.1f} GFLOP/s sustained",
            fl / t / rate,
            ">= 0.60",
            fl / t / rate >= 0.6,
        )
    ]
    torch.manual_seed(0)
    cfg = T.GPT2Config(n_positions=1024)
    hf = T.GPT2LMHeadModel(cfg).eval()
    hf.set_attn_implementation("eager")
    lm = ctxmix.model_from_hf(hf.to(dev), tokenizer(), name="gpt2-sized random")
    prev = None
    for k in a.predict_sizes:
        ids = [i % 30000 + 1000 for i in ids_for(k)]
        log(f"alti_logit and logit n={k}")
        tk, _ = timed(lambda: ctxmix.explain(lm, None, ["alti_logit", "logit"], input_ids=ids, foil=1000), dev)  # noqa: B023
        growth = "-" if prev is None else f"growth exponent {np.log(tk / prev[1]) / np.log(k / prev[0]):.2f}"
        rows.append(
            row(
                f"alti_logit + logit n={k} (GPT-2-sized random LM, 12 layers, with a foil): time",
                f"{tk:.2f} s",
                growth,
                None,
                "report",
            )
        )
        prev = (k, tk)
    return rows


def bench_flow(a, dev) -> list[dict]:
    """Attention flow (ctxmix.methods.flow): one row (the CLS row, all 6 layers, L·n max-flows) on
    MiniLM's real attention to Wikipedia prose of n tokens, its growth exponent in n, and the
    estimate (`flow_cost_seconds`, fitted on random attention) that pages and the runner refuse by.
    The max-flows run on one CPU core whatever the device (only the trace uses `dev`)."""
    import ctxmix
    from ctxmix.engine.trace import trace_ids
    from ctxmix.methods.flow import FLOW_ROW_MAX_TOKENS, attention_flow, flow_cost_seconds

    m = ctxmix.load_model("minilm", device=str(dev))
    L = m.n_layers
    attention_flow(np.full((1, 1, 2, 2), 0.5), rows=[0])  # warm-up: imports
    rows, prev = [], None
    for n in sorted(a.flow_sizes):
        ids = wiki_ids(m, n)
        att = np.stack([s.alpha.float().cpu().numpy() for s in trace_ids(m, ids).states])  # (L, H, n, n)
        log(f"attention flow n={len(ids)}: one row ({L} layers, {L * len(ids)} max-flows); and explain")
        t, t_user, _, _ = timed_pair(
            lambda: attention_flow(att, rows=[0]),  # noqa: B023 - called at once
            lambda: ctxmix.explain(m, None, ["attention_flow"], input_ids=ids, position=0),  # noqa: B023
            dev,
            a.repeat,
        )
        growth = (
            "-" if prev is None else f"growth exponent {np.log(t / prev[1]) / np.log(n / prev[0]):.2f} from n={prev[0]}"
        )
        rows.append(
            row(
                f"attention flow, MiniLM ({L} layers), wiki text of n={len(ids)} tokens: one row (CLS, all layers)",
                f"{t:.3f} s per row",
                f"{growth}; estimate {flow_cost_seconds(n, L):.3f} s (random attention fit)",
                None if prev is None else t / prev[1],
                "report",
            )
        )
        rows.append(user_row(f"attention flow n={len(ids)}", t_user, t, "explain", "attention_flow(attention)"))
        prev = (n, t)
    rows.append(
        row(
            f"attention flow: most tokens for one row within a minute ({L} layers, FLOW_ROW_MAX_TOKENS)",
            f"{FLOW_ROW_MAX_TOKENS} tokens",
            f"estimate at n={FLOW_ROW_MAX_TOKENS}: {flow_cost_seconds(FLOW_ROW_MAX_TOKENS, L):.0f} s",
            None,
            "report",
        )
    )
    return rows


def bench_corpus(a, dev) -> list[dict]:
    """contextualization_change throughput: length-bucketed batches against one sequence at a
    time (same run), in float32 and in the tf32 / bf16 engine precisions, and the projected time
    for the FF paper's 992 sequences."""
    import ctxmix

    cuda = torch.device(dev).type == "cuda"
    m = bert_base(dev)
    texts = wiki_chunks(m, a.corpus_texts)
    lens = [len(m.encode(t)[0]) for t in texts]
    ctxmix.contextualization_change(m, ["A short warm-up sentence ."] * 2, progress=False)
    where = "CUDA" if cuda else "CPU"
    log(f"contextualization_change on {len(texts)} wiki chunks ({min(lens)}-{max(lens)} tokens), batched")
    t, df = timed(lambda: ctxmix.contextualization_change(m, texts, progress=False), dev)
    log("  one sequence at a time (batch_size=1)")
    t1, df1 = timed(lambda: ctxmix.contextualization_change(m, texts, progress=False, batch_size=1), dev)
    sps = len(texts) / t
    diff = float((df["change"] - df1["change"]).abs().max())
    goal, ok = (
        (">= 50 seq/s", sps >= 50)
        if cuda
        else (f">= {CORPUS_TODAY_CPU} seq/s (before batching)", sps >= CORPUS_TODAY_CPU)
    )
    rows = [
        row(
            f"contextualization_change, BERT-base (random), {len(texts)} wiki chunks of {min(lens)}-{max(lens)} "
            f"tokens (mean {np.mean(lens):.0f}), {where}, float32, batched",
            f"{sps:.3f} seq/s ({t:.1f} s)",
            f"{len(texts) / t1:.3f} seq/s one sequence at a time ({t1:.1f} s)",
            t1 / t,
            goal,
            ok,
        ),
        row(
            "  batched vs one at a time: max |difference| of the change table",
            f"{diff:.1e}",
            "-",
            None,
            "<= 1e-5",
            diff <= 1e-5,
        ),
        row(
            f"  projected time for the FF paper's 992 sequences (<= 128 tokens), {where}",
            f"{992 / sps / 60:.1f} min",
            "-",
            None,
            "< 20 s on an H100" if cuda else "report",
            (992 / sps < 20) if cuda else None,
        ),
    ]
    for prec in ("tf32", "bf16"):
        log(f"  precision {prec}")
        tp, dfp = timed(lambda: ctxmix.contextualization_change(m, texts, progress=False, precision=prec), dev)  # noqa: B023 - called at once
        d = float((dfp["change"] - df["change"]).abs().max())
        rows.append(
            row(
                f"  contextualization_change in {prec}: throughput / float32's (change differs by {d:.1e})",
                f"{len(texts) / tp:.3f} seq/s",
                f"{sps:.3f} seq/s float32",
                t / tp,
                ">= 3x" if cuda else "report (CPU: tf32 is float32)",
                (t / tp >= 3) if cuda else None,
            )
        )
    return rows


def bench_batch(a, dev) -> list[dict]:
    """FLOP rates of the batched scope maps and value zeroing: B sequences of n tokens in one call."""
    from ctxmix.engine.trace import trace_batch_tensors
    from ctxmix.methods.mixing import scope_maps_batch, value_zeroing_maps_batch

    cuda = torch.device(dev).type == "cuda"
    B, n = a.batch or (32 if cuda else 4), a.n
    m = bert_base(dev)
    L, d, dff = widths(m)
    tb = trace_batch_tensors(m, [ids_for(n)] * B)
    small = trace_batch_tensors(m, [ids_for(8)] * 2)
    scope_maps_batch(small)
    value_zeroing_maps_batch(small)
    rate = matmul_rates(dev, a.gemm or (8192 if cuda else 2048))[0]
    log(f"batched scope maps and value zeroing, {B} x {n} tokens")
    t_s, _ = timed(lambda: scope_maps_batch(tb), dev)
    t_v, _ = timed(lambda: value_zeroing_maps_batch(tb), dev)
    # the user's call on the same batch: explain_batch traces it too, so the engine side includes the trace
    import ctxmix
    from ctxmix.methods.registry import POST_LN_SCOPES

    batch = [ids_for(n)] * B
    user_rows = []
    for what, meths, fn in (
        ("scope maps", list(POST_LN_SCOPES), scope_maps_batch),
        ("value zeroing", ["value_zeroing"], value_zeroing_maps_batch),
    ):
        log(f"  {what}: engine (trace + maps) and explain_batch, interleaved")
        te, tu, _, _ = timed_pair(
            lambda fn=fn: fn(trace_batch_tensors(m, batch)),
            lambda meths=meths: ctxmix.explain_batch(m, batch, meths),
            dev,
        )
        user_rows.append(
            user_row(f"{what}, batch of {B} x {n}", tu, te, "explain_batch", f"{fn.__name__}(trace_batch_tensors)")
        )
    fl_s, fl_v = B * L * 2 * n * n * d * dff, B * vz_flops(m, n)
    goal = ">= 0.50" if cuda else "report (CPU goal: the one-sequence rows)"
    long_rows = []
    if cuda:  # one long sequence: all 8 mixing methods, and the scope maps (minutes on a CPU: GPU only)
        import ctxmix

        ids = ids_for(512)
        t_e, _ = timed(lambda: ctxmix.explain(m, None, MIXING, input_ids=ids), dev)
        t_sc, _ = timed(lambda: ctxmix.scope_maps(m, input_ids=ids), dev)
        long_rows = [
            row("explain n=512, all 8 mixing methods, float32", f"{t_e:.2f} s", "-", None, "~0.3 s", t_e <= 0.45),
            row("scope_maps n=512, float32", f"{t_sc:.2f} s", "-", None, "~0.3 s", t_sc <= 0.45),
        ]
    return (
        long_rows
        + user_rows
        + [
            row(
                f"scope maps, batch of {B} x {n} tokens: FLOP rate / sustained matmul rate",
                f"{fl_s / t_s / 1e9:.1f} GFLOP/s ({t_s:.2f} s)",
                f"{rate / 1e9:.1f} GFLOP/s",
                fl_s / t_s / rate,
                goal,
                (fl_s / t_s / rate >= 0.5) if cuda else None,
            ),
            row(
                f"value zeroing, batch of {B} x {n} tokens: FLOP rate / sustained matmul rate",
                f"{fl_v / t_v / 1e9:.1f} GFLOP/s ({t_v:.2f} s)",
                f"{rate / 1e9:.1f} GFLOP/s",
                fl_v / t_v / rate,
                goal,
                (fl_v / t_v / rate >= 0.5) if cuda else None,
            ),
        ]
    )


def budget_child(fraction: float, n: int, k: int, device: str) -> dict:
    """contextualization_change on k sequences of n tokens on a card cut to `fraction` of its memory."""
    import ctxmix
    from ctxmix.analyses.corpus import plan_batches

    torch.cuda.set_per_process_memory_fraction(fraction)
    m = bert_base(device)
    torch.cuda.reset_peak_memory_stats()
    words = ("the keys to the cabinet are on the table and the cat sleeps " * 60).split()
    text = " ".join(words[: n - 2])
    texts = [text] * k
    sizes = [len(b) for b in plan_batches(m, [len(m.encode(text)[0])] * k)]
    t0 = time.perf_counter()
    ctxmix.contextualization_change(m, texts, progress=False)
    torch.cuda.synchronize()
    return {
        "seconds": time.perf_counter() - t0,
        "peak_GB": torch.cuda.max_memory_allocated() / 2**30,
        "limit_GB": fraction * torch.cuda.get_device_properties(0).total_memory / 2**30,
        "batches": sizes,
    }


def bench_budget(a, dev) -> list[dict]:
    """A 16 GB card simulated on a bigger one: n=512 batches sized from the budget must not run out."""
    if torch.device(dev).type != "cuda":
        return [row("n=512 corpus batches on a simulated 16 GB card", "skipped (no CUDA)", "-", None, "report")]
    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    frac = min(1.0, 16 / total)
    log(f"simulated 16 GB card (memory fraction {frac:.2f}): 16 sequences of 512 tokens")
    try:
        r = run_child(["--budget-child", json.dumps([frac, 512, 16, str(dev)])])
    except RuntimeError as e:
        return [
            row(
                "n=512 corpus batches on a simulated 16 GB card",
                "failed",
                str(e).splitlines()[-1][:100],
                None,
                "no out-of-memory",
                False,
            )
        ]
    return [
        row(
            f"n=512 contextualization_change, 16 sequences, memory capped at {r['limit_GB']:.1f} GB",
            f"peak {r['peak_GB']:.1f} GB, {r['seconds']:.1f} s",
            f"batches of {r['batches']}",
            None,
            "no out-of-memory",
            r["peak_GB"] <= r["limit_GB"],
        )
    ]


def bench_embedded(a, dev) -> list[dict]:
    """configs/embedded.yaml end to end (minilm-sentiment built beforehand, not timed)."""
    from ctxmix import benchmark as runner

    cuda = torch.device(dev).type == "cuda"
    runner.get_model("minilm-sentiment", str(dev))  # builds it once if needed
    plan = runner.load_config(ROOT / "configs" / "embedded.yaml")
    for ms in plan.models:
        ms.device = str(dev)
    with tempfile.TemporaryDirectory() as tmp:
        log("configs/embedded.yaml end to end")
        t0 = time.perf_counter()
        runner.run_bench(plan, db=Path(tmp) / "e.sqlite", quiet=True)
        sync(dev)
        t = time.perf_counter() - t0
    return [
        row(
            "configs/embedded.yaml end to end (minilm-sentiment already built)",
            f"{t:.1f} s",
            "-",
            None,
            "<= 15 s on an H100" if cuda else "report",
            (t <= 15) if cuda else None,
        )
    ]


def memory_child(n: int, layers: int, device: str) -> dict:
    """One scope_maps memory measurement in this (fresh) process."""
    import ctxmix

    m = bert_base(device, layers=layers)
    cuda = m.device.type == "cuda"
    ctxmix.scope_maps(m, input_ids=ids_for(8))  # warm-up
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() / 2**20
    else:
        import gc

        gc.collect()
        reset = reset_peak_rss()
        base = rss_mb()
    t0 = time.perf_counter()
    ctxmix.scope_maps(m, input_ids=ids_for(n))
    sync(device)
    sec = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else peak_rss_mb()
    what = (
        "torch.cuda.max_memory_allocated"
        if cuda
        else "peak RSS, reset after loading"
        if reset
        else "peak RSS, loading included"
    )
    return {
        "n": n,
        "layers": layers,
        "peak_MB": peak,
        "base_MB": base,
        "extra_MB": peak - base,
        "seconds": sec,
        "what": what,
    }


LONG_WORKLOADS = {  # name -> the methods explain runs (routes: ctxmix.routes at the last position)
    "routes": None,
    "alti": ["alti"],
    "norm family": ["norm", "norm_res", "norm_res_ln", "globenc"],
    "value zeroing": ["value_zeroing"],
}
LONG_VZ_MAX = 1024  # value zeroing's ~n^2 L forward passes: measured up to here, extrapolated beyond
LONG_ROW_SECONDS = 600  # a row longer than this is stopped and reported as such


def long_model(device: str):
    """smollm2 on a CPU; on CUDA a randomly initialised 1B-size Llama built from its config (no real
    weights travel to a GPU machine), eager attention."""
    import ctxmix

    if torch.device(device).type != "cuda":
        return ctxmix.load_model("smollm2", device=device)
    import transformers as T

    torch.manual_seed(0)
    cfg = T.LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        max_position_embeddings=8192,
        rope_theta=10000.0,
    )  # TinyLlama-1.1B's shape
    hf = T.LlamaForCausalLM._from_config(cfg, attn_implementation="eager").to(device).eval()
    tok = T.AutoTokenizer.from_pretrained(ctxmix.engine.embedded.minilm_path())
    return ctxmix.model_from_hf(hf, tok, name="random 1.1B Llama (TinyLlama shape)")


def long_child(n: int, workload: str, device: str) -> dict:
    """One long-input measurement in this fresh process: seconds and peak memory over the loaded model."""
    import ctxmix

    m = long_model(device)
    vocab = min(len(m.tokenizer), int(m.config.vocab_size))
    ids = [(7919 * i + 11) % (vocab - 200) + 100 for i in range(n)]  # ordinary ids, deterministic
    methods = LONG_WORKLOADS[workload]
    run = (
        (lambda: ctxmix.routes(m, input_ids=ids))
        if methods is None
        else (lambda: ctxmix.explain(m, None, methods, input_ids=ids))
    )
    from ctxmix.engine.budget import memory_budget
    from ctxmix.engine.trace import streams

    budget = memory_budget(m.device) / 2**20  # the share one job may use, read before the run
    streamed = streams(m, n)
    res, sec, extra = timed_peak(run, device)
    L = m.n_layers
    returned = 0.0  # the maps the call hands back (routes: a graph of a few thousand rows, counted as 0)
    if methods is not None:
        returned = sum(a.nbytes for d in (res.layer_maps, res.global_maps, res.head_maps) for a in d.values()) / 2**20
    return {
        "n": n,
        "seconds": sec,
        "extra_MB": extra,
        "model": m.name,
        "layers": L,
        "maps_MB": L * n * n * 8 / 2**20,
        "returned_MB": returned,
        "budget_MB": budget,
        "streamed": streamed,
    }


def bench_long(a, dev) -> list[dict]:
    """Long inputs on a causal LM (smollm2 on a CPU, a random 1.1B Llama on CUDA): routes, ALTI, the norm
    family and value zeroing (to LONG_VZ_MAX tokens, extrapolated beyond) at each n, each in a fresh
    process: time, peak memory over the loaded model against the L n^2 float64 map one method returns, and
    the growth exponent of both from the previous n. A row over LONG_ROW_SECONDS is stopped."""
    cuda = torch.device(dev).type == "cuda"
    sizes = sorted(a.long_sizes or ([1024, 2048, 4096, 8192] if cuda else [256, 512, 1024, 2048]))
    rows = []
    for workload in a.long_workloads:
        prev = None
        for n in sizes:
            if workload == "value zeroing" and n > LONG_VZ_MAX:
                if prev is not None and prev.get("exp"):
                    est = prev["seconds"] * (n / prev["n"]) ** prev["exp"]
                    rows.append(
                        row(
                            f"long input, {workload}, n={n}",
                            f"~{est:.0f} s (extrapolated)",
                            f"exponent {prev['exp']:.2f} from the measured sizes",
                            None,
                            "report",
                        )
                    )
                continue
            log(f"long input: {workload} n={n} (fresh process)")
            try:
                r = run_child(["--long-child", json.dumps([n, workload, str(dev)])], timeout=LONG_ROW_SECONDS)
            except subprocess.TimeoutExpired:
                rows.append(
                    row(
                        f"long input, {workload}, n={n}",
                        f"over {LONG_ROW_SECONDS} s (stopped)",
                        "-",
                        None,
                        "< 600 s",
                        False,
                    )
                )
                break
            except RuntimeError as e:
                rows.append(
                    row(f"long input, {workload}, n={n}", "failed", str(e).splitlines()[-1][:80], None, "-", False)
                )
                break
            exp_t = exp_m = None
            if prev is not None:
                exp_t = float(np.log(r["seconds"] / prev["seconds"]) / np.log(n / prev["n"]))
                if r["extra_MB"] > 0 and prev["extra_MB"] > 0:
                    exp_m = float(np.log(r["extra_MB"] / prev["extra_MB"]) / np.log(n / prev["n"]))
            grow = (
                "-"
                if exp_t is None
                else f"exponents: time {exp_t:.2f}" + ("" if exp_m is None else f", memory {exp_m:.2f}")
            )
            bound = r["returned_MB"] + r["budget_MB"]
            rows.append(
                row(
                    f"long input, {workload}, {r['model']} ({r['layers']} layers), n={n}: time; peak memory over model",
                    f"{r['seconds']:.1f} s; +{r['extra_MB'] / 1024:.2f} GB",
                    f"{grow}; bound {bound / 1024:.2f} GB = maps returned {r['returned_MB'] / 1024:.2f} GB"
                    f" + budget {r['budget_MB'] / 1024:.2f} GB; "
                    + ("streamed trace" if r["streamed"] else "stored trace"),
                    None,
                    "< 600 s, peak <= bound",
                    r["seconds"] < LONG_ROW_SECONDS and r["extra_MB"] <= bound,
                )
            )
            prev = {**r, "exp": exp_t}
    return rows


def run_child(args: list[str], timeout: float | None = None) -> dict:
    r = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), *args], capture_output=True, text=True, timeout=timeout
    )
    if r.returncode:
        raise RuntimeError(r.stderr[-3000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def bench_memory(a, dev) -> list[dict]:
    """Target 5: peak memory of scope_maps in fresh processes, and its growth in n.

    Sizes below 512 use the 12-layer model; n >= 512 uses `--mem-layers-512` layers (12 on CUDA;
    fewer on CPU by default, where 12 layers at n=512 take minutes: the pieces are chunked per
    layer, so a layer's working memory does not depend on the number of layers). When that
    differs from 12, the smallest size is also measured on the same model, so the growth
    exponent compares like with like."""
    rows, res = [], []
    cuda = torch.device(dev).type == "cuda"
    big_layers = a.mem_layers_512 or (12 if cuda else CPU_LAYERS_512)
    runs = [(n, 12 if n < 512 else big_layers) for n in sorted(a.mem_sizes)]
    if big_layers != 12 and max(a.mem_sizes) >= 512 and min(a.mem_sizes) < 512:
        runs.append((min(a.mem_sizes), big_layers))
    for n, layers in runs:
        log(f"scope_maps memory n={n} ({layers} layers), fresh process")
        try:
            r = run_child(["--memory-child", json.dumps([n, layers, str(dev)])])
        except RuntimeError as e:
            rows.append(row(f"scope_maps peak memory n={n} ({layers} layers)", "failed", str(e).splitlines()[-1][:80]))
            continue
        res.append(r)
        rows.append(
            row(
                f"scope_maps n={n}, BERT-base width, {layers} layers: peak memory ({r['what']})",
                f"{r['peak_MB'] / 1024:.2f} GB total, {r['extra_MB']:.0f} MB extra",
                f"{r['base_MB']:.0f} MB after loading; {r['seconds']:.1f} s",
                None,
                "report",
            )
        )
    top = [r for r in res if r["n"] >= 512]
    if top:
        r = top[0]
        note = "" if r["layers"] == 12 else f" ({r['layers']}-layer model, see --mem-layers-512)"
        rows.append(
            row(
                f"scope_maps n={r['n']}: peak memory under 4 GB{note}",
                f"{r['peak_MB'] / 1024:.2f} GB",
                "4 GB",
                r["peak_MB"] / 4096,
                "< 4 GB",
                r["peak_MB"] < 4096,
            )
        )
    for layers in dict.fromkeys(r["layers"] for r in res):
        pts = sorted((r["n"], r["extra_MB"]) for r in res if r["layers"] == layers and r["extra_MB"] > 0)
        if len(pts) >= 2:
            slope = float(np.polyfit(np.log([p[0] for p in pts]), np.log([p[1] for p in pts]), 1)[0])
            rows.append(
                row(
                    f"scope_maps extra-memory growth exponent in n, {layers} layers, n={pts[0][0]}..{pts[-1][0]} "
                    f"(log-log slope)",
                    f"{slope:.2f}",
                    ", ".join(f"n={p[0]}: {p[1]:.0f} MB" for p in pts),
                    None,
                    "report",
                )
            )
    return rows


# ----------------------------------------------------------------------------- main


def build_parser(quick: bool = False) -> argparse.ArgumentParser:
    """The command line of this script (`bench/gpu_check.py --rate` reads its defaults); `quick`: --quick's
    smaller sizes as the defaults (sizes given explicitly still win)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto", help="auto (CUDA if available), cpu or cuda")
    ap.add_argument("--quick", action="store_true", help="smaller sizes (named in the table)")
    ap.add_argument("--only", nargs="+", choices=SECTIONS, help="run only these sections")
    ap.add_argument("--out", help="also write the table as CSV")
    ap.add_argument("--inseq-venv", help="a virtualenv with inseq 0.7.1 and transformers 4.46.3")
    ap.add_argument("--vz-n", type=int, default=64, help="tokens for the value-zeroing comparison")
    ap.add_argument("--n", type=int, default=128, help="tokens for the FLOP-rate and explain targets")
    ap.add_argument("--corpus-texts", type=int, default=16, help="wiki chunks for the corpus throughput")
    ap.add_argument("--mem-sizes", type=int, nargs="+", default=[64, 128, 256, 512])
    ap.add_argument(
        "--mem-layers-512",
        type=int,
        default=0,
        help="layers of the model for n >= 512 memory (default: 12 on CUDA, 2 on CPU to fit 10 minutes)",
    )
    ap.add_argument("--predict-sizes", type=int, nargs="+", default=[64, 128, 256], help="tokens for ALTI-Logit")
    ap.add_argument("--ig-n", type=int, default=32, help="tokens for the integrated-gradients comparison")
    ap.add_argument("--inseq-n", type=int, default=61, help="tokens for the inseq comparison")
    ap.add_argument("--inseq-layers", type=int, default=12)
    ap.add_argument("--flow-sizes", type=int, nargs="+", default=[16, 32, 64, 128], help="tokens for attention flow")
    ap.add_argument("--gemm", type=int, default=0, help="matmul size for the reference rate (2048 CPU, 8192 CUDA)")
    ap.add_argument(
        "--repeat",
        type=int,
        default=2,
        help="best of this many runs for the value-zeroing comparison, scope_maps and IG",
    )
    ap.add_argument("--batch", type=int, default=0, help="sequences of the batched FLOP-rate rows (32 CUDA, 4 CPU)")
    ap.add_argument("--memory-child", help=argparse.SUPPRESS)
    ap.add_argument("--long-child", help=argparse.SUPPRESS)
    ap.add_argument("--long-sizes", type=int, nargs="+", help="tokens for --only long (CPU 256..2048, CUDA 1024..8192)")
    ap.add_argument(
        "--long-workloads",
        nargs="+",
        default=list(LONG_WORKLOADS),
        choices=list(LONG_WORKLOADS),
        help="what --only long measures",
    )
    ap.add_argument("--budget-child", help=argparse.SUPPRESS)
    add_context_arguments(ap)
    if quick:
        ap.set_defaults(vz_n=32, n=64, corpus_texts=4, ig_n=16, mem_sizes=[64, 128, 512], inseq_layers=2, repeat=1)
    return ap


def main() -> None:
    a = build_parser("--quick" in sys.argv[1:]).parse_args()
    from ctxmix.engine.budget import keep_cpu_buffers

    keep_cpu_buffers()  # as the CLI does: this process is ours (measured 15-25 % on value zeroing)

    if a.memory_child:
        n, layers, device = json.loads(a.memory_child)
        print(json.dumps(memory_child(n, layers, device)))
        return
    if a.long_child:
        n, workload, device = json.loads(a.long_child)
        print(json.dumps(long_child(n, workload, device)))
        return
    if a.context_child:
        print(json.dumps(context_child(*json.loads(a.context_child))))
        return
    if a.context_eval_child:
        print(json.dumps(context_eval_child(*json.loads(a.context_eval_child))))
        return
    if a.budget_child:
        frac, n, k, device = json.loads(a.budget_child)
        print(json.dumps(budget_child(frac, n, k, device)))
        return

    import pandas as pd
    import transformers

    import ctxmix

    transformers.utils.logging.disable_progress_bar()
    dev = ctxmix.engine.placement.resolve_device(a.device)
    sections = a.only or [s for s in SECTIONS if dev.type == "cuda" or s not in CPU_SKIPS]
    t_start = time.perf_counter()
    load0 = os.getloadavg()[0]
    log(f"device {dev}: {machine(dev)}; load average {load0:.1f}")
    rows: list[dict] = []
    steps = [
        ("vz", lambda: bench_value_zeroing(a, dev)),
        ("flops", lambda: bench_flops_and_explain(a, dev, sections)),
        ("batch", lambda: bench_batch(a, dev)),
        ("corpus", lambda: bench_corpus(a, dev)),
        ("memory", lambda: bench_memory(a, dev)),
        ("budget", lambda: bench_budget(a, dev)),
        ("ig", lambda: bench_ig(a, dev)),
        (
            "inseq",
            lambda: (
                bench_inseq(a, dev)
                if a.inseq_venv
                else [row("inseq 0.7.1 value_zeroing", "skipped (give --inseq-venv PATH)", "-", None, "report")]
            ),
        ),
        ("precision", lambda: bench_precision(a, dev)),
        ("embedded", lambda: bench_embedded(a, dev)),
        ("flow", lambda: bench_flow(a, dev)),
        ("predict", lambda: bench_predict(a, dev)),
        ("long", lambda: bench_long(a, dev)),
        ("context", lambda: bench_context(a, dev)),
        ("scale", lambda: bench_scale(a, dev)),
        ("onepass", lambda: bench_onepass(a, dev)),
    ]
    for name, fn in steps:
        if name == "flops" and not ({"flops", "explain"} & set(sections)):
            continue
        if name != "flops" and name not in sections:
            continue
        try:
            rows += fn()
        except Exception as e:  # one failing target must not hide the others
            import traceback

            traceback.print_exc()
            rows.append(row(f"{name}", "failed", f"{type(e).__name__}: {e}"[:100], None, "-", False))
    total = time.perf_counter() - t_start
    df = pd.DataFrame(rows, columns=["target", "measured", "baseline", "ratio", "goal", "pass"])
    print(f"ctxmix performance on {dev}: {machine(dev)}")
    print(
        f"total {total / 60:.1f} min; load average {load0:.1f} at start, {os.getloadavg()[0]:.1f} at end"
        + ("; --quick" if a.quick else "")
    )
    print(table_text(df))
    if a.out:
        df.to_csv(a.out, index=False)
        log(f"wrote {a.out}")


if __name__ == "__main__":
    main()
