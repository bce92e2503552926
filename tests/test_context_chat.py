"""Context attribution on conversations and on the prompt the chat template really makes
(`ctxmix.methods.context.prompt`): the prompt ids equal `apply_chat_template`'s for ChatML (smollm2) and for
Llama-2, Llama-3, Gemma, Phi-3 and Mistral templates (Jinja strings modelled on the released ones) on three
offline tokenizers (smollm2's byte-level BPE, MiniLM's WordPiece, a Metaspace BPE built with `tokenizers`),
with and without a system message and two earlier turns; sources are found in the rendered text however the
template moves or trims them; ablations render the template again; a needle in an earlier turn is found."""

import copy
import types

import numpy as np
import pytest
from conftest import tiny_model

import ctxmix
from ctxmix.errors import BadInput
from ctxmix.methods.context.prompt import PromptBuilder, build_prompt
from ctxmix.methods.context.sources import QUERY, TEMPLATE, make_chat_sources, make_sources

# modelled on the released templates (tokenizer_config.json of each model family), whitespace as there
LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim"
    " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{% set first_user_prefix = messages[0]['content'] + '\n\n' %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
PHI3 = (
    "{% for message in messages %}{% if message['role'] == 'system' %}{{ '<|system|>\n' + message['content'] + "
    "'<|end|>\n' }}{% elif message['role'] == 'user' %}{{ '<|user|>\n' + message['content'] + '<|end|>\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ '<|assistant|>\n' + message['content'] + '<|end|>\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)
# Mistral v0.3: the system text goes before the *last* user turn, out of message order
MISTRAL = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- bos_token }}{%- for message in loop_messages %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('After the optional system message, conversation roles must alternate') }}{%- endif %}"
    "{%- if message['role'] == 'user' %}{%- if loop.last and system_message is defined %}"
    "{{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}{%- else %}"
    "{{- '[INST] ' + message['content'] + '[/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content'] + eos_token }}{%- endif %}{%- endfor %}"
)
TEMPLATES = {"llama2": LLAMA2, "llama3": LLAMA3, "gemma": GEMMA, "phi3": PHI3, "mistral": MISTRAL}
SPECIALS = [
    "<s>",
    "</s>",
    "<unk>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<bos>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
]

SYSTEM = {"role": "system", "content": "You are a careful assistant. Answer from the notes only."}
TURNS = [
    {"role": "user", "content": "  Here are my notes.\nThe museum opened in 1902. The code is 4817.  "},
    {"role": "assistant", "content": "Thank you. I have read the notes."},
    {"role": "user", "content": "The café closes at five. Birds fly south in winter."},
    {"role": "assistant", "content": "Noted as well. Anything else?"},
]
LAST = {"role": "user", "content": "What is the code? Answer in one line."}


def conversations():
    one = [LAST]
    return {
        "one turn": one,
        "system": [SYSTEM, *one],
        "two earlier turns": [*TURNS, LAST],
        "system and two earlier turns": [SYSTEM, *TURNS, LAST],
    }


def _metaspace_tokenizer():
    """A Llama-2-like tokenizer (BPE over Metaspace pieces, "▁" for spaces) trained on a few lines, with the
    templates' special tokens: built offline with the `tokenizers` library."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Metaspace()
    tk.decoder = decoders.Metaspace()
    text = [m["content"] for m in [SYSTEM, *TURNS, LAST]] + ["[INST] <<SYS>> [/INST] user model assistant"] * 3
    tk.train_from_iterator(text, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        additional_special_tokens=SPECIALS[3:],
    )


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    return ctxmix.load_model("smollm2").tokenizer


@pytest.fixture(scope="module")
def tokenizers(smollm2_tokenizer, tokenizer):
    wordpiece = copy.deepcopy(tokenizer)  # BERT's has no BOS / EOS, which the templates write
    wordpiece.bos_token, wordpiece.eos_token = "[CLS]", "[SEP]"
    return {"byte-level BPE": smollm2_tokenizer, "WordPiece": wordpiece, "Metaspace BPE": _metaspace_tokenizer()}


def _fake(tok):
    return types.SimpleNamespace(tokenizer=tok, name="test-tokenizer")


def _templates_ids(tok, messages, template=None):
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, chat_template=template)["input_ids"])


def _check_located(builder, src, prompt):
    """Each source was found where the template put it: its characters in the rendered prompt are its text,
    and every token that lies inside them (from its first non-space character on) is labelled with it."""
    x = builder.full(src)
    text = builder.text(x)
    contents = builder.contents(x)
    bases = builder.locate(text, contents)
    ids, offsets = builder.tokenize(text, contents)
    assert ids == prompt.ids
    for i, ((a, b), k) in enumerate(zip(src.spans, src.message_of)):
        s = bases[k] + a - src.starts[k]
        e = s + b - a
        assert text[s:e] == src.texts[i]
        inside = [
            t
            for t, off in enumerate(offsets)
            if off
            and text[off[0] : off[1]].strip()
            and s <= off[1] - len(text[off[0] : off[1]].lstrip())
            and off[1] <= e
        ]
        assert inside and all(prompt.labels[t] == i for t in inside), (i, src.texts[i])


@pytest.mark.parametrize("conversation", list(conversations()))
@pytest.mark.parametrize("template", list(TEMPLATES))
@pytest.mark.parametrize("kind", ["byte-level BPE", "WordPiece", "Metaspace BPE"])
def test_prompt_ids_are_the_templates(tokenizers, kind, template, conversation):
    tok = tokenizers[kind]
    messages = conversations()[conversation]
    src = make_chat_sources(messages)
    builder = PromptBuilder(_fake(tok), messages=src.messages, chat_template=TEMPLATES[template])
    prompt = builder.encode(src)
    assert prompt.ids == _templates_ids(tok, messages, TEMPLATES[template])
    _check_located(builder, src, prompt)
    assert [
        src.messages[k]["content"][a - src.starts[k] : b - src.starts[k]]
        for (a, b), k in zip(src.spans, src.message_of)
    ] == src.texts


@pytest.mark.parametrize("conversation", list(conversations()))
def test_chatml_of_smollm2(smollm2_tokenizer, conversation):
    """The tokenizer's own template (ChatML, with its default system message when none is given)."""
    messages = conversations()[conversation]
    src = make_chat_sources(messages)
    builder = PromptBuilder(_fake(smollm2_tokenizer), messages=src.messages)
    prompt = builder.encode(src)
    assert prompt.ids == _templates_ids(smollm2_tokenizer, messages)
    _check_located(builder, src, prompt)
    assert prompt.labels[0] == TEMPLATE and prompt.labels[-1] == TEMPLATE


def test_the_context_query_prompt_is_the_templates(smollm2_tokenizer):
    """The context/query form: a template that puts a space before the content ("[INST] ", Llama-2 and
    Mistral v0.x) keeps the space merged into the next word ("ĠContext"), as the template's own
    tokenisation does; tokenising the template's text and the message apart gave "Ġ" + "Context"
    (one id more than the template's)."""
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.chat_template = "{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}"
    context = "The museum opened in 1902. The code for the staff entrance is 4817. The café closes at five."
    query = "What is the code?"
    prompt = PromptBuilder(_fake(tok), query).encode(make_sources(context))
    want = _templates_ids(tok, [{"role": "user", "content": f"Context: {context}\n\nQuery: {query}"}])
    assert prompt.ids == want
    assert tok.convert_ids_to_tokens(prompt.ids)[3] == "ĠContext"


def test_special_token_text_in_a_message_stays_text(smollm2_tokenizer):
    """The one place where the ids differ from the template's: a message that spells `<|im_start|>` gets it
    as text (transformers' `sanitize_control_tokens=True` is the reference), the template's own stay special."""
    messages = [
        {"role": "system", "content": "You are terse. Answer briefly."},
        {"role": "user", "content": "The <|im_start|> marker is text here. The code is 4817."},
    ]
    src = make_chat_sources(messages)
    prompt = PromptBuilder(_fake(smollm2_tokenizer), messages=src.messages).encode(src)
    tok = smollm2_tokenizer
    assert prompt.ids == list(
        tok.apply_chat_template(messages, add_generation_prompt=True, sanitize_control_tokens=True)["input_ids"]
    )
    assert prompt.ids != _templates_ids(tok, messages)
    assert prompt.ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3  # system, user, assistant headers


def test_messages_not_attributed_and_the_document_unit(smollm2_tokenizer):
    messages = [
        {"role": "system", "content": "You are a careful assistant. Answer from the notes only.", "attribute": False},
        *TURNS,
        LAST,
    ]
    src = make_chat_sources(messages, "document")
    assert src.message_of == [1, 2, 3, 4, 5]  # every attributed message one source
    assert src.texts == [m["content"].strip() for m in messages[1:]]
    builder = PromptBuilder(_fake(smollm2_tokenizer), messages=src.messages)
    prompt = builder.encode(src)
    assert prompt.ids == _templates_ids(smollm2_tokenizer, messages)  # "attribute" is not sent
    words = [t for t, lab in zip(smollm2_tokenizer.convert_ids_to_tokens(prompt.ids), prompt.labels) if lab == QUERY]
    assert smollm2_tokenizer.convert_tokens_to_string(words) == messages[0]["content"]
    with pytest.raises(BadInput, match="not both"):
        build_prompt(_fake(smollm2_tokenizer), "text. more.", messages=messages)
    with pytest.raises(BadInput, match="compat"):
        build_prompt(_fake(smollm2_tokenizer), messages=messages, compat=True)
    with pytest.raises(BadInput, match="1 sentence"):
        make_chat_sources([{"role": "user", "content": "One sentence only."}])


def test_plain_prompt_without_a_template(tokenizer):
    """A tokenizer without a chat template: BOS + the content for one message (the context/query form's
    prompt), "Role: content" blocks and "Assistant:" for several."""
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = None
    fake = _fake(tok)
    one = [{"role": "user", "content": "The cat sat. The code is 4817."}]
    src = make_chat_sources(one)
    b = PromptBuilder(fake, messages=src.messages)
    assert b.kind == "plain"
    assert b.encode(src).ids == PromptBuilder(fake, None).encode(make_sources(one[0]["content"])).ids
    two = [{"role": "system", "content": "Be brief."}, *one]
    src = make_chat_sources(two)
    b = PromptBuilder(fake, messages=src.messages)
    assert b.text(b.full(src)) == "System: Be brief.\n\nUser: The cat sat. The code is 4817.\n\nAssistant:"


# ---------------------------------------------------------------- attribute_context on a conversation


@pytest.fixture(scope="module")
def llama(tokenizer):
    return tiny_model("llama", tokenizer)


CHAT = (
    "{% for m in messages %}[CLS] {{ m['role'] }} : {{ m['content'] | trim }} [SEP]{% endfor %}"
    "{% if add_generation_prompt %} assistant :{% endif %}"
)


def test_attribute_a_conversation(llama, tmp_path):
    """The prompt is the template's; every ablation is the template rendered on the messages with the removed
    sources cut out (ContextCite's masks, leave-one-out's); the result saves, reloads and evaluates."""
    messages = [SYSTEM, *TURNS, {**LAST, "attribute": False}]
    ca = ctxmix.attribute_context(
        llama,
        messages=messages,
        chat_template=CHAT,
        response="the code is 4817",
        methods=["logit", "contextcite", "leave_one_out"],
        n_ablations=6,
        progress=False,
    )
    tok = llama.tokenizer
    assert ca.messages == messages and ca.query is None
    assert ca.prompt_ids == _templates_ids(tok, messages, CHAT)
    assert sorted(set(ca.source_messages)) == [0, 1, 2, 3, 4]  # not the last (attribute: False)
    for i, (a, b) in enumerate(ca.source_spans):
        assert ca.context[a:b] == ca.sources[i]
        k = ca.source_messages[i]
        assert ca.sources[i] in messages[k]["content"]
    src = make_chat_sources(messages)
    for name in ("contextcite", "leave_one_out"):
        ab = ca.ablations[name]
        for mask in ab["masks"][:4]:
            kept = src.rebuild(mask)
            want = _templates_ids(tok, [{**m, "content": c} for m, c in zip(messages, kept)], CHAT)
            removed = [ca.sources[i] for i in np.nonzero(~mask)[0]]
            text = tok.decode(want)
            assert all(r.lower() not in text for r in removed)
            b = PromptBuilder(llama, messages=messages, chat_template=CHAT)
            assert b.ids(kept) == want
    # one pass per source, from the same prompts: leave-one-out row 1 + i is "without source i"
    assert ca.ablations["leave_one_out"]["masks"].shape == (ca.n_sources + 1, ca.n_sources)
    p = ca.save(tmp_path / "chat.npz")
    back = ctxmix.load_context_attribution(p)
    assert back.messages == messages and back.source_messages == ca.source_messages
    assert np.array_equal(back.scores["logit"], ca.scores["logit"])
    table = back.evaluate(llama, k=(1,), n_ablations=4, progress=False)
    assert list(table["method"]) == ca.methods


@pytest.mark.slow
def test_the_needle_in_an_earlier_turn_is_found():
    """smollm2: a fact given two turns before the question ranks first, and in its own message."""
    model = ctxmix.load_model("smollm2")
    messages = [
        {"role": "system", "content": "You are a helpful assistant. Answer from the conversation."},
        {
            "role": "user",
            "content": "Some notes about the museum. It opened in 1902 in a former railway station. "
            "The code for the staff entrance is 4817. Visitors enter through the main hall. "
            "The café on the top floor closes at five.",
        },
        {"role": "assistant", "content": "Thank you, I have read your notes about the museum."},
        {"role": "user", "content": "What is the code for the staff entrance?", "attribute": False},
    ]
    ca = ctxmix.attribute_context(
        model,
        messages=messages,
        response="The code for the staff entrance is 4817.",
        methods=["contextcite", "alti_logit"],
        n_ablations=32,
        progress=False,
    )
    needle = ca.sources.index("The code for the staff entrance is 4817.")
    assert ca.source_messages[needle] == 1
    for m in ("contextcite", "alti_logit"):
        assert int(np.argmax(ca.scores[m])) == needle, (m, ca.top(m, 3))
