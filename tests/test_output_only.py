"""Passes that read no attention probabilities run the model's memory-efficient attention (SDPA) and form only
the logits they read: ablation passes (ContextCite, leave-one-out, evaluate, AT2's labels) and generation.

The reference is eager attention computed exactly in the model's float64 (`_exact_eager`, registered with
transformers' attention interface): transformers' own eager forward rounds the softmax to float32 even in a
float64 model (`softmax(..., dtype=float32)`), which moves the tiny models' logits by up to ~1e-5, so it is no
reference at float64 precision. SDPA and exact eager compute the same sums in another order."""

import dataclasses

import numpy as np
import pytest
import torch
from conftest import _tiny_configs, tiny_model
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


def _exact_eager(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None, **kwargs):
    """Eager attention in the inputs' dtype: softmax(q k^T * scaling [soft-capped] + mask) v; (B, n, H, dh), probs."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        scores = scores + attention_mask[..., : key.shape[-2]]
    probs = torch.softmax(scores, -1)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs


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


@pytest.mark.parametrize("family", DECODERS)
def test_ablation_passes_equal_exact_eager_without_probabilities(decoders, tokenizer, family):
    model = _model(decoders, tokenizer, family)
    prompts, response = _prompts()
    with _AttentionProbe(model) as probe:
        fast = ablation.response_logit_probs(model, prompts, response, batch_size=2)
    # gemma2 stays eager (below): its reference is the model's own eager pass, equal bit for bit
    ref = "eager" if family == "gemma2" else "exact_eager"
    exact = ablation.response_logit_probs(dataclasses.replace(model, output_attention=ref), prompts, response)
    assert np.abs(fast - exact).max() <= REL * np.abs(exact).max()
    assert current_attention(model) == "eager"  # restored
    assert probe.calls == 3 * model.n_layers  # 5 sequences in batches of 2
    if family == "gemma2":  # soft-capping: transformers refuses SDPA, the pass stays eager (and exact)
        assert probe.with_probs == probe.calls
    else:  # no H x n x n probabilities were formed by any layer
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
    exact = dataclasses.replace(model, output_attention="exact_eager")
    with torch.no_grad(), output_only(exact):
        probs = torch.softmax(model.hf(input_ids=torch.tensor([g.input_ids])).logits[0].double(), -1)
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


def test_output_only_restores_and_remembers_the_users_implementation(tokenizer):
    """model_from_hf switches the user's implementation to eager and remembers it for output-only passes; the block
    restores eager after it, after an error too."""
    cls, cfg = _tiny_configs()["llama"]
    hf = cls._from_config(cfg, attn_implementation="exact_eager").to(torch.float64).eval()
    model = ctxmix.model_from_hf(hf, tokenizer, name="tiny-configured")
    assert current_attention(model) == "eager" and model.output_attention == "exact_eager"
    with pytest.raises(KeyError), output_only(model) as used:
        assert used == "exact_eager" == current_attention(model)
        raise KeyError("inside")
    assert current_attention(model) == "eager"
    plain = tiny_model("llama", tokenizer)  # built eager: the output-only passes run SDPA
    assert plain.output_attention == "sdpa"


def test_the_switch_holds_its_own_model_only(decoders, tokenizer):
    """While one thread's output-only block runs on a model, another thread's block on the same model waits (it
    would otherwise restore eager under the first's pass), and a block on another model does not."""
    import threading

    a, b = _model(decoders, tokenizer, "llama"), _model(decoders, tokenizer, "qwen2")
    inside, release = threading.Event(), threading.Event()

    def hold():
        with output_only(a):
            inside.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    inside.wait(10)
    seen = {}

    def enter(model, key):
        with output_only(model) as used:
            seen[key] = used

    other, same = threading.Thread(target=enter, args=(b, "other")), threading.Thread(target=enter, args=(a, "same"))
    other.start(), same.start()
    other.join(10)
    assert seen == {"other": "sdpa"}  # the other model went through; the same model's block waits
    release.set()
    holder.join(10), same.join(10)
    assert seen == {"other": "sdpa", "same": "sdpa"}
    assert current_attention(a) == current_attention(b) == "eager"
