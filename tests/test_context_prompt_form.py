"""The prompt form of `attribute_context` (`PromptForm`): a model without a chat template gets the answer cue after
the query and its generated response cut at its first sentence by default (so a base model's response is its
answer), one with a chat
template neither; both overridable; the form is recorded and the reproduce command gives it back; the option
groups take the old flat keywords with a warning."""

from __future__ import annotations

import copy
import shlex
from types import SimpleNamespace

import pytest
from conftest import tiny_model

import ctxmix
from ctxmix.errors import BadInput
from ctxmix.methods.context.options import AT2, Ablations, PromptForm

CONTEXT = "The museum opened in 1902. The code for the staff entrance is 4817. The café closes at five."
QUERY = "What is the code?"
RAMBLE = " the code is 4817. the cafe closes at five. query : what"
CHAT = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}a:{% endif %}"
)


@pytest.fixture(scope="module")
def llama(tokenizer):  # BERT's tokenizer: no chat template, as a base model's
    return tiny_model("llama", tokenizer)


@pytest.fixture(scope="module")
def chat_llama(tokenizer):
    t = copy.deepcopy(tokenizer)
    t.chat_template = CHAT
    return tiny_model("llama", t)


@pytest.fixture
def rambles(monkeypatch):
    """Generation that answers, then goes on (as a base model does): the response is fixed text."""
    import ctxmix.engine.generate as gen

    def generate(model, input_ids, max_new_tokens, greedy=True, progress=None):
        ids = model.tokenizer(RAMBLE, add_special_tokens=False)["input_ids"][:max_new_tokens]
        return SimpleNamespace(new_ids=ids)

    monkeypatch.setattr(gen, "generate", generate)


def test_a_base_model_gets_the_cue_and_its_first_sentence(llama, rambles):
    """Fails on the code before the form: no cue, and the whole ramble attributed."""
    ca = ctxmix.attribute_context(llama, CONTEXT, QUERY, methods=["logit"], progress=False)
    assert ca.options["prompt_form"] == {"query_suffix": "\nAnswer:", "stop": "sentence"}
    assert ca.query == QUERY + "\nAnswer:" and ca.options["prompt"]["template"] == "plain"
    cue = llama.tokenizer("\nAnswer:", add_special_tokens=False)["input_ids"]
    P = len(ca.prompt_ids)
    assert ca.prompt_ids[P - len(cue) :] == cue  # the cue ends the prompt
    assert (
        ca.response.strip() == "the code is 4817." and ca.options["response"] == "generated, cut at its first sentence"
    )
    assert ca.response_ids == llama.tokenizer(ca.response, add_special_tokens=False)["input_ids"]
    # overridable: the query as given and the whole generation
    raw = ctxmix.attribute_context(
        llama, CONTEXT, QUERY, methods=["logit"], prompt={"query_suffix": "", "stop": None}, progress=False
    )
    assert raw.query == QUERY and raw.response.strip() == RAMBLE.strip() and raw.options["response"] == "generated"
    line = ctxmix.attribute_context(
        llama, CONTEXT, QUERY, methods=["logit"], prompt=PromptForm(query_suffix=" A:", stop="line"), progress=False
    )
    assert line.query == QUERY + " A:" and line.response.strip() == RAMBLE.strip()  # one line: nothing to cut
    # a given response is the user's: never cut
    given = ctxmix.attribute_context(llama, CONTEXT, QUERY, response=RAMBLE, methods=["logit"], progress=False)
    assert given.response == RAMBLE and given.query == QUERY + "\nAnswer:"


def test_a_chat_model_and_compat_get_neither(chat_llama, llama, rambles):
    ca = ctxmix.attribute_context(chat_llama, CONTEXT, QUERY, methods=["logit"], progress=False)
    assert ca.options["prompt_form"] == {"query_suffix": "", "stop": None} and ca.query == QUERY
    assert ca.response.strip() == RAMBLE.strip()
    plain = ctxmix.attribute_context(chat_llama, CONTEXT, QUERY, methods=["logit"], prompt={"template": "plain"})
    assert plain.query == QUERY + "\nAnswer:"  # asked without its template, it is asked as a base model
    compat = ctxmix.attribute_context(llama, CONTEXT, QUERY, methods=["logit"], compat=True, progress=False)
    assert compat.options["prompt_form"] == {"query_suffix": "", "stop": None}  # the official package's prompt


def test_the_reproduce_command_gives_the_form_back(llama, chat_llama, rambles):
    from ctxmix.cli import build_parser
    from ctxmix.export.context.cite import attribution_options, reproduce_command

    parser = build_parser()
    forms = [(llama, None), (llama, {"query_suffix": "", "stop": None}), (chat_llama, {"stop": "line"})]
    forms += [(chat_llama, {"template": "plain"}), (llama, {"query_suffix": "\nQ:"})]  # a template, an escaped cue
    for model, form in forms:
        ca = ctxmix.attribute_context(model, CONTEXT, QUERY, methods=["logit"], prompt=form, progress=False)
        cmd = reproduce_command(ca, "m", tokenizer=model.tokenizer)
        if form is None:
            assert "--query-suffix" not in cmd and "--stop" not in cmd  # auto gives it back
        args = parser.parse_args(shlex.split(cmd)[3:])
        opts = attribution_options(args, ["logit"])
        again = ctxmix.attribute_context(model, CONTEXT, args.query, response=args.response, progress=False, **opts)
        assert again.prompt_ids == ca.prompt_ids and again.response_ids == ca.response_ids, cmd
        # the command gives the response's text, so the rerun cuts nothing: the cue is what must come back
        assert again.options["prompt_form"]["query_suffix"] == ca.options["prompt_form"]["query_suffix"]


def test_the_groups_take_the_old_keywords_with_a_warning(llama):
    kw = dict(response=" the code is 4817.", methods=["contextcite"], progress=False)
    new = ctxmix.attribute_context(llama, CONTEXT, QUERY, ablations=Ablations(n=4, seed=3, keep_prob=0.4), **kw)
    with pytest.warns(FutureWarning, match=r"ablations=Ablations\(n=...\)"):
        old = ctxmix.attribute_context(llama, CONTEXT, QUERY, n_ablations=4, seed=3, keep_prob=0.4, **kw)
    assert (old.scores["contextcite"] == new.scores["contextcite"]).all()
    assert new.options["n_ablations"] == 4 and new.options["keep_prob"] == 0.4
    assert (
        ctxmix.attribute_context(llama, CONTEXT, QUERY, ablations={"n": 4, "seed": 3, "keep_prob": 0.4}, **kw).options
        == new.options
    )
    with pytest.raises(BadInput, match="n_ablations= is ablations.n, and ablations= is given too"):
        ctxmix.attribute_context(llama, CONTEXT, QUERY, ablations={"n": 4}, n_ablations=6, **kw)
    with pytest.raises(BadInput, match="unknown field"):
        ctxmix.attribute_context(llama, CONTEXT, QUERY, ablations={"n_ablations": 4}, **kw)
    with pytest.raises(TypeError, match="unexpected keyword argument 'n_ablation'"):
        ctxmix.attribute_context(llama, CONTEXT, QUERY, n_ablation=4, **kw)
    with pytest.raises(BadInput, match="keep_prob"):
        Ablations(keep_prob=1.0)
    with pytest.raises(BadInput, match="stop must be"):
        PromptForm(stop="paragraph")
    assert AT2().weights is None


def test_at2_weights_of_another_prompt_form_are_named(llama, tmp_path):
    """AT2 weights read features of the prompt form they were trained in: a call in another form (here the base
    model's default cue, weights trained with none) says so in its warnings; in their form, nothing is said."""
    from ctxmix.methods.context import at2

    L, H = llama.n_layers, llama.n_heads
    p = at2.save_weights(tmp_path / "w.npz", {"logit": at2.uniform_weights(L, H)}, L, H, {"prompt": {}})
    kw = dict(response=" the code is 4817.", methods=["at2_exact"], at2={"weights": str(p)}, progress=False)
    cued = ctxmix.attribute_context(llama, CONTEXT, QUERY, **kw)
    assert any("trained with the prompt form {}" in w for w in cued.warnings), cued.warnings
    plain = ctxmix.attribute_context(llama, CONTEXT, QUERY, prompt={"query_suffix": "", "stop": None}, **kw)
    assert not any("prompt form" in w for w in plain.warnings)


def test_target_kind_is_the_explained_quantitys_one_name(llama, capsys):
    """attribute_context's explained quantity is target_kind= as in explain (whose target= is the predicted token);
    the earlier target= and `ctxmix cite --target` are taken with a deprecation note and give the same numbers."""
    kw = dict(response=" the code is 4817.", methods=["logit"], progress=False)
    new = ctxmix.attribute_context(llama, CONTEXT, QUERY, target_kind="logit", **kw)
    with pytest.warns(FutureWarning, match=r"target=\.\.\.\) is deprecated: use target_kind"):
        old = ctxmix.attribute_context(llama, CONTEXT, QUERY, target="logit", **kw)
    assert new.options["target"] == old.options["target"] == "logit"
    assert (new.scores["logit"] == old.scores["logit"]).all()
    with pytest.raises(BadInput, match="target_kind"):
        ctxmix.attribute_context(llama, CONTEXT, QUERY, target="logit", target_kind="logit_prob", **kw)
    from ctxmix.cli import build_parser

    args = build_parser().parse_args(["cite", "--context", "a.txt", "--target", "logit_prob"])
    assert args.target_kind == "logit_prob" and "--target is deprecated" in capsys.readouterr().err
    assert build_parser().parse_args(["cite", "--context", "a.txt"]).target_kind == "log_prob"


def test_what_is_recorded_is_what_was_applied(llama, rambles):
    """The cue follows a query only and the cut a generated response only: options["prompt_form"] says what the
    prompt and the response got, not what "auto" would give."""
    alone = ctxmix.attribute_context(llama, CONTEXT, None, methods=["logit"], progress=False)
    assert alone.options["prompt_form"] == {"query_suffix": "", "stop": "sentence"} and alone.query is None
    given = ctxmix.attribute_context(llama, CONTEXT, QUERY, response=RAMBLE, methods=["logit"], progress=False)
    assert given.options["prompt_form"] == {"query_suffix": "\nAnswer:", "stop": None}
    chat = [{"role": "user", "content": CONTEXT}]
    conv = ctxmix.attribute_context(llama, messages=chat, methods=["logit"], progress=False)
    assert conv.options["prompt_form"]["query_suffix"] == ""
    from ctxmix.methods.context.check import prompt_token_count

    with pytest.warns(FutureWarning, match="prompt=PromptForm"):
        n = prompt_token_count(llama, CONTEXT, QUERY, template="plain")
    assert n == len(given.prompt_ids)


def test_a_resumed_batch_does_not_reuse_rows_of_another_form(llama, tmp_path, monkeypatch):
    """A batch's resume stamp holds the prompt form "auto" resolves to: rows stored when the shipped defaults gave
    another form are computed again, not read back."""
    from ctxmix.benchmark.context.many import attribute_contexts
    from ctxmix.methods.context import defaults

    examples = [{"context": CONTEXT, "query": QUERY, "response": " the code is 4817."}]
    store = tmp_path / "store.jsonl"
    kw = dict(methods=["logit"], store=store, progress=False)
    first = attribute_contexts(llama, examples, **kw)
    again = attribute_contexts(llama, examples, **kw)
    assert list(again.attrs["seconds"].values()) == [0.0]  # read back
    monkeypatch.setattr(defaults, "prompt_form_for", lambda has_chat: {})  # the defaults changed: no cue
    other = attribute_contexts(llama, examples, **kw)
    assert list(other.attrs["seconds"].values())[0] > 0  # computed again
    assert not first["score"].equals(other["score"])


def test_new_at2_options_recompute_at2_exact(llama):
    """extend_attribution with AT2 options other than those the attribution's AT2 scores were made with computes them
    again (it kept the old ones silently); the same options change nothing."""
    from ctxmix.methods.context.check import extend_attribution

    kw = dict(response=" the code is 4817.", methods=["at2_exact"], progress=False)
    ca = ctxmix.attribute_context(llama, CONTEXT, QUERY, at2={"weights": "untrained"}, **kw)
    assert ca.options["at2"]["kind"] == "logit"
    before = ca.scores["at2_exact"].copy()
    extend_attribution(ca, llama, ["at2_exact"], at2={"features": "logit", "weights": "untrained"})
    assert (ca.scores["at2_exact"] == before).all()
    extend_attribution(ca, llama, ["at2_exact"], at2={"features": "attention", "weights": "untrained"})
    assert ca.options["at2"]["kind"] == "attention" and not (ca.scores["at2_exact"] == before).all()
    direct = ctxmix.attribute_context(
        llama, CONTEXT, QUERY, at2={"features": "attention", "weights": "untrained"}, **kw
    )
    assert (ca.scores["at2_exact"] == direct.scores["at2_exact"]).all()


def test_old_at2_kind_names_reach_the_command_line(llama):
    """An attribution saved with the kinds' names of before ("attn") gives a reproduce command in today's names, and
    the command line takes the old spelling too."""
    from ctxmix.cli import build_parser
    from ctxmix.export.context.cite import reproduce_command

    ca = ctxmix.attribute_context(
        llama, CONTEXT, QUERY, response=" the code is 4817.", methods=["at2_exact"], at2={"weights": "untrained"}
    )
    ca.options["at2"]["kind"] = "attn"  # as a file of before holds it
    assert "--at2-features attention" in reproduce_command(ca, "m")
    args = build_parser().parse_args(["cite", "--context", "a.txt", "--at2-features", "attn"])
    assert args.at2_features == "attn"  # read as "attention" by at2.canonical_kind
