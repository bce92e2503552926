"""Where the time of scope maps and value zeroing goes: torch.profiler over the engine's calls at n tokens on the
random BERT-base model of bench/perf.py, each op's self time grouped into matrix products, elementwise passes,
reductions, copies and layout, and the rest; with the FLOPs each call cannot avoid (bench/perf.py's counts) over
the time of its products alone, against the sustained matmul rate measured in the same run.

If the products run near the matmul rate and the rest is elementwise passes and copies over the (c, n, d') and
(c, n, d) temporaries, fusing those passes is what lifts the call's rate; if the products themselves run slowly,
their shapes are. Prints a markdown table per call and the top ops.

    python bench/profile_passes.py                  # n = 128, this machine's device
    python bench/profile_passes.py --n 64 --only vz --top 20
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from perf_common import bert_base, ids_for, matmul_rates, sync, widths

MATMUL = {"aten::mm", "aten::bmm", "aten::addmm", "aten::addmm_", "aten::baddbmm", "aten::baddbmm_", "aten::addbmm"}
MATMUL |= {"aten::_scaled_mm", "mkl::_mkl_linear", "mkldnn::_linear_pointwise"}
REDUCTION = {"aten::sum", "aten::mean", "aten::norm", "aten::linalg_vector_norm", "aten::amax", "aten::max"}
REDUCTION |= {"aten::min", "aten::amin", "aten::cumsum", "aten::var_mean", "aten::std"}
COPY = {"aten::copy_", "aten::clone", "aten::contiguous", "aten::cat", "aten::stack", "aten::index"}
COPY |= {"aten::index_select", "aten::gather", "aten::_to_copy", "aten::to", "aten::fill_", "aten::zero_"}
COPY |= {"mkl::_mkl_reorder_linear_weight", "mkldnn::_reorder_linear_weight"}
COPY |= {"aten::zeros", "aten::empty", "aten::empty_strided", "aten::new_zeros", "aten::index_put_", "aten::scatter_"}
ELEMENTWISE = {"aten::mul", "aten::mul_", "aten::add", "aten::add_", "aten::sub", "aten::sub_", "aten::div"}
ELEMENTWISE |= {"aten::div_", "aten::abs", "aten::abs_", "aten::sqrt", "aten::rsqrt", "aten::pow", "aten::neg"}
ELEMENTWISE |= {"aten::clamp", "aten::clamp_", "aten::clamp_min", "aten::clamp_min_", "aten::maximum", "aten::where"}
ELEMENTWISE |= {
    "aten::gelu",
    "aten::gelu_",
    "aten::silu_",
    "aten::relu_",
    "aten::erf",
    "aten::exp",
    "aten::tanh",
    "aten::relu",
    "aten::addcmul_",
    "aten::lerp",
}
ELEMENTWISE |= {"aten::reciprocal", "aten::sign", "aten::square", "aten::softmax", "aten::_softmax", "aten::silu"}
ELEMENTWISE |= {"aten::addcmul", "aten::ne", "aten::eq", "aten::native_layer_norm", "aten::layer_norm"}
CATEGORIES = ("matrix products", "elementwise", "reductions", "copies and allocation", "other")


def category(op: str) -> str:
    if op in MATMUL:
        return "matrix products"
    if op in ELEMENTWISE:
        return "elementwise"
    if op in REDUCTION:
        return "reductions"
    if op in COPY:
        return "copies and allocation"
    return "other"


def profile(fn, device, shapes_too: bool = False) -> tuple[dict, dict]:
    """({op: (self seconds, calls)}, {(product op, input shapes): (self seconds, calls, FLOPs)}) of one call of fn
    (after a warm-up call), on the device's own timeline. shapes_too records input shapes, which on a CPU slows the
    memory-bound ops several times (measured: GELU 0.43 s -> 2.2 s): it names the slow products; time it without."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    fn()
    sync(device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.device(device).type == "cuda" else [])
    with torch_profile(activities=acts, record_shapes=shapes_too) as prof:
        fn()
        sync(device)
    cuda = torch.device(device).type == "cuda"
    out, shapes = {}, {}
    for e in prof.key_averages():
        us = e.self_device_time_total if cuda else e.self_cpu_time_total
        if us > 0:
            out[e.key] = (us / 1e6, e.count)
    for e in prof.key_averages(group_by_input_shape=True) if shapes_too else []:
        us = e.self_device_time_total if cuda else e.self_cpu_time_total
        if e.key in MATMUL and us > 0:
            shapes[(e.key, str(e.input_shapes))] = (us / 1e6, e.count, _product_flops(e.key, e.input_shapes))
    return out, shapes


def _product_flops(op: str, shapes) -> int:
    """The FLOPs of one product from its input shapes (mm/addmm: (a, b) x (b, c); bmm/baddbmm: batched; MKL's
    packed linear: input (a, b), packed weight, weight (c, b))."""
    mats = [s for s in shapes if len(s) in (2, 3)]
    if op == "mkl::_mkl_linear":
        return 2 * shapes[0][0] * shapes[0][1] * shapes[2][0] if len(shapes) > 2 and len(shapes[2]) == 2 else 0
    if op in ("aten::addmm", "aten::baddbmm", "aten::baddbmm_"):
        mats = mats[1:3] if len(mats) >= 3 else mats[-2:]
    if len(mats) < 2:
        return 0
    x, y = mats[0], mats[1]
    batch = x[0] if len(x) == 3 else 1
    return 2 * batch * x[-2] * x[-1] * y[-1]


def by_category(ops: dict) -> dict[str, float]:
    """Self seconds per category (CATEGORIES) of `profile`'s {op: (seconds, calls)}."""
    by: dict[str, float] = defaultdict(float)
    for op, (s, _) in ops.items():
        by[category(op)] += s
    return {c: by[c] for c in CATEGORIES}


def report(name: str, profiled: tuple, flops: int, rate: float, top: int) -> str:
    ops, shapes = profiled
    by = by_category(ops)
    total = sum(by.values())
    lines = [f"### {name}", "", "| part | seconds | share |", "|---|---|---|"]
    lines += [f"| {c} | {by[c]:.3f} | {by[c] / total:.0%} |" for c in CATEGORIES if by[c] > 0]
    mm = by["matrix products"]
    lines += [
        f"| all (profiled self time) | {total:.3f} | 100% |",
        "",
        f"FLOPs the call cannot avoid {flops / 1e9:.0f} G: over the whole call {flops / total / 1e9:.1f} GFLOP/s "
        f"({flops / total / rate:.2f} of the matmul rate), over its products alone {flops / mm / 1e9:.1f} GFLOP/s "
        f"({flops / mm / rate:.2f}); sustained matmul rate {rate / 1e9:.1f} GFLOP/s.",
        "",
        "| op | part | seconds | calls |",
        "|---|---|---|---|",
    ]
    for op, (s, k) in sorted(ops.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"| `{op}` | {category(op)} | {s:.3f} | {k} |")
    if shapes:
        lines += ["", "| product, input shapes | seconds | calls | GFLOP/s | of the matmul rate |"]
        lines += ["|---|---|---|---|---|"]
    for (op, shp), (s, k, fl) in sorted(shapes.items(), key=lambda kv: -kv[1][0])[: max(3, top // 2)]:
        r = fl * k / s if s else 0.0
        lines.append(f"| `{op}` {shp} | {s:.3f} | {k} | {r / 1e9:.0f} | {r / rate:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    from perf import vz_flops

    from ctxmix.engine.trace import trace_ids
    from ctxmix.methods.mixing import scope_layer_maps, value_zeroing_maps

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=128, help="tokens (default 128, bench/perf.py's flops row)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--only", nargs="+", choices=["scope", "vz"], default=["scope", "vz"])
    p.add_argument("--top", type=int, default=12, help="ops listed per call")
    p.add_argument(
        "--shapes",
        action="store_true",
        help="also each product's input shapes and rate (the profiler then slows the memory-bound ops: read their "
        "times from a run without it)",
    )
    a = p.parse_args()
    m = bert_base(a.device)
    L, d, dff = widths(m)
    ids = ids_for(a.n)
    rate = matmul_rates(a.device, 8192 if torch.device(a.device).type == "cuda" else 2048)[0]
    calls = {
        "scope": (f"scope_layer_maps(trace_ids), n={a.n}", lambda: scope_layer_maps(trace_ids(m, ids)), 0),
        "vz": (f"value_zeroing_maps(trace_ids), n={a.n}", lambda: value_zeroing_maps(trace_ids(m, ids)), 0),
    }
    flops = {"scope": L * 2 * a.n * a.n * d * dff, "vz": vz_flops(m, a.n)}
    print(f"{m.name}, {a.device}, torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    for key in a.only:
        name, fn, _ = calls[key]
        print(report(name, profile(fn, a.device, a.shapes), flops[key], rate, a.top))
    rate_after = matmul_rates(a.device, 8192 if torch.device(a.device).type == "cuda" else 2048)[0]
    print(f"matmul rate after: {rate_after / 1e9:.1f} GFLOP/s (before {rate / 1e9:.1f}: the machine's drift)")


if __name__ == "__main__":
    main()
