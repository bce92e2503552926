"""Generation for causal language models, so that a continuation's tokens can be explained.

`generate(model, prompt, max_new_tokens=20)` decodes greedily (or samples, seeded, with temperature,
top-k and top-p) with the model's key-value cache and returns a `Generation`: the prompt's and the
continuation's ids and tokens, and for each generated token its probability and the runner-up (the
dashboard's default foil). The row at position t - 1 predicts token t, so explaining generated token t
means `explain(..., input_ids=g.input_ids[: t + 1], position=t - 1, target=g.input_ids[t])`
(`Generation.explain_kwargs(t)`); under causal attention the rows up to t are the same whatever
follows, so the full `g.input_ids` give the same maps on those rows.

Generation reads no attention probabilities: it runs the model's memory-efficient attention
(`ctxmix.engine.attention.output_only`), and the prefill forms the last row's logits only
(`logits_to_keep=1`), not (n, V).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ctxmix.engine.attention import accepts, output_only
from ctxmix.engine.encoding import check_input_ids, encode_one
from ctxmix.engine.models import Model
from ctxmix.errors import BadInput

MAX_NEW_TOKENS = 512


def prompt_key(prompt_ids: list[int]) -> str:
    """A short fingerprint of a prompt's ids: a shared link's continuation applies to this prompt only."""
    import hashlib

    return hashlib.sha256(",".join(map(str, prompt_ids)).encode()).hexdigest()[:10]


@dataclass
class Generation:
    """prompt_ids and input_ids (prompt + continuation); tokens: every token's display string;
    steps: per generated token {position t, id, token, probability, runner_up, runner_up_token,
    runner_up_probability}; stopped: "eos" or "length"; options: how it was decoded."""

    model_name: str
    prompt_ids: list[int]
    input_ids: list[int]
    tokens: list[str]
    steps: list[dict]
    text: str
    stopped: str
    options: dict = field(default_factory=dict)

    @property
    def prompt_length(self) -> int:
        return len(self.prompt_ids)

    @property
    def new_ids(self) -> list[int]:
        return self.input_ids[self.prompt_length :]

    @property
    def generated_positions(self) -> list[int]:
        """The positions t of the generated tokens in input_ids."""
        return list(range(self.prompt_length, len(self.input_ids)))

    def check_generated(self, t: int) -> int:
        if isinstance(t, bool) or not isinstance(t, int) or t not in self.generated_positions:
            raise BadInput(
                f"token {t!r} is not a generated token; the continuation is at positions "
                f"{self.prompt_length}..{len(self.input_ids) - 1}"
            )
        return t

    def explain_kwargs(self, t: int, foil: str | None = None) -> dict:
        """Keyword arguments that explain generated token t: the ids up to t, position t - 1, target the
        token; foil="runner_up" adds the runner-up at that step as the foil (the API's default is none)."""
        t = self.check_generated(t)
        kw = {"input_ids": self.input_ids[: t + 1], "position": t - 1, "target": self.input_ids[t]}
        if foil == "runner_up":
            kw["foil"] = self.steps[t - self.prompt_length]["runner_up"]
        elif foil is not None:
            raise BadInput(f"foil must be None or 'runner_up', got {foil!r}")
        return kw

    def to_dict(self) -> dict:
        return {
            "model": self.model_name,
            "prompt_ids": self.prompt_ids,
            "input_ids": self.input_ids,
            "tokens": self.tokens,
            "steps": self.steps,
            "text": self.text,
            "stopped": self.stopped,
            "options": self.options,
        }

    def __repr__(self) -> str:
        return f"Generation({self.model_name}, {len(self.new_ids)} new tokens: {self.text!r})"


def _check(model: Model, max_new_tokens, temperature, top_k, top_p, seed, greedy) -> None:
    if model.kind != "causal_lm":
        raise BadInput(f"generate needs a causal language model; {model.name} is a {model.kind}")
    window = model.max_length
    most = max(1, min(MAX_NEW_TOKENS, window - 1))  # a prompt has at least one token
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or not 1 <= max_new_tokens <= most:
        raise BadInput(
            f"max_new_tokens must be a whole number from 1 to {most} (at most {MAX_NEW_TOKENS}, and the prompt "
            f"and its continuation share {model.name}'s window of {window} positions), got {max_new_tokens!r}"
        )
    if not isinstance(greedy, bool):
        raise BadInput(f"greedy must be True or False, got {greedy!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise BadInput(f"temperature must be a positive number, got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise BadInput(f"top_k must be a positive whole number or None, got {top_k!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise BadInput(f"top_p must be in (0, 1], got {top_p!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise BadInput(f"seed must be a whole number or None, got {seed!r}")


def _sample(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float, gen: torch.Generator) -> int:
    """One token from softmax(logits / temperature), restricted to the top_k and to the smallest set whose
    probability reaches top_p (nucleus), drawn with the seeded generator."""
    z = logits.double() / temperature
    if top_k is not None and top_k < z.numel():  # exactly top_k tokens stay, ties broken by torch.topk
        keep = torch.full_like(z, -torch.inf)
        idx = torch.topk(z, top_k).indices
        z = keep.scatter(0, idx, z[idx])
    p = torch.softmax(z, -1)
    if top_p < 1:
        sp, si = torch.sort(p, descending=True)
        keep = torch.cumsum(sp, 0) - sp < top_p  # the first token always stays
        p = torch.zeros_like(p).scatter(0, si[keep], sp[keep])
        p = p / p.sum()
    return int(torch.multinomial(p.cpu(), 1, generator=gen))


def _eos_ids(model: Model) -> set[int]:
    """Every end-of-sequence id: the tokenizer's and the generation config's (Llama 3 lists several)."""
    ids: set[int] = set()
    for v in (
        getattr(model.tokenizer, "eos_token_id", None),
        getattr(getattr(model.hf, "generation_config", None), "eos_token_id", None),
    ):
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids |= {int(x) for x in v if isinstance(x, int)}
    return ids


def _step(model: Model, probs: torch.Tensor, t: int, tok: int) -> dict:
    """The record of generated token `tok` at position t, from the next-token probabilities (vocab,)."""
    top2 = torch.topk(probs, 2).indices.tolist()
    runner = top2[1] if top2[0] == tok else top2[0]
    return {
        "position": t,
        "id": int(tok),
        "token": model.tokens([tok])[0],
        "probability": float(probs[tok]),
        "runner_up": int(runner),
        "runner_up_token": model.tokens([runner])[0],
        "runner_up_probability": float(probs[runner]),
    }


@torch.no_grad()
def generate(
    model: Model,
    prompt=None,
    max_new_tokens: int = 20,
    *,
    input_ids: list[int] | None = None,
    greedy: bool = True,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    seed: int | None = 0,
    stop_at_eos: bool = True,
    progress=None,
) -> Generation:
    """Continue `prompt` (or `input_ids`) on a causal language model: greedy by default, else sampled
    (temperature, top_k, top_p) from a generator seeded with `seed` (None counts as 0), so a run repeats. Stops after
    `max_new_tokens` or at the end-of-sequence token (stop_at_eos). progress(done, total) is called
    after each token. Returns a `Generation`."""
    _check(model, max_new_tokens, temperature, top_k, top_p, seed, greedy)
    if (prompt is None) == (input_ids is None):
        raise BadInput("give a prompt or input_ids (one of them)")
    e = encode_one(model, prompt if input_ids is None else input_ids, ids=input_ids is not None)
    ids = list(e.ids)
    limit = model.max_length
    if len(ids) + max_new_tokens > limit:  # before any forward pass
        room = limit - len(ids)
        raise BadInput(
            f"{len(ids)} prompt tokens + {max_new_tokens} new ones = {len(ids) + max_new_tokens} exceed "
            f"{model.name}'s window of {limit} positions (the prompt and its continuation together): "
            + (f"ask for at most {room} new tokens, or shorten the prompt" if room >= 1 else "shorten the prompt")
        )
    gen = torch.Generator().manual_seed(0 if seed is None else int(seed))
    eos = _eos_ids(model)
    hf = model.hf
    x = torch.tensor([ids], device=model.device)
    past = None
    steps: list[dict] = []
    stopped = "length"
    last = {"logits_to_keep": 1} if accepts(hf, "logits_to_keep") else {}  # the prefill's (V,), not (n, V)
    with output_only(model):  # no step reads attention probabilities
        for k in range(max_new_tokens):
            out = hf(input_ids=x, past_key_values=past, use_cache=True, **last)
            past = out.past_key_values
            logits = out.logits[0, -1].double()
            tok = int(logits.argmax()) if greedy else _sample(logits, temperature, top_k, top_p, gen)
            steps.append(_step(model, torch.softmax(logits, -1), len(ids), tok))
            ids.append(tok)
            if progress is not None:
                progress(k + 1, max_new_tokens)
            if stop_at_eos and tok in eos:
                stopped = "eos"
                break
            x = torch.tensor([[tok]], device=model.device)
    new = ids[len(e.ids) :]
    return Generation(
        model_name=model.name,
        prompt_ids=list(e.ids),
        input_ids=ids,
        tokens=model.tokens(ids),
        steps=steps,
        text=model.tokenizer.decode(new),
        stopped=stopped,
        options={
            "max_new_tokens": max_new_tokens,
            "greedy": greedy,
            "temperature": temperature,
            "top_k": top_k,
            "top_p": top_p,
            "seed": seed,
            "stop_at_eos": stop_at_eos,
        },
    )


@torch.no_grad()
def continuation(model: Model, prompt_ids: list[int], new_ids: list[int]) -> Generation:
    """The `Generation` of a continuation already known (a shared link's ids): one forward pass gives
    each new token's probability and runner-up, as `generate` would have recorded them."""
    if model.kind != "causal_lm":
        raise BadInput(f"a continuation needs a causal language model; {model.name} is a {model.kind}")
    if not new_ids:
        raise BadInput("the continuation is empty")
    ids = check_input_ids(model, list(prompt_ids) + list(new_ids))
    P = len(prompt_ids)
    if P < 1:
        raise BadInput("the prompt is empty")
    hf, n = model.hf, len(ids)
    rows = {"logits_to_keep": n - P + 1} if accepts(hf, "logits_to_keep") else {}  # rows P - 1 .. n - 1 only
    with output_only(model):
        logits = hf(input_ids=torch.tensor([ids], device=model.device), **rows).logits[0]
    probs = torch.softmax(logits[logits.shape[0] - (n - P + 1) :].double(), -1)  # row k predicts token P + k
    steps = [_step(model, probs[t - P], t, ids[t]) for t in range(P, n)]
    return Generation(
        model_name=model.name,
        prompt_ids=list(ids[:P]),
        input_ids=list(ids),
        tokens=model.tokens(ids),
        steps=steps,
        text=model.tokenizer.decode(ids[P:]),
        stopped="given",
        options={"from": "ids"},
    )
