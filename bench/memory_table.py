"""The memory estimate (`ctxmix.estimate_memory`) of each call for the models ctxmix's users study, from their
configs (no weights): Llama-3-8B and Qwen3-8B on one 80 GB card, Llama-3-70B over 2 and 4 of them, in bf16, at
4k, 16k and 32k tokens. Estimated, not measured: a GPU run measures it (bench/perf_scale.py's CUDA rows).

    python bench/memory_table.py            # a markdown table (GiB on the fullest device; "no" where over 80 GB)
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import transformers as T  # noqa: E402

import ctxmix  # noqa: E402

CARD = 80 * 10**9
LLAMA3_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    num_hidden_layers=32,
    vocab_size=128256,
    max_position_embeddings=131072,
    rope_theta=500000.0,
    tie_word_embeddings=False,
)
MODELS = {
    "Llama-3-8B, 1 GPU": (T.LlamaConfig(**LLAMA3_8B), None),
    "Qwen3-8B, 1 GPU": (
        T.Qwen3Config(
            hidden_size=4096,
            intermediate_size=12288,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            num_hidden_layers=36,
            vocab_size=151936,
            max_position_embeddings=40960,
            tie_word_embeddings=False,
        ),
        None,
    ),
    "Llama-3-70B, 2 GPUs": (
        T.LlamaConfig(
            **{
                **LLAMA3_8B,
                "hidden_size": 8192,
                "intermediate_size": 28672,
                "num_attention_heads": 64,
                "num_hidden_layers": 80,
            }
        ),
        {0: 40, 1: 40},
    ),
    "Llama-3-70B, 4 GPUs": (
        T.LlamaConfig(
            **{
                **LLAMA3_8B,
                "hidden_size": 8192,
                "intermediate_size": 28672,
                "num_attention_heads": 64,
                "num_hidden_layers": 80,
            }
        ),
        {0: 20, 1: 20, 2: 20, 3: 20},
    ),
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
    for name, (cfg, dm) in MODELS.items():
        for label, kw in CALLS:
            ests = [
                ctxmix.estimate_memory(cfg, n, dtype="bfloat16", device="cuda", device_map=dm, device_memory=CARD, **kw)
                for n in LENGTHS
            ]
            print(f"| {name} | {label} | " + " | ".join(cell(e) for e in ests) + " |")


if __name__ == "__main__":
    main()
