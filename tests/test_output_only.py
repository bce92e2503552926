"""Passes that read no attention probabilities run the model's memory-efficient attention (SDPA) and form only
the logits they read: ablation passes (ContextCite, leave-one-out, evaluate, AT2's labels) and generation.

The reference is eager attention computed exactly in the model's float64 (`_exact_eager`, registered with
transformers' attention interface): transformers' own eager forward rounds the softmax to float32 even in a
float64 model (`softmax(..., dtype=float32)`), which moves the tiny models' logits by up to ~1e-5, so it is no
reference at float64 precision. SDPA and exact eager compute the same sums in another order."""

import numpy as np
import pytest
import torch
from conftest import _tiny_configs, tiny_model
from conftest import exact_eager_attention as _exact_eager  # softmax in the inputs' dtype
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

import ctxmix
from ctxmix.engine.attention import current_attention, output_only
from ctxmix.engine.streaming import attention_modules
from ctxmix.methods.context import ablation

# every causal LM family (sliding window: mistral, gemma3; soft-capped attention logits: gemma2, where SDPA cannot
# run and the pass stays eager)
DECODERS = [f for f, (cls, _) in _tiny_configs().items() if cls.__name__.endswith(("ForCausalLM", "LMHeadModel"))]
# Each value carries at most ~2^12 float64 roundings (2 layers of sums over n + d + d' < 2^8 terms, the head's
# d-term sums, a log-sum-exp over V < 2^15 terms, each rounding relative 2^-53), in either order: the two
# passes differ by at most 2^-53 * 2^16 of the largest value, with room.
REL = 2.0**-53 * 2**16


AttentionInterface.register("exact_eager", _exact_eager)
ALL_MASK_ATTENTION_FUNCTIONS.register("exact_eager", eager_mask)


@pytest.fixture(scope="module")
def decoders(tokenizer):
    return {}


def _model(decoders, tokenizer, family):
    if family not in decoders:
        decoders[family] = tiny_model(family, tokenizer)
    return decoders[family]


def _prompts(seed=0, m=5):
    """m prompts of different lengths (so batches are padded) and a response of 4 tokens."""
    g = np.random.RandomState(seed)
    return [g.randint(1000, 3000, size=12 + 3 * i).tolist() for i in range(m)], g.randint(1000, 3000, 4).tolist()


class _AttentionProbe:
    """Forward hooks on every attention module and on the whole model: counts attention calls, records whether any
    returned probabilities, and the shape of every logits tensor."""

    def __init__(self, model):
        self.calls, self.with_probs, self.logits = 0, 0, []
        self.handles = [m.register_forward_hook(self._attn) for m in attention_modules(model)]
        self.handles.append(model.hf.register_forward_hook(self._out))

    def _attn(self, module, args, out):
        self.calls += 1
        self.with_probs += int(isinstance(out, tuple) and len(out) > 1 and isinstance(out[1], torch.Tensor))

    def _out(self, module, args, out):
        self.logits.append(tuple(out.logits.shape))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


def _exact_twin(model, tokenizer, family, impl="exact_eager"):
    """The same weights in a model whose user implementation is `exact_eager`: its output-only passes run the
    user's own kernel (`ctxmix.engine.attention`), the exact float64 reference."""
    cls, cfg = _tiny_configs()[family]
    hf = cls._from_config(cfg, attn_implementation=impl).to(torch.float64).eval()
    hf.load_state_dict(model.hf.state_dict())
    return ctxmix.model_from_hf(hf, tokenizer, name=model.name)


@pytest.mark.parametrize("family", DECODERS)
def test_ablation_passes_equal_exact_eager_without_probabilities(decoders, tokenizer, family):
    model = _model(decoders, tokenizer, family)
    prompts, response = _prompts()
    with _AttentionProbe(model) as probe:
        fast = ablation.response_logit_probs(model, prompts, response, batch_size=2)
    # gemma2's soft-capped logits run the family's eager function by blocks of rows (SDPA refuses soft-caps): its
    # reference is the model's own eager pass (a float32 softmax), equal but for the blocks' float64 rounding
    ref = _exact_twin(model, tokenizer, family, "eager" if family == "gemma2" else "exact_eager")
    exact = ablation.response_logit_probs(ref, prompts, response)
    assert np.abs(fast - exact).max() <= REL * np.abs(exact).max()
    assert current_attention(model) == "ctxmix"  # set once at loading, never switched
    assert probe.calls == 3 * model.n_layers  # 5 sequences in batches of 2
    # no H x n x n probabilities were formed by any layer: SDPA, or (gemma2's soft-capped logits, which SDPA
    # refuses) the family's eager function by blocks of rows that hand back no probabilities
    assert probe.with_probs == 0
    # only each sequence's T response rows reach the head: (B, T, V), not the padded window of the batch
    assert [(b, k) for b, k, _ in probe.logits] == [(2, 4), (2, 4), (1, 4)]


@pytest.mark.parametrize("family", ["llama", "gemma3", "gpt_neox"])
def test_generation_runs_sdpa_and_keeps_one_row_of_logits(decoders, tokenizer, family):
    model = _model(decoders, tokenizer, family)
    prompt = list(range(1000, 1030))
    with _AttentionProbe(model) as probe:
        g = ctxmix.generate(model, input_ids=prompt, max_new_tokens=4, stop_at_eos=False)
    assert probe.with_probs == 0 and probe.calls == 4 * model.n_layers
    assert [k for _, k, _ in probe.logits] == [1, 1, 1, 1]  # the prefill's last row only, then one per step
    # the steps equal a full exact-eager pass's rows
    exact = _exact_twin(model, tokenizer, family)
    with torch.no_grad(), output_only(exact):
        probs = torch.softmax(exact.hf(input_ids=torch.tensor([g.input_ids])).logits[0].double(), -1)
    for s in g.steps:
        t = s["position"]
        assert s["id"] == int(probs[t - 1].argmax())
        assert s["probability"] == pytest.approx(float(probs[t - 1, s["id"]]), rel=REL)
    again = ctxmix.engine.generate.continuation(model, g.prompt_ids, g.new_ids)  # one pass, P - 1.. rows kept
    assert [s["probability"] for s in again.steps] == pytest.approx([s["probability"] for s in g.steps], rel=REL)


def test_the_ablation_batch_shrinks_to_the_memory_budget(decoders, tokenizer, monkeypatch):
    model = _model(decoders, tokenizer, "llama")
    prompts, response = _prompts(seed=1, m=6)
    full = ablation.response_logit_probs(model, prompts, response, batch_size=8)
    longest = max(map(len, prompts)) + len(response)
    kept = len(response)  # the head reads the response rows only
    per_seq = ablation.ablation_sequence_bytes(model, longest, kept)
    monkeypatch.setattr(ablation, "memory_budget", lambda device: 2 * per_seq + per_seq // 2)  # room for 2
    assert ablation.ablation_batch_size(model, longest, kept, 8) == 2
    assert ablation.ablation_batch_size(model, longest, kept, 1) == 1  # never above the caller's
    with _AttentionProbe(model) as probe:
        small = ablation.response_logit_probs(model, prompts, response, batch_size=8)
    assert len(probe.logits) == 3 and all(b == 2 for b, _, _ in probe.logits)
    assert np.abs(small - full).max() <= REL * np.abs(full).max()
    monkeypatch.setattr(ablation, "memory_budget", lambda device: 0)
    assert ablation.ablation_batch_size(model, longest, kept, 8) == 1  # at least one


def test_ctxmix_attention_is_set_once_and_remembers_the_users_implementation(tokenizer):
    """model_from_hf sets ctxmix's attention once and remembers the user's: a plain `hf(...)` (no ctxmix call) runs
    the user's implementation, an output-only pass the user's fast kernel where it is not eager or SDPA; the config
    never changes after loading, after an error inside a pass too."""
    cls, cfg = _tiny_configs()["llama"]
    hf = cls._from_config(cfg, attn_implementation="exact_eager").to(torch.float64).eval()
    calls = []
    AttentionInterface.register("counted_eager", lambda *a, **k: calls.append(1) or _exact_eager(*a, **k))
    ALL_MASK_ATTENTION_FUNCTIONS.register("counted_eager", eager_mask)
    hf.set_attn_implementation("counted_eager")
    model = ctxmix.model_from_hf(hf, tokenizer, name="tiny-configured")
    assert current_attention(model) == "ctxmix" and model.output_attention == "counted_eager"
    ids = torch.tensor([list(range(1000, 1012))])
    with torch.no_grad():
        out = hf(input_ids=ids, output_attentions=True)  # the user's own call: their implementation, probabilities
    assert len(calls) == model.n_layers and out.attentions[0].shape == (1, 4, 12, 12)
    with pytest.raises(KeyError), output_only(model) as used:
        assert used == "counted_eager"
        raise KeyError("inside")
    assert current_attention(model) == "ctxmix"
    plain = tiny_model("llama", tokenizer)  # the class's default (SDPA): output-only passes run SDPA
    assert plain.output_attention == "sdpa"


def test_a_pass_is_seen_by_its_own_thread_only(decoders, tokenizer):
    """While one thread holds a pass open (its probabilities asked for), another thread's forward of the same
    model runs as the user's model does: no wait (nothing serialises them), no probabilities, no change."""
    import threading

    from ctxmix.engine.attention import ctxmix_pass, every_row

    a = _model(decoders, tokenizer, "llama")
    inside, release = threading.Event(), threading.Event()
    ids = torch.tensor([list(range(1000, 1010))])

    def hold():
        with ctxmix_pass(rows=every_row()):
            inside.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    assert inside.wait(10)
    seen = {}

    def plain():
        with torch.no_grad(), _AttentionProbe(a) as probe:
            a.hf(input_ids=ids)
        seen["probs"] = probe.with_probs

    t = threading.Thread(target=plain)
    t.start()
    t.join(10)
    assert seen == {"probs": 0}  # it went through while the other pass was open, and kept nothing
    release.set()
    holder.join(10)
    assert current_attention(a) == "ctxmix"


def test_the_traps_of_one_attention_for_every_family(tokenizer):
    """The families' own quirks under ctxmix's attention, each with its check:
    - GPT-2's `reorder_and_upcast_attn` runs only under the name "eager" in transformers: under ctxmix's name the
      model's own call still takes it (the user's implementation), ctxmix's passes compute its probabilities in
      float32 (`_needs_eager`) and rebuild its states exactly;
    - DeBERTa-v2 has no attention interface: it keeps its own eager attention (its config is not switched), and
      its probabilities come back through `output_attentions`;
    - a config with `output_attentions=True` (transformers refuses it for any implementation but eager) loads."""
    import copy

    from ctxmix.engine.attention import user_attention

    cls, cfg = _tiny_configs()["gpt2"]
    cfg = copy.deepcopy(cfg)
    cfg.reorder_and_upcast_attn = True
    torch.manual_seed(0)
    # float32: GPT-2's own upcast path refuses a float64 model (its float64 mask makes the weights float64)
    g = ctxmix.model_from_hf(cls._from_config(cfg, attn_implementation="eager").float().eval(), tokenizer)
    assert current_attention(g) == "ctxmix" and user_attention(g.hf.config) == "eager"
    ids = torch.tensor([list(range(1000, 1012))])
    calls = []
    real = type(g.hf.transformer.h[0].attn)._upcast_and_reordered_attn

    def counted(self, *a, **k):
        calls.append(1)
        return real(self, *a, **k)

    type(g.hf.transformer.h[0].attn)._upcast_and_reordered_attn = counted
    try:
        with torch.no_grad():
            g.hf(input_ids=ids)  # the user's call: GPT-2's own upcast path
        assert len(calls) == g.n_layers
        ex = ctxmix.explain(g, None, ["attention", "alti"], input_ids=ids[0].tolist())
    finally:
        type(g.hf.transformer.h[0].attn)._upcast_and_reordered_attn = real
    # float32 throughout: the rebuild's sums over d = 24 and n = 12 terms of states of size ~10, 2^-24 each
    assert ex.reconstruction_error < 64 * 36 * 2.0**-24 * 10
    assert float(np.abs(np.triu(ex.layer_maps["attention"], k=1)).max()) == 0.0

    d = tiny_model("deberta", tokenizer)
    assert current_attention(d) == "eager"  # no interface: nothing switched, its own eager attention
    ex = ctxmix.explain(d, "a small test .", ["attention", "alti"])
    assert ex.reconstruction_error < 1e-8

    cls, cfg = _tiny_configs()["llama"]
    hf = cls._from_config(cfg, attn_implementation="eager").to(torch.float64).eval()
    hf.config.output_attentions = True
    m = ctxmix.model_from_hf(hf, tokenizer, name="tiny-output-attentions")
    assert current_attention(m) == "ctxmix"
    assert ctxmix.explain(m, None, ["attention"], input_ids=ids[0].tolist()).reconstruction_error < 1e-6
