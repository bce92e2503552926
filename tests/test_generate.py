"""Generation and explaining generated tokens: greedy decoding with the key-value cache picks the full
forward pass's argmax at every step; explaining generated token t (position t - 1) on the whole
continuation equals explaining the prompt plus the continuation up to t (maps within 1e-5 of their largest
entry in float32), and the explained prediction is the generated token; sampling repeats with its seed;
routes at a generated position; refusals."""

import numpy as np
import pytest
import torch
from conftest import tiny_model

import ctxmix
from ctxmix.errors import BadInput

PROMPT = "the keys to the cabinet"
METHODS = ["attention", "norm", "alti", "globenc", "value_zeroing", "logit", "alti_logit"]


@pytest.fixture(scope="module")
def lm32(tokenizer):
    return tiny_model("llama", tokenizer, dtype=torch.float32)


def test_greedy_steps_are_the_full_forward_argmax(lm32):
    g = ctxmix.generate(lm32, PROMPT, max_new_tokens=6)
    assert len(g.new_ids) == 6 and g.stopped == "length" and g.input_ids[: g.prompt_length] == g.prompt_ids
    with torch.no_grad():
        logits = lm32.hf(input_ids=torch.tensor([g.input_ids])).logits[0]
    for s in g.steps:
        t = s["position"]
        assert s["id"] == g.input_ids[t] == int(logits[t - 1].argmax())
        assert s["runner_up"] != s["id"] and s["probability"] >= s["runner_up_probability"]
    assert g.tokens == lm32.tokens(g.input_ids)


def test_explaining_a_generated_token(lm32):
    g = ctxmix.generate(lm32, PROMPT, max_new_tokens=5)
    t = g.generated_positions[2]
    cut = ctxmix.explain(lm32, None, METHODS, **g.explain_kwargs(t))
    full = ctxmix.explain(lm32, None, METHODS, input_ids=g.input_ids, position=t - 1, target=g.input_ids[t])
    assert cut.prediction["index"] == g.input_ids[t]  # greedy: the explained prediction is the generated token
    assert cut.target == full.target == g.input_ids[t]
    k = t + 1  # rows and columns up to token t are the same whatever follows it
    for fields in ("layer_maps", "global_maps"):
        for m, a in getattr(cut, fields).items():
            b = getattr(full, fields)[m][:, :k, :k]
            assert np.nanmax(np.abs(a - b)) <= 1e-5 * np.nanmax(np.abs(a)), (fields, m)
    for m, s in cut.saliency.items():
        assert np.abs(s - full.saliency[m][:k]).max() <= 1e-5 * np.abs(s).max(), m
    foil = g.explain_kwargs(t, foil="runner_up")["foil"]
    assert foil == g.steps[2]["runner_up"]


def test_routes_at_a_generated_position(lm32):
    g = ctxmix.generate(lm32, PROMPT, max_new_tokens=3)
    t = g.generated_positions[-1]
    a = ctxmix.routes(lm32, input_ids=g.input_ids, position=t - 1)
    b = ctxmix.routes(lm32, input_ids=g.input_ids[: t + 1], position=t - 1)
    ea, eb = a.graph_edges().set_index(["source", "target"]), b.graph_edges().set_index(["source", "target"])
    assert set(ea.index) == set(eb.index)
    np.testing.assert_allclose(ea.loc[eb.index, "weight"].to_numpy(), eb["weight"].to_numpy(), atol=1e-5)


def test_sampling_repeats_with_its_seed(lm32):
    kw = dict(max_new_tokens=8, greedy=False, temperature=1.5)
    a = ctxmix.generate(lm32, PROMPT, seed=1, **kw)
    assert a.new_ids == ctxmix.generate(lm32, PROMPT, seed=1, **kw).new_ids
    others = [ctxmix.generate(lm32, PROMPT, seed=s, **kw).new_ids for s in (2, 3, 4)]
    assert any(o != a.new_ids for o in others)
    # top_k = 1 leaves one token: sampling is greedy
    greedy = ctxmix.generate(lm32, PROMPT, max_new_tokens=4)
    assert ctxmix.generate(lm32, PROMPT, max_new_tokens=4, greedy=False, top_k=1, seed=9).new_ids == greedy.new_ids


def test_refusals(lm32, tokenizer, minilm):
    for kw, msg in [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": 0}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"seed": 1.5}, "seed"),
    ]:
        with pytest.raises(BadInput, match=msg):
            ctxmix.generate(lm32, PROMPT, **kw)
    with pytest.raises(BadInput, match="causal language model"):
        ctxmix.generate(minilm, PROMPT)
    g = ctxmix.generate(lm32, PROMPT, max_new_tokens=2)
    with pytest.raises(BadInput, match="not a generated token"):
        g.explain_kwargs(0)


def test_cli_generate_explain_and_routes(tmp_path, tokenizer):
    """`ctxmix generate` (continuation as JSON; --explain-token explains one new token into a saved
    explanation) and `ctxmix routes` (the graph as JSON, the figure as HTML), in-process."""
    import json

    from ctxmix.cli import main

    m = tiny_model("llama", tokenizer, dtype=torch.float32)
    m.hf.config.architectures = [type(m.hf).__name__]
    m.hf.save_pretrained(tmp_path / "lm", safe_serialization=True)
    tokenizer.save_pretrained(tmp_path / "lm")
    lm = str(tmp_path / "lm")
    assert main(["generate", PROMPT, "--model", lm, "--max-new-tokens", "3", "--out", str(tmp_path / "g.json")]) == 0
    g = json.loads((tmp_path / "g.json").read_text())
    assert len(g["input_ids"]) == len(g["prompt_ids"]) + 3 and len(g["steps"]) == 3
    out = tmp_path / "ex.npz"
    args = ["generate", PROMPT, "--model", lm, "--max-new-tokens", "3", "--explain-token", "-1", "--method", "alti"]
    assert main(args + ["--runner-up-foil", "--out", str(out)]) == 0
    ex = ctxmix.load_explanation(out)
    assert ex.input_ids == g["input_ids"] and ex.position == len(g["input_ids"]) - 2
    assert main(["routes", PROMPT, "--model", lm, "--out", str(tmp_path / "r.json")]) == 0
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["format"] == "ctxmix-routes" and r["edges"]
    assert main(["routes", PROMPT, "--model", lm, "--threshold", "0.1", "--out", str(tmp_path / "r.html")]) == 0
    assert (tmp_path / "r.html").read_text().count("plotly") > 0
    assert main(["routes", PROMPT, "--model", lm, "--threshold", "2"]) == 2  # a message, not a traceback
