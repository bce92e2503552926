"""Two sessions sharing one model, as the dashboard's do: every result equals the one it gets alone.

ctxmix sets its attention once when a model is loaded and configures each forward pass per call, in a context
variable only the calling thread sees (`ctxmix.engine.attention`); its hooks read the same context. So two
threads' calls on one Model overlap in time (nothing serialises them) and neither sees the other's pass: not
its kernel, its kept probabilities, its key bias, its cut of the LM head's rows nor its layer-0 input.

Equality is bit for bit: both threads run the same operations on the same inputs with torch's intra-op thread
count unchanged, so each kernel reduces in the same order as when it runs alone (checked here, not assumed: a
kernel whose reduction order depended on another thread's load would fail this test and need a derived bound).
"""

import threading
import time

import numpy as np
import pytest
import torch
from conftest import tiny_model
from test_prediction import DECODERS  # every causal-LM family

import ctxmix
from ctxmix.engine.attention import current_attention, current_pass
from ctxmix.engine.rows import trace_rows
from ctxmix.methods.context import ablation
from ctxmix.methods.registry import MIXING_METHODS

CONTEXT = "The cat sat on the mat. The code is 4817. Birds fly south in winter."
QUERY = "What is the code?"
RESPONSE = "the code is 4817"
TEXT = "The keys to the old cabinet are on the table ."
PREDICTION = ["logit", "alti_logit", "attention_flow"]
SLEEP = 0.002  # seconds per layer call: widens the overlap (the sleep releases the GIL)


def _slowed(model):
    """A pre-hook on every layer that sleeps `SLEEP` (test-only: removed by the caller)."""
    from ctxmix.engine.arch import _get

    layers = _get(model.hf.base_model, model.spec.layers)
    return [layer.register_forward_pre_hook(lambda *a: time.sleep(SLEEP)) for layer in layers]


def _session_a(m) -> dict:
    """A collaborator on the Context attribution page: ablations, key-mask gradients, grad x input, generation."""
    ca = ctxmix.attribute_context(
        m,
        CONTEXT,
        QUERY,
        response=RESPONSE,
        methods=["contextcite", "leave_one_out", "key_mask_grad", "grad_x_input"],
        n_ablations=12,
        progress=False,
    )
    g = ctxmix.generate(m, input_ids=list(range(1000, 1016)), max_new_tokens=4, stop_at_eos=False)
    out = {f"ca/{k}": np.asarray(v) for k, v in ca.scores.items()}
    out["ca/logit_probs"] = ca.ablations["contextcite"]["logit_probs"]
    out["gen/ids"] = np.asarray(g.input_ids)
    out["gen/p"] = np.array([s["probability"] for s in g.steps])
    return out


def _session_b(m) -> dict:
    """Another on the Explain page: every mixing and prediction method, scope maps, routes and a rows trace."""
    mixing = [k for k, v in MIXING_METHODS.items() if v.group != "scope"]  # the scopes: scope_maps below
    ex = ctxmix.explain(m, TEXT, mixing + PREDICTION)
    out = {f"layer/{k}": v for k, v in ex.layer_maps.items()}
    out.update({f"global/{k}": v for k, v in ex.global_maps.items()})
    out.update({f"saliency/{k}": v for k, v in ex.saliency.items()})
    out.update({f"scopes/{k}": v for k, v in ctxmix.scope_maps(m, TEXT).items()})
    out["routes"] = ctxmix.routes(m, TEXT).edges["weight"].to_numpy()
    ids = m.tokenizer(TEXT)["input_ids"]
    rt = trace_rows(m, ids, list(range(len(ids) - 4, len(ids))))
    out["rows/alpha"] = np.stack([st.alpha.numpy() for st in rt.states])
    out["rows/error"] = np.array([rt.reconstruction_error])
    return out


def _same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


@pytest.mark.parametrize("family", DECODERS)
def test_two_sessions_on_one_model_get_their_serial_results(tokenizer, family):
    m = tiny_model(family, tokenizer)
    want_a, want_b = _session_a(m), _session_b(m)
    handles = _slowed(m)
    spans: dict[str, tuple[float, float]] = {}
    got: dict[str, dict] = {}
    errors: list[BaseException] = []

    def run(name, fn):
        t0 = time.perf_counter()
        try:
            got[name] = fn(m)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
        spans[name] = (t0, time.perf_counter())

    try:
        threads = [threading.Thread(target=run, args=(k, f)) for k, f in (("a", _session_a), ("b", _session_b))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
    finally:
        for h in handles:
            h.remove()
    assert not errors, errors
    _same(got["a"], want_a)
    _same(got["b"], want_b)
    (a0, a1), (b0, b1) = spans["a"], spans["b"]
    overlap = min(a1, b1) - max(a0, b0)
    # nothing serialises them: they ran at once for most of the shorter one's time
    assert overlap > 0.5 * min(a1 - a0, b1 - b0), (spans, overlap)
    assert current_attention(m) == "ctxmix"


def _pause_in(model, when, reached: threading.Event, resume: threading.Event):
    """A pre-hook on layer 0 that, in a pass for which when(pass) holds, signals `reached` and waits for
    `resume` (once): a forced interleaving point."""
    from ctxmix.engine.arch import _get

    layer0 = _get(model.hf.base_model, model.spec.layers)[0]
    fired = []

    def hook(*a):
        if not fired and when(current_pass()):
            fired.append(1)
            reached.set()
            assert resume.wait(30)

    return layer0.register_forward_pre_hook(hook)


@pytest.mark.parametrize("family", ["llama", "gemma2", "mistral"])
def test_a_forward_during_an_ablation_batch_gets_all_its_rows(tokenizer, family):
    """While an ablation batch's pass cuts the LM head's input to its response rows, another thread's plain forward
    of the same model gets every row's logits, equal to its serial ones."""
    m = tiny_model(family, tokenizer)
    ids = torch.tensor([list(range(1000, 1008))])
    with torch.no_grad():
        want = m.hf(input_ids=ids).logits
    reached, resume = threading.Event(), threading.Event()
    h = _pause_in(m, lambda p: p is not None and p.head_rows is not None, reached, resume)
    prompts = [list(range(1000, 1012 + 3 * i)) for i in range(3)]
    done = {}
    t = threading.Thread(target=lambda: done.update(lp=ablation.response_logit_probs(m, prompts, [5, 6, 7, 8])))
    try:
        t.start()
        assert reached.wait(30)  # the ablation batch's pass is open, its head cut armed
        with torch.no_grad():
            got = m.hf(input_ids=ids).logits
    finally:
        resume.set()
        t.join(30)
        h.remove()
    assert got.shape == (1, 8, m.hf.config.vocab_size)
    assert torch.equal(got, want)
    assert done["lp"].shape == (3, 4)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_trace_paused_across_another_pass_keeps_its_own_masks(tokenizer, family):
    """The interleaving that once gave causal maps with future tokens: a trace's forward paused after its masks
    are built, another thread's output-only pass (and a key-gated one) opened and closed meanwhile, then the
    trace's layers run. Its maps equal the serial ones, and its attention above the diagonal is exactly 0."""
    from ctxmix.methods.context import keymask

    m = tiny_model(family, tokenizer)
    want = ctxmix.explain(m, TEXT, ["attention", "alti"])
    reached, resume = threading.Event(), threading.Event()
    h = _pause_in(m, lambda p: p is not None and p.rows is not None and p.rows.every_row, reached, resume)
    box = {}
    t = threading.Thread(target=lambda: box.update(ex=ctxmix.explain(m, TEXT, ["attention", "alti"])))
    try:
        t.start()
        assert reached.wait(30)
        prompts = [list(range(1000, 1012))]
        ablation.response_logit_probs(m, prompts, [5, 6])
        ids = list(range(1000, 1012))
        bias = keymask.log_bias(torch.full((12,), 0.5, dtype=torch.float64))
        with torch.no_grad():
            keymask.gated_log_probs(m, ids, 8, bias, keymask.KEYMASK_SDPA)
    finally:
        resume.set()
        t.join(30)
        h.remove()
    ex = box["ex"]
    for k in ("attention", "alti"):
        np.testing.assert_array_equal(ex.layer_maps[k], want.layer_maps[k], err_msg=k)
    att = ex.layer_maps["attention"]
    assert float(np.abs(np.triu(att, k=1)).max()) == 0.0  # a causal model's maps never look at later tokens
