"""The memory account and `ctxmix.estimate_memory`: exact weights from a config, the real Llama-3-8B on one 80 GB
card, the account against the live tensors of real calls, and the refusal before any forward pass."""

from __future__ import annotations

import json
import os
import weakref

import pytest
import torch
import transformers as T
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import ctxmix
from ctxmix.engine import memory as acct
from ctxmix.methods import memory as mem

GB = 10**9
LLAMA3_8B = {k: v for k, v in mem.REFERENCE_CONFIGS["llama-3-8b"].items() if k not in ("model_type", "dtype")}
LLAMA3_8B_PARAMETERS = 8_030_261_248  # the published count of Meta-Llama-3-8B


def test_weights_of_a_config_are_counted_exactly_without_allocating():
    cfg = T.LlamaConfig(**LLAMA3_8B)
    est = ctxmix.estimate_memory(
        cfg, 4096, call="attribute_context", methods=["logit"], dtype="bfloat16", device="cuda"
    )
    assert est.parts["cuda:0"]["weights (as stored)"] == 2 * LLAMA3_8B_PARAMETERS
    assert est.weights_counted and est.budget["cuda:0"] == mem.DEFAULT_CARD_BYTES
    f32 = ctxmix.estimate_memory(cfg, 4096, call="attribute_context", methods=["logit"], dtype="float32", device="cpu")
    assert f32.parts["cpu"]["weights (as stored)"] == 4 * LLAMA3_8B_PARAMETERS
    # bf16 layers are decomposed on a float32 copy of one layer at a time: V, O and the gated FF
    W = acct.widths_of(cfg, "bfloat16")
    assert W.layer_copy == 4 * (4096 * 1024 + 4096 * 4096 + 3 * 4096 * 14336)


def test_llama3_8b_bf16_on_one_80gb_card():
    """attribute_context(logit) at 32k tokens and explain(alti) at 8k fit an 80 GB card; explain(alti) at 32k does
    not, and the estimate names its largest part and what shrinks it."""
    cfg = T.LlamaConfig(**LLAMA3_8B)
    kw = dict(dtype="bfloat16", device="cuda", device_memory=80 * GB)
    ctx = ctxmix.estimate_memory(cfg, 32768, call="attribute_context", methods=["logit"], **kw)
    assert ctx.fits() and ctx.peak_bytes < 80 * GB
    # no n x n map at all: SDPA's causal masking needs none (Llama has no sliding window), and the response rows'
    # probabilities are computed a block of rows at a time; the largest parts grow as n (hidden states), not H n^2
    assert "sliding-window mask (n x n, boolean)" not in ctx.parts["cuda:0"]
    assert not any("mask" in k for k in ctx.parts["cuda:0"])
    assert max(ctx.parts["cuda:0"].values()) == ctx.parts["cuda:0"]["weights (as stored)"]
    alti = ctxmix.estimate_memory(cfg, 8192, call="explain", methods=["alti"], **kw)
    assert alti.fits(), str(alti)
    big = ctxmix.estimate_memory(cfg, 32768, call="explain", methods=["alti"], **kw)
    assert not big.fits()
    name, dev, size = big.largest
    assert size == max(big.parts[dev].values()) and name in big.message() and "to shrink it" in big.message()


def test_a_sliding_window_counts_sdpas_boolean_mask():
    """A sliding-window family's SDPA pass gets a boolean (1, 1, n, n) mask once n reaches the window (transformers'
    `sdpa_mask` cannot skip it then): one byte a cell in the rows pass's estimate; none below the window."""
    cfg = T.MistralConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        sliding_window=4096,
        vocab_size=32000,
    )
    kw = dict(call="attribute_context", methods=["logit"], dtype="bfloat16", device="cuda")
    part = "sliding-window mask (n x n, boolean)"
    assert ctxmix.estimate_memory(cfg, 8192, **kw).parts["cuda:0"][part] == 8192**2
    assert part not in ctxmix.estimate_memory(cfg, 2048, **kw).parts["cuda:0"]


def test_70b_spread_over_gpus_splits_its_layers():
    cfg = mem.reference_config("llama-3-70b")
    two = ctxmix.estimate_memory(
        cfg, 4096, call="attribute_context", methods=["logit"], dtype="bfloat16", layers_per_device={0: 40, 1: 40}
    )
    w0, w1 = (two.parts[d]["weights (as stored)"] for d in ("cuda:0", "cuda:1"))
    W = acct.widths_of(cfg, "bfloat16")
    assert w0 + w1 == W.weights and w0 - w1 == W.ends  # the embeddings and the head stay on the first device
    # the forward pass's own transient is on every device that runs layers; the engine's work on the first
    layer_part = "one layer's forward transient (a block of attention rows or MLP)"
    assert layer_part in two.parts["cuda:1"] and "response logits" not in two.parts["cuda:1"]
    with pytest.raises(ctxmix.BadInput, match="layers_per_device"):
        ctxmix.estimate_memory(cfg, 16, layers_per_device="auto")


def test_layers_per_device_is_the_estimates_layer_split_and_device_map_its_deprecated_name():
    """`layers_per_device` spreads a config's layers; `device_map`, its old name (which means accelerate's module
    -> device map everywhere else), still works for one release with a DeprecationWarning and gives the same
    estimate; both at once are refused."""
    cfg = mem.reference_config("llama-3-70b")
    kw = dict(call="attribute_context", methods=["logit"], dtype="bfloat16", device="cuda")
    new = ctxmix.estimate_memory(cfg, 4096, layers_per_device={"cuda:0": 40, "cuda:1": 40}, **kw)
    with pytest.warns(DeprecationWarning, match="use layers_per_device"):
        old = ctxmix.estimate_memory(cfg, 4096, device_map={"cuda:0": 40, "cuda:1": 40}, **kw)
    assert set(new.parts) == {"cuda:0", "cuda:1"}
    assert old.parts == new.parts and old.peak_bytes == new.peak_bytes
    with pytest.raises(ctxmix.BadInput, match="layers_per_device only"):
        ctxmix.estimate_memory(cfg, 4096, layers_per_device={"cuda:0": 80}, device_map={"cuda:0": 80}, **kw)


class LiveTensorBytes(TorchDispatchMode):
    """The bytes of the tensors alive during a block (every storage an op creates, until its last tensor goes) and
    their peak; storages that existed before (the weights) are not counted."""

    def __init__(self, existing):
        super().__init__()
        self.old = {t.untyped_storage().data_ptr() for t in existing}
        self.refs: dict[int, int] = {}
        self.size: dict[int, int] = {}
        self.seen: dict[int, weakref.ref] = {}
        self.live = self.peak = 0

    def _drop(self, key: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            self.live -= self.size.pop(key)
            del self.refs[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            known = self.seen.get(id(t))
            if known is not None and known() is t:
                continue
            try:
                key, nbytes = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
            except NotImplementedError:  # an opaque tensor (MKL's packed weight): no storage, its own bytes
                key, nbytes = id(t), t.numel() * t.element_size()
            if key == 0 or key in self.old:
                continue
            self.seen[id(t)] = weakref.ref(t)
            if key not in self.refs:
                self.size[key] = nbytes
                self.live += self.size[key]
                self.refs[key] = 0
            self.refs[key] += 1
            weakref.finalize(t, self._drop, key)
        self.peak = max(self.peak, self.live)
        return out


def _random_llama(tokenizer, **widths):
    """A float32 random Llama of the given widths, 2 layers (the vocabulary covers the test tokenizer's ids)."""
    cfg = T.LlamaConfig(
        num_hidden_layers=2, vocab_size=30528, max_position_embeddings=4096, tie_word_embeddings=False, **widths
    )
    torch.manual_seed(0)
    hf = T.LlamaForCausalLM._from_config(cfg, attn_implementation="eager").eval()
    tok = T.AutoTokenizer.from_pretrained(ctxmix.engine.embedded.minilm_path())
    tok.model_max_length = 4096
    return ctxmix.model_from_hf(hf, tok, name="random-llama-memory")


def _text(tok, n: int) -> str:
    words = (" ".join(ctxmix.data.lee_background())).split()
    lo, hi = 1, len(words)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if len(tok(" ".join(words[:mid]))["input_ids"]) <= n else (lo, mid - 1)
    return " ".join(words[:lo])


@pytest.mark.slow
@pytest.mark.parametrize(
    "call, n",
    [
        ("explain", 384),
        ("scope_maps", 96),
        ("routes", 512),
        ("attribute_context", 768),
        ("contextcite", 512),
        ("grad_x_input", 512),
        ("key_mask_grad", 512),
    ],
)
def test_the_estimate_is_within_a_third_of_the_live_tensors(tokenizer, call, n):
    """The account against the peak of the tensors a real call holds (counted by a dispatch mode, so the test does
    not depend on the allocator or the machine): within [0.75, 1.33], on widths where the large parts dominate
    (d 512, d' 2048, 8 heads over 2 KV heads)."""
    model = _random_llama(
        tokenizer, hidden_size=512, intermediate_size=2048, num_attention_heads=8, num_key_value_heads=2
    )
    text = _text(model.tokenizer, n)
    resp = " It rained and the fire went out."
    ask = dict(query="What happened?", response=resp, progress=False, prompt={"query_suffix": ""})  # n_tok's prompt
    runs = {
        "explain": (lambda: ctxmix.explain(model, text, ["alti"]), dict(call="explain", methods=["alti"])),
        "scope_maps": (lambda: ctxmix.scope_maps(model, text), dict(call="scope_maps")),
        "routes": (lambda: ctxmix.routes(model, text), dict(call="routes")),
        "attribute_context": (
            lambda: ctxmix.attribute_context(model, text, methods=["logit", "attention"], **ask),
            dict(call="attribute_context", methods=["logit", "attention"]),
        ),
        "contextcite": (
            lambda: ctxmix.attribute_context(model, text, methods=["contextcite"], n_ablations=8, **ask),
            dict(call="attribute_context", methods=["contextcite"], n_ablations=8),
        ),
    }
    for m in ("grad_x_input", "key_mask_grad"):  # a forward pass kept for the backward
        runs[m] = (
            lambda m=m: ctxmix.attribute_context(model, text, methods=[m], **ask),
            dict(call="attribute_context", methods=[m]),
        )
    run, kw = runs[call]
    n_tok = len(model.tokenizer(text)["input_ids"])
    if kw["call"] == "attribute_context":
        kw["n_response"] = len(model.tokenizer(resp)["input_ids"])
        n_tok += kw["n_response"] + 8  # the template's query and separators
    est = ctxmix.estimate_memory(model, n_tok, **kw)
    with LiveTensorBytes(list(model.hf.parameters()) + list(model.hf.buffers())) as live:
        run()
    ratio = est.live_peak_bytes / live.peak  # without what the CPU's allocator keeps: not a live tensor
    assert 0.75 <= ratio <= 1.33, f"{call}: estimate {est.peak_bytes / 2**20:.1f} MiB, live {live.peak / 2**20:.1f} MiB"


def _forward_counter(model):
    calls = []
    handle = model.hf.register_forward_pre_hook(lambda *a: calls.append(1))
    return calls, handle


@pytest.mark.parametrize("call", ["explain", "scope_maps", "routes", "attribute_context"])
def test_a_call_over_the_budget_is_refused_before_any_forward_pass(tokenizer, monkeypatch, call):
    model = _random_llama(
        tokenizer, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2
    )
    text = "The cat sat on the mat. It looked at the door for a long while."
    run = {
        "explain": lambda: ctxmix.explain(model, text, ["alti"]),
        "scope_maps": lambda: ctxmix.scope_maps(model, text),
        "routes": lambda: ctxmix.routes(model, text),
        "attribute_context": lambda: ctxmix.attribute_context(
            model, text, "Where?", response=" On the mat.", methods=["logit"], progress=False
        ),
    }[call]
    calls, handle = _forward_counter(model)
    try:
        monkeypatch.setattr(mem, "_capacity", lambda *a, **k: 1024)  # a device that gives 1 KiB
        with pytest.raises(mem.OutOfMemoryBudget) as err:
            run()
        assert calls == []  # refused before the model ran at all
        assert "Largest part:" in str(err.value) and err.value.estimate.largest[0] in str(err.value)
        assert "CTXMIX_MEMORY_CHECK=0" in str(err.value)
        monkeypatch.setenv("CTXMIX_MEMORY_CHECK", "0")  # the user's override: it runs
        run()
        assert calls
    finally:
        handle.remove()


def test_the_ablation_batch_in_the_estimate_is_the_one_the_passes_use(tokenizer, monkeypatch):
    """The estimate's ablation batch is `ablation_batch_size`'s (the same account sizes both)."""
    from ctxmix.methods.context import ablation

    model = _random_llama(
        tokenizer, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2
    )
    n, T = 300, 5
    S = n // mem.TOKENS_PER_SOURCE  # the longest ablated prompt of a ContextCite batch: 1/2 + 2 sd kept
    width = min(n, T + int(n * (0.5 + S**-0.5)))
    per = ablation.ablation_sequence_bytes(model, width, T)
    assert per == acct.ablation_sequence_bytes(acct.widths_of(model), width, T)
    for room in (1, 3, 8):
        monkeypatch.setattr(ablation, "memory_budget", lambda device, room=room: room * per)
        monkeypatch.setattr(mem, "_sizing_budget", lambda engine, room=room: room * per)
        est = ctxmix.estimate_memory(model, n, call="attribute_context", methods=["contextcite"], n_response=T)
        assert est.parts["cpu"]["ablation batch"] == ablation.ablation_batch_size(model, width, T, 8) * per


def test_ctxmix_estimate_prints_the_estimate(tmp_path, capsys):
    from ctxmix.cli import main

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(mem.REFERENCE_CONFIGS["llama-3-8b"]))
    argv = ["estimate", "--config", str(cfg), "--tokens", "4096,32768", "--call", "attribute_context"]
    assert main([*argv, "--methods", "logit", "--device", "cuda", "--parts"]) == 0
    out = capsys.readouterr().out
    assert out.count("fits: yes") == 2 and "weights (as stored)" in out and "14.958 GiB" in out
    assert main([*argv, "--call", "everything"]) == 2
    assert "--call must be one of" in capsys.readouterr().err
    assert main(["estimate", "--model", "qwen3-8b", "--tokens", "4096", "--device", "cuda"]) == 0  # no hub
    assert "fits: yes" in capsys.readouterr().out


def test_ctxmix_estimate_layers_per_device_flag_and_its_deprecated_device_map(capsys):
    """`ctxmix estimate --layers-per-device JSON` splits the layers; `--device-map`, which means a module -> device
    map in every loading command, still gives the same estimate for one release, with one line on stderr saying
    so; both at once are an error before anything is read."""
    from ctxmix.cli import main

    argv = ["estimate", "--model", "llama-3-70b", "--tokens", "4096", "--device", "cuda", "--dtype", "bfloat16"]
    split = json.dumps({"cuda:0": 40, "cuda:1": 40})
    assert main([*argv, "--parts", "--layers-per-device", split]) == 0
    new = capsys.readouterr()
    assert "cuda:1" in new.out and "deprecated" not in new.err
    assert main([*argv, "--parts", "--device-map", split]) == 0
    old = capsys.readouterr()
    assert old.out == new.out
    assert old.err.strip().splitlines() == [
        "--device-map in ctxmix estimate is deprecated: use --layers-per-device; it will mean a module -> device "
        "map as in the other commands"
    ]
    assert main([*argv, "--layers-per-device", split, "--device-map", split]) == 2
    err = capsys.readouterr().err
    assert "give --layers-per-device only" in err and "deprecated" in err
    assert main([*argv, "--layers-per-device", "{not json"]) == 2
    assert "--layers-per-device is not valid JSON" in capsys.readouterr().err


def test_bad_arguments_name_what_is_wrong():
    cfg = T.LlamaConfig(**LLAMA3_8B)
    for bad, match in ((0, "n_tokens"), (2.5, "n_tokens"), (True, "n_tokens")):
        with pytest.raises(ctxmix.BadInput, match=match):
            ctxmix.estimate_memory(cfg, bad)
    with pytest.raises(ctxmix.BadInput, match="call must be one of"):
        ctxmix.estimate_memory(cfg, 16, call="train")
    with pytest.raises(ctxmix.BadInput, match="dtype"):
        ctxmix.estimate_memory(cfg, 16, dtype="int3")
    assert os.environ.get("CTXMIX_MEMORY_CHECK", "1") != "0"


def _estimate_page():
    import transformers as T

    import ctxmix
    from ctxmix_dashboard.ui import common

    cfg = T.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2
    )
    cfg.vocab_size = 30528
    hf = T.LlamaForCausalLM._from_config(cfg, attn_implementation="eager")
    tok = T.AutoTokenizer.from_pretrained(ctxmix.engine.embedded.minilm_path())
    model = ctxmix.model_from_hf(hf, tok, name="tiny-llama")
    common.memory_caption(model, 2048, "explain", ["alti"])
    common.memory_caption(model, 100, "explain", ["alti"])  # short: nothing shown


def test_the_page_shows_the_estimate_for_a_long_input_only():
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_function(_estimate_page).run(timeout=120)
    assert not at.exception
    captions = [c.value for c in at.caption]
    assert len(captions) == 1 and "Memory estimate for 2,048 tokens" in captions[0] and "fits" in captions[0]


def test_gemma2_ablation_estimate_covers_the_attention_it_runs(tokenizer, monkeypatch):
    """Gemma 2's soft-capped logits cannot run through SDPA: its ablation passes compute ctxmix's probabilities
    by blocks of rows (`ctxmix.engine.attention._blockwise_output`), shared by the batch. The account counts that
    block (`eager_blocks_bytes`, half of the block's `_SCORE_COPIES` copies alive): every block the passes
    really formed (two copies of its probabilities alive at once: the scores and the softmax) fits in it, at
    the batch the budget picks. The old account counted SDPA's O(n) for every family (24 MiB at 4k where
    Gemma 2 ran 512 MiB of eager attention); a family SDPA can run gets no such term."""
    from conftest import tiny_model

    from ctxmix.engine import attention as att
    from ctxmix.methods.context import ablation

    m = tiny_model("gemma2", tokenizer)
    W = acct.widths_of(m)
    assert W.eager_blocks and not acct.widths_of(tiny_model("llama", tokenizer)).eager_blocks
    prompts = [list(range(1000, 1030 + 3 * i)) for i in range(4)]
    R, n = 4, 30 + 9 + 4  # response tokens, the longest sequence
    # a budget of 3 rows per block at this width, so the passes really run by blocks
    monkeypatch.setattr(att, "ATTENTION_CHUNK_BYTES", 3 * att._SCORE_COPIES * 8 * m.n_heads * n * 4)
    seen = []
    real = att.block_probs

    def spy(*a, **k):
        p = real(*a, **k)
        seen.append(p.numel() * p.element_size())
        return p

    monkeypatch.setattr(att, "block_probs", spy)
    ablation.response_logit_probs(m, prompts, list(range(5, 5 + R)), batch_size=4)
    assert len(seen) > m.n_layers  # by blocks
    blocks = acct.ablation_batch_bytes(W, n, R, 4) - 4 * acct.ablation_sequence_bytes(W, n, R)
    assert blocks == acct.eager_blocks_bytes(W, n, 4) > 0
    assert 2 * max(seen) <= blocks, (max(seen), blocks)
    monkeypatch.undo()
    # at Gemma 2 2B's widths and 4,096 tokens: the block (32 MiB alive) is counted, not SDPA's O(n) only
    cfg = T.Gemma2Config(
        hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4
    )
    big = acct.widths_of(cfg, dtype=torch.bfloat16)
    assert big.eager_blocks and acct.eager_blocks_bytes(big, 4096) == att.ATTENTION_CHUNK_BYTES // 2
    est = ctxmix.estimate_memory(cfg, 4096, call="attribute_context", methods=["contextcite"], dtype="bfloat16")
    assert est.parts  # the ablation phase with its blocks


def test_a_configs_layers_per_device_takes_cpu_and_disk_as_accelerate_places_them():
    """accelerate keeps a layer mapped to "cpu" in host memory and one mapped to "disk" in the offload folder, and
    runs both on the main device (their hook brings the weights there). The estimate for a config does the same:
    "disk" is accepted (it raised torch's raw device error), its weights are in no device's memory but the one
    running layer's on the GPU, and the activations a gradient pass keeps for its backward are the GPU's, every
    layer of them (the CPU got 8/32 of them before, where nothing runs)."""
    cfg = T.LlamaConfig(**LLAMA3_8B)
    kw = dict(call="attribute_context", methods=["grad_x_input"], dtype="bfloat16", device="cuda")
    one = ctxmix.estimate_memory(cfg, 4096, **kw)
    disk = ctxmix.estimate_memory(cfg, 4096, layers_per_device={"cuda:0": 24, "disk": 8}, **kw)
    assert set(disk.parts) == {"cuda:0"}
    W = acct.widths_of(cfg, "bfloat16")
    layer = (W.weights - W.ends) // W.L
    assert disk.parts["cuda:0"]["weights (as stored)"] == pytest.approx(W.ends + 24 * layer, rel=1e-6)
    assert disk.parts["cuda:0"]["one offloaded layer's weights (while it runs)"] == pytest.approx(layer, rel=1e-6)
    saved = "activations kept for the backward (every layer)"
    assert disk.parts["cuda:0"][saved] == one.parts["cuda:0"][saved]
    cpu = ctxmix.estimate_memory(cfg, 4096, layers_per_device={"cuda:0": 24, "cpu": 8}, **kw)
    assert cpu.parts["cuda:0"][saved] == one.parts["cuda:0"][saved]
    assert saved not in cpu.parts["cpu"]
    assert cpu.parts["cpu"]["weights (as stored)"] == pytest.approx(8 * layer, rel=1e-6)
    with pytest.raises(ctxmix.BadInput, match="not one of"):
        ctxmix.estimate_memory(cfg, 4096, layers_per_device={"cuda:0": 24, "tape": 8}, **kw)
