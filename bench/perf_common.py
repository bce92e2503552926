"""Shared by bench/perf.py: the value-zeroing baseline it times, timing and memory helpers, the
random BERT-base model it measures and the rows of its table. (bench/perf.py keeps the targets.)"""

from __future__ import annotations

import os
import platform
import resource
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

# ----------------------------------------------------------------------------- the baseline


@torch.no_grad()
def value_zeroing_loop(model, input_ids: list[int]) -> np.ndarray:
    """The official value-zeroing algorithm, one Hugging Face layer call per zeroed token.

    For each layer l and token t: call layer l alone on the model's own input to that layer,
    with a forward hook on the value projection that zeroes v_t = x_t W_V + b_V (all heads,
    bias included); Q, K and the attention weights are recomputed by the layer as in the
    official code. C[l, i, t] = 1 - cos(y_i with v_t zeroed, y_i) in float64, clipped at 0,
    then rows normalised to sum to one. Returns (L, n, n).

    BERT-like post-LN encoders (BERT, RoBERTa, ELECTRA: a separate value Linear and a layer
    that runs without a mask on one unpadded sequence), as in the paper.

    This is the *timing* baseline: it costs what the official code costs (one layer call per
    zeroed token). The every-family *correctness* reference is `ctxmix.verify.value_zeroing_loop`,
    which runs the whole model with the hook (a layer called alone needs family-specific
    arguments: rotary embeddings, masks), so its cost is not the official algorithm's.
    """
    from ctxmix.engine.arch import _get

    if model.spec.family not in ("BERT", "RoBERTa", "ELECTRA"):
        raise ValueError(f"the per-token baseline is written for BERT-like encoders, not {model.spec.family}")
    ids = torch.tensor([list(input_ids)], device=model.device)
    H = model.hf(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True).hidden_states
    layers = _get(model.hf.base_model, model.spec.layers)
    n, L = len(input_ids), len(layers)
    C = torch.zeros(L, n, n, dtype=torch.float64, device=model.device)
    for l, layer in enumerate(layers):
        value = _get(layer, model.spec.value)
        ref = H[l + 1][0].double()
        for t in range(n):

            def zero_v_t(mod, inp, out, t=t):
                out = out.clone()
                out[:, t, :] = 0.0
                return out

            handle = value.register_forward_hook(zero_v_t)
            try:
                y = layer(H[l])
            finally:
                handle.remove()
            y = y[0] if isinstance(y, tuple) else y
            cos = torch.nn.functional.cosine_similarity(y[0].double(), ref, dim=-1)
            C[l, :, t] = (1.0 - cos).clamp(min=0.0)
    C = C.cpu().numpy()
    s = C.sum(-1, keepdims=True)
    return C / np.where(s > 0, s, 1.0)


# ----------------------------------------------------------------------------- helpers


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, repeat: int = 1):
    """(best seconds of `repeat` runs, result of the last run)."""
    best, out = float("inf"), None
    for _ in range(repeat):
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best, out


def timed_pair(engine, user, device, repeat: int = 3):
    """(engine seconds, user seconds, engine result, user result): the best of `repeat` runs of each,
    interleaved (engine, user, engine, user, ...) so that a shared machine's drift hits both alike."""
    te = tu = float("inf")
    re = ru = None
    for _ in range(max(1, repeat)):
        t, re = timed(engine, device)
        te = min(te, t)
        t, ru = timed(user, device)
        tu = min(tu, t)
    return te, tu, re, ru


def paired_rounds(fns: dict, device, size: int, rounds: int, seconds: float = 1.0) -> tuple[dict, list[float], dict]:
    """({name: [seconds per round]}, [sustained matmul rate before round 1, after round 1, ..., after the last],
    {name: the last result}): each round runs every fn once, then measures the matmul rate for `seconds`. A
    call's FLOP rate over the better of the two rates measured just before and just after its round is then a
    ratio of two numbers taken under the same machine state: on a shared machine the matmul rate drifts by a
    third within a minute (seen here: 161-232 GFLOP/s in one section), which a section-wide best rate mixes in.
    seconds = 0: no matmul rate (rates []), for calls compared with each other round by round."""
    times: dict = {k: [] for k in fns}
    results: dict = {}
    rates = [matmul_rates(device, size, seconds)[0]] if seconds > 0 else []
    for _ in range(max(1, rounds)):
        for k, fn in fns.items():
            t, results[k] = timed(fn, device)
            times[k].append(t)
        if seconds > 0:
            rates.append(matmul_rates(device, size, seconds)[0])
    return times, rates, results


def paired_ratios(flops: float, times: list[float], rates: list[float]) -> list[float]:
    """Each round's FLOP rate over the better of the matmul rates around it (see `paired_rounds`)."""
    return [flops / t / max(rates[k], rates[k + 1]) for k, t in enumerate(times)]


def user_row(what: str, t_user: float, t_engine: float, user: str, engine: str) -> dict:
    """A row comparing the call a user makes with the engine function a speed row times, on the same
    input in the same process: ratio = user / engine, and the overhead in seconds (tracing, checks and
    bookkeeping the engine row does not see)."""
    return row(
        f"{what}: the user's call {user} vs the engine's {engine}",
        f"{t_user:.3f} s (user)",
        f"{t_engine:.3f} s (engine); overhead {t_user - t_engine:+.3f} s",
        t_user / t_engine,
        "report",
    )


def ids_for(n: int) -> list[int]:
    """A deterministic n-token input: [CLS], n-2 ordinary word pieces, [SEP]."""
    return [101] + [1000 + (7 * i) % 20000 for i in range(n - 2)] + [102]


def tokenizer():
    import transformers as T

    import ctxmix

    return T.AutoTokenizer.from_pretrained(ctxmix.engine.embedded.minilm_path())


def bert_base(device, layers: int = 12, head: bool = False, dtype=torch.float32, seed: int = 0):
    """A BERT-base-sized random model (d=768, d'=3072, 12 heads), eager attention."""
    import transformers as T

    import ctxmix

    torch.manual_seed(seed)
    cfg = T.BertConfig(num_hidden_layers=layers)
    hf = (T.BertForSequenceClassification(cfg) if head else T.BertModel(cfg, add_pooling_layer=False)).eval()
    hf.set_attn_implementation("eager")
    hf = hf.to(device=device, dtype=dtype)
    name = f"bert-base-sized random ({layers} layers{', classifier' if head else ''})"
    return ctxmix.model_from_hf(hf, tokenizer(), name=name)


def matmul_rates(device, size: int, seconds: float = 3.0) -> tuple[float, float]:
    """(sustained, peak) float32 FLOP/s of (size x size) @ (size x size) products run back to back
    for `seconds` (at least 10): sustained = all FLOPs / all time, measured the way the methods
    are (one wall time over many GEMMs); peak = the best single product."""
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    for _ in range(2):
        a @ b
    sync(device)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 10 or time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        a @ b
        sync(device)
        times.append(time.perf_counter() - t0)
    fl = 2 * size**3
    return fl * len(times) / sum(times), fl / min(times)


def rss_mb() -> float:
    """Current resident set size of this process."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mb() -> float:
    """Peak resident set size: VmHWM (reset by `reset_peak_rss`), else ru_maxrss. ru_maxrss alone
    is not enough: it also keeps the peak of threads that exited (e.g. while loading the model)."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0), so that building the model is not counted."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def widths(model) -> tuple[int, int, int]:
    """(L, d, d') of a plain-FF model."""
    lw = model.layers[0]
    return model.n_layers, lw.W2.shape[1], lw.W2.shape[0]


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine(device) -> str:
    if torch.device(device).type == "cuda":
        return f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda}), torch {torch.__version__}"
    return f"{cpu_name()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads, torch {torch.__version__}"


def row(target, measured, baseline="-", ratio=None, goal="report", ok=None) -> dict:
    return {
        "target": target,
        "measured": measured,
        "baseline": baseline,
        "ratio": "-" if ratio is None else (f"{ratio:.2f}" if abs(ratio) >= 0.01 else f"{ratio:.1e}"),
        "goal": goal,
        "pass": "-" if ok is None else ("yes" if ok else "NO"),
    }


def table_text(df) -> str:
    """The table as text, cells left-aligned (pandas right-aligns strings)."""
    w = {c: max(len(c), *(len(str(v)) for v in df[c])) if len(df) else len(c) for c in df.columns}
    lines = ["  ".join(f"{c:<{w[c]}}" for c in df.columns)]
    lines += ["  ".join(f"{str(v):<{w[c]}}" for c, v in zip(df.columns, r)) for r in df.itertuples(index=False)]
    return "\n".join(line.rstrip() for line in lines)


def markdown_table(df) -> str:
    """The table as markdown (pandas' to_markdown needs tabulate, which ctxmix does not install)."""
    head = "| " + " | ".join(map(str, df.columns)) + " |"
    rule = "|" + "|".join("---" for _ in df.columns) + "|"
    return "\n".join([head, rule] + ["| " + " | ".join(map(str, r)) + " |" for r in df.itertuples(index=False)])


def log(msg: str) -> None:
    print(f"[perf {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def timed_peak(run, device) -> tuple:
    """(run()'s result, seconds, peak memory over the start in MB) in this process: CUDA's peak allocation,
    else the peak RSS (reset first), after a garbage collection."""
    import gc

    cuda = torch.device(device).type == "cuda"
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() / 2**20
    else:
        reset_peak_rss()
        base = rss_mb()
    t0 = time.perf_counter()
    res = run()
    sync(device)
    sec = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else peak_rss_mb()
    return res, sec, peak - base
