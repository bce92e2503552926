"""bench/perf.py's comparisons with other tools and precisions: Integrated Gradients against
captum, value zeroing against inseq (in its own virtualenv), and the bf16/tf32/half-precision
rows. (Split from perf.py to keep each script readable; perf.py runs them.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from perf_common import bert_base, ids_for, log, row, timed, timed_pair, tokenizer, user_row  # noqa: E402

MIXING = ["attention", "attention_rollout", "norm", "norm_res", "norm_res_ln", "globenc", "alti", "value_zeroing"]


def bench_ig(a, dev) -> list[dict]:
    """Target 6: ctxmix.methods.saliency.integrated_gradients against captum's IntegratedGradients."""
    from captum.attr import IntegratedGradients

    from ctxmix.engine.trace import trace_ids
    from ctxmix.methods.saliency import integrated_gradients, resolve_target

    m = bert_base(dev, head=True)
    n, steps = a.ig_n, 50
    ids = ids_for(n)
    tr = trace_ids(m, ids)
    target = resolve_target(m, tr, None, 0)
    hf = m.hf
    x = torch.tensor([ids], device=m.device)
    special = set(m.tokenizer.all_special_ids)
    base_ids = torch.tensor([[t if t in special else m.tokenizer.pad_token_id for t in ids]], device=m.device)
    emb = hf.get_input_embeddings()

    def captum_ig():
        E = emb(x).detach()
        B = emb(base_ids).detach()

        def f(e):  # the probability of the target class, softmax in float64 (as ctxmix's _score)
            mask = torch.ones(e.shape[:2], dtype=torch.long, device=e.device)
            return torch.softmax(hf(inputs_embeds=e, attention_mask=mask).logits.double(), -1)[:, target].to(e.dtype)

        with torch.enable_grad():
            attr = IntegratedGradients(f).attribute(E, baselines=B, n_steps=steps)  # captum's defaults otherwise
        return attr[0].sum(-1).abs().double().cpu().numpy()

    def ctxmix_ig():
        return integrated_gradients(m, tr, target, 0, baseline="pad", n_steps=steps)

    ids_short = ids_for(8)  # warm-up both
    integrated_gradients(m, trace_ids(m, ids_short), target, 0, n_steps=4)
    log(f"integrated gradients n={n}, {steps} steps: captum directly, then ctxmix")
    t_cap, ref = timed(captum_ig, dev, a.repeat)
    import ctxmix

    def user_ig():  # the call a user makes: traces the input itself
        ex = ctxmix.explain(m, None, ["integrated_gradients"], input_ids=ids, ig_baseline="pad", ig_steps=steps)
        return ex.saliency["integrated_gradients"]

    t_cm, t_user, got, got_user = timed_pair(ctxmix_ig, user_ig, dev, a.repeat)
    diff = max(float(np.abs(ref - got).max()), float(np.abs(ref - got_user).max()))
    return [
        row(
            f"integrated_gradients n={n}, {steps} steps, [PAD] baseline: speed-up over captum IntegratedGradients",
            f"{t_cm:.2f} s",
            f"{t_cap:.2f} s (captum defaults)",
            t_cap / t_cm,
            ">= 1x",
            t_cap / t_cm >= 0.95,
        ),
        user_row(f"integrated_gradients n={n}", t_user, t_cm, "explain", "integrated_gradients(traced)"),
        row(
            f"integrated_gradients n={n}: max |difference| vs captum (engine and explain)",
            f"{diff:.1e}",
            f"max |score| {float(np.abs(ref).max()):.1e}",
            None,
            "<= 1e-5",
            diff <= 1e-5,
        ),
    ]


INSEQ_CHILD = r"""
import json, sys, time
import numpy as np, torch, transformers as T, inseq
from inseq.attr.feat.ops import value_zeroing as vzmod

tok_path, out_dir, n_target, layers = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
text = open(out_dir + "/text.txt").read()
torch.manual_seed(0)
cfg = T.GPT2Config(vocab_size=30522, bos_token_id=101, eos_token_id=102, n_layer=layers)
hf = T.GPT2LMHeadModel._from_config(cfg, attn_implementation="eager").eval()
hf.save_pretrained(out_dir + "/model", safe_serialization=True)
tok = T.AutoTokenizer.from_pretrained(tok_path)
captured = {}
orig = vzmod.ValueZeroing.compute_modules_post_zeroing_similarity
def capture(self, inputs, *a, **k):  # keep inseq's whole (batch, zeroed j, output i, layer) score tensor
    out = orig(self, inputs, *a, **k)
    captured["scores"] = out.detach().float().cpu().clone()
    return out
vzmod.ValueZeroing.compute_modules_post_zeroing_similarity = capture
model = inseq.load_model(hf, "value_zeroing", tokenizer=tok)
words = text.split()
model.attribute(input_texts=words[0], generated_texts=" ".join(words[:6]), show_progress=False)  # warm-up
t0 = time.perf_counter()
res = model.attribute(input_texts=words[0], generated_texts=text, show_progress=False)
sec = time.perf_counter() - t0
S = captured["scores"][0]  # (j, i, L): inseq scores the prefix before the last target token
n = S.shape[0]
ids = [t.id for t in res.sequence_attributions[0].target][:n]
maps = torch.nan_to_num(S.permute(2, 1, 0), nan=0.0).numpy()  # (L, i, j)
np.save(out_dir + "/inseq_maps.npy", maps)
print(json.dumps({"seconds": sec, "ids": ids, "n": n, "transformers": T.__version__, "torch": torch.__version__}))
"""


def bench_inseq(a, dev) -> list[dict]:
    """Target 7: inseq 0.7.1's value zeroing (own virtualenv) against ctxmix on the same weights."""
    import transformers as T

    import ctxmix
    from ctxmix.engine.trace import trace_ids
    from ctxmix.methods.mixing import value_zeroing_maps

    py = Path(a.inseq_venv) / "bin" / "python"
    if not py.exists():
        return [row("inseq 0.7.1 value_zeroing", "skipped", f"no {py}", None, "report")]
    tok = tokenizer()
    # a Wikipedia text cut so that inseq's prefix (everything but the last target token) has ~inseq_n tokens
    try:
        from ctxmix.data import wiki_texts

        words = " ".join(wiki_texts(20)).split()
    except Exception:
        words = (
            "The keys to the cabinet are on the table , and the cat that the dogs chase sleeps on the mat "
            "while the children who live next door play in the garden . "
        ).split() * 6
    k = 1
    while k < len(words) and len(tok(" ".join(words[: k + 1]))["input_ids"]) <= a.inseq_n + 1:
        k += 1
    text = " ".join(words[:k])
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "text.txt").write_text(text)
        Path(tmp, "child.py").write_text(INSEQ_CHILD)
        log(f"inseq 0.7.1 value zeroing in {a.inseq_venv} (GPT-2-base-sized random, ~{a.inseq_n} tokens)")
        r = subprocess.run(
            [
                str(py),
                str(Path(tmp, "child.py")),
                ctxmix.engine.embedded.minilm_path(),
                tmp,
                str(a.inseq_n),
                str(a.inseq_layers),
            ],
            capture_output=True,
            text=True,
            env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1"},
        )
        if r.returncode:
            err = [s for s in r.stderr.strip().splitlines() if s.strip()][-1:] or ["?"]
            return [row("inseq 0.7.1 value_zeroing", "failed", err[0][:100], None, "report")]
        info = json.loads(r.stdout.strip().splitlines()[-1])
        ref = np.load(Path(tmp, "inseq_maps.npy"))
        hf = T.GPT2LMHeadModel.from_pretrained(Path(tmp, "model"), attn_implementation="eager").eval()
    # same device as inseq (CPU): a like-for-like time
    m = ctxmix.model_from_hf(hf, tok, name="gpt2-base-sized random")
    ids = info["ids"]
    value_zeroing_maps(trace_ids(m, ids[:8]))  # warm-up
    ctxmix.explain(m, None, ["value_zeroing"], input_ids=ids[:8])
    t_cm, t_user, got, _ = timed_pair(
        lambda: value_zeroing_maps(trace_ids(m, ids)),
        lambda: ctxmix.explain(m, None, ["value_zeroing"], input_ids=ids),
        "cpu",
    )
    # inseq takes the cosine in float32, sets distances below 1e-5 to 0 before normalising rows, and
    # compares the last layer after GPT-2's final norm (ln_f, from the model's output) where ctxmix
    # uses the raw layer output; so the last layer is apart, and so are the layers where the 1e-5
    # threshold zeroed scores (a random GPT-2's deep layers have distances around 1e-5)
    low = np.tril(np.ones(ref.shape[1:], dtype=bool))
    inner = list(range(len(ref) - 1))
    cut = [l for l in inner if ((ref[l] == 0) & low & (got[l] > 0)).any()]
    kept = [l for l in inner if l not in cut]
    d_kept = max((float(np.abs(ref[l] - got[l]).max()) for l in kept), default=float("nan"))
    d_cut = max((float(np.abs(ref[l] - got[l]).max()) for l in cut), default=float("nan"))
    last = float(np.abs(ref[-1] - got[-1]).max())
    span = (
        (
            f"layers {kept[0] + 1}-{kept[-1] + 1}"
            if kept == list(range(kept[0], kept[-1] + 1))
            else "layers " + ",".join(str(l + 1) for l in kept)
        )
        if kept
        else "no layer"
    )
    return [
        row(
            f"value zeroing, GPT-2-base-sized random ({m.n_layers} layers), n={info['n']}, CPU: speed-up over "
            f"inseq 0.7.1 (transformers {info['transformers']})",
            f"{t_cm:.2f} s",
            f"{info['seconds']:.1f} s (inseq)",
            info["seconds"] / t_cm,
            "report",
        ),
        user_row(f"value zeroing GPT-2-base-sized n={info['n']}", t_user, t_cm, "explain", "value_zeroing_maps"),
        row(
            f"  max |map difference| vs inseq, {span} (inseq: float32 cosine)",
            f"{d_kept:.1e}",
            f"{len(cut)} layers where inseq's 1e-5 threshold zeroed scores: {d_cut:.1e}; last layer (ln_f): {last:.1e}",
            None,
            "report",
        ),
    ]


PRECISION_TEXT = (
    "The keys to the cabinet are on the table , and the cat that the dogs chase sleeps on the mat "
    "while the children who live next door play in the garden ."
)
# the CPU kernels torch picks on other machines: ATen's portable and AVX2 kernels (read at import), and
# oneDNN capped at AVX2 (only bf16 GEMMs that torch sends to oneDNN change: CPUs with AVX-512)
KERNEL_SETTINGS = {
    "native": {},
    "ATEN_CPU_CAPABILITY=default": {"ATEN_CPU_CAPABILITY": "default"},
    "ATEN_CPU_CAPABILITY=avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "ONEDNN_MAX_CPU_ISA=AVX2": {"ONEDNN_MAX_CPU_ISA": "AVX2"},
}


def precision_child(device: str) -> dict:
    """In this process's kernels: every map of every engine precision and half dtype against the
    float32 map, relative to its largest entry ({label: {map: error}}), and what torch reports."""
    import ctxmix
    from ctxmix.methods.registry import POST_LN_SCOPES

    methods = MIXING + list(POST_LN_SCOPES)
    m32 = ctxmix.load_model("minilm", device=device)
    ex32 = ctxmix.explain(m32, PRECISION_TEXT, methods)
    ref = ex32.layer_maps
    out = {
        "_n": len(ex32.tokens),
        "_kernels": f"{torch.backends.cpu.get_cpu_capability()}, oneDNN bf16 "
        f"{'yes' if torch.ops.mkldnn._is_mkldnn_bf16_supported() else 'no'}",
    }

    def errs(ex):
        return {k: float(np.abs(ex.layer_maps[k] - ref[k]).max() / np.abs(ref[k]).max()) for k in methods}

    for prec in ("tf32", "bf16"):
        out[f"engine precision {prec} (float32 weights)"] = errs(
            ctxmix.explain(m32, PRECISION_TEXT, methods, precision=prec)
        )
    for dt in ("float16", "bfloat16"):
        try:
            m = ctxmix.load_model("minilm", device=device, dtype=dt)
            out[f"model loaded in {dt}"] = errs(ctxmix.explain(m, PRECISION_TEXT, methods))
        except Exception as e:  # report, do not stop the table
            out[f"model loaded in {dt}"] = f"{type(e).__name__}: {e}"[:100]
    return out


def bench_precision(a, dev) -> list[dict]:
    """Every map, every engine precision (tf32, bf16 on the same float32 weights) and every half
    dtype the model may be loaded in, against the float32 map, relative to its largest entry, on
    MiniLM's real weights (their rounding is what a user meets). On a CPU, once per kernel setting
    (KERNEL_SETTINGS, each in its own process), with the bound each test derives from the formats."""
    from ctxmix.engine.precision import bf16_product_bound, half_model_map_bound

    goals = {
        "engine precision tf32 (float32 weights)": 1e-3,  # CUDA's TF32 keeps 11 bits (2^-11, a few products)
        "engine precision bf16 (float32 weights)": bf16_product_bound(),
        "model loaded in float16": half_model_map_bound(torch.float16, 6),
        "model loaded in bfloat16": half_model_map_bound(torch.bfloat16, 6),
    }
    settings = KERNEL_SETTINGS if dev.type == "cpu" else {"native": {}}
    rows = []
    for setting, env in settings.items():
        log(f"precision rows, {setting}")
        r = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--precision-child", str(dev)],
            capture_output=True,
            text=True,
            env={**os.environ, **env},
        )
        if r.returncode:
            rows.append(row(f"precision, {setting}", "failed", r.stderr.strip()[-100:], None, "-", False))
            continue
        res = json.loads(r.stdout.strip().splitlines()[-1])
        kernels, n = res.pop("_kernels"), res.pop("_n")
        for label, goal in goals.items():
            e = res[label]
            target = f"MiniLM n={n}, {label}, {setting} ({kernels}): max |map - float32 map| / max |float32 map|"
            if isinstance(e, str):
                rows.append(row(target, "failed", e, None, f"<= {goal:.2g}", False))
                continue
            worst = max(e, key=e.get)
            rows.append(
                row(
                    target,
                    f"{e[worst]:.1e} ({worst})",
                    ", ".join(f"{k} {v:.0e}" for k, v in e.items()),
                    None,
                    f"<= {goal:.2g}",
                    e[worst] <= goal,
                )
            )
    return rows


if __name__ == "__main__":
    if sys.argv[1:2] == ["--precision-child"]:
        from ctxmix.engine.budget import keep_cpu_buffers

        keep_cpu_buffers()
        print(json.dumps(precision_child(sys.argv[2])))
