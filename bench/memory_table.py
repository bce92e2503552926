"""The memory estimate (`ctxmix.estimate_memory`) of each call for the models ctxmix's users study, from their
configs (no weights): Llama-3-8B and Qwen3-8B on one 80 GB card, Llama-3-70B over 2 and 4 of them, in bf16, at
4k, 16k and 32k tokens. Estimated, not measured: a GPU run measures it (bench/perf_scale.py's CUDA rows).

    python bench/memory_table.py            # a markdown table (GiB on the fullest device; "no" where over 80 GB)
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import ctxmix  # noqa: E402

CARD = 80 * 10**9
MODELS = {
    "Llama-3-8B, 1 GPU": ("llama-3-8b", None),
    "Qwen3-8B, 1 GPU": ("qwen3-8b", None),
    "Llama-3-70B, 2 GPUs": ("llama-3-70b", {0: 40, 1: 40}),
    "Llama-3-70B, 4 GPUs": ("llama-3-70b", {0: 20, 1: 20, 2: 20, 3: 20}),
}
CALLS = [
    ("attribute_context(logit, attention)", dict(call="attribute_context", methods=["logit", "attention"])),
    ("attribute_context(contextcite, 32)", dict(call="attribute_context", methods=["contextcite"])),
    ("explain(alti)", dict(call="explain", methods=["alti"])),
    ("scope_maps", dict(call="scope_maps")),
    ("routes", dict(call="routes")),
]
LENGTHS = (4096, 16384, 32768)


def cell(est) -> str:
    gpu = max((b for d, b in est.by_device.items() if d.startswith("cuda")), default=0)
    host = est.by_device.get("cpu", 0)
    text = f"{gpu / 2**30:.0f}" + ("" if est.fits(CARD) or gpu > CARD else "")
    text += "" if gpu <= CARD else " (no)"
    return text + (f" + host {host / 2**30:.0f}" if host else "")


def main() -> None:
    print("| model | call | " + " | ".join(f"{n // 1024}k tokens" for n in LENGTHS) + " |")
    print("|---|---|" + "---|" * len(LENGTHS))
    from ctxmix.methods.memory import reference_config

    for name, (ref, split) in MODELS.items():
        cfg = reference_config(ref)
        for label, kw in CALLS:
            ests = [
                ctxmix.estimate_memory(
                    cfg, n, dtype="bfloat16", device="cuda", layers_per_device=split, device_memory=CARD, **kw
                )
                for n in LENGTHS
            ]
            print(f"| {name} | {label} | " + " | ".join(cell(e) for e in ests) + " |")


if __name__ == "__main__":
    main()
