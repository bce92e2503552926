"""Whisper's transcript of a clip: greedy decoding, and the decoder's input for a transcript given as text.

Greedy decoding is what the paper's evaluation and faster-whisper's default use for one 30 s window: the decoder
starts from its prompt (<|startoftranscript|>, then the forced tokens: a multilingual model's language and task, and
<|notimestamps|>), takes the most probable token at each step with the model's suppressed tokens masked (and, at
the first step, the tokens it must not begin with), and stops at <|endoftext|>. A model without a generation
config (a random one) starts from its decoder_start_token_id alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ctxmix.errors import BadInput


@dataclass(frozen=True)
class Transcript:
    """prompt: the decoder's first inputs; ids: the transcribed tokens (without the end token); ended: whether the
    model ended the transcript (False: it reached the decoder's length)."""

    prompt: list[int]
    ids: list[int]
    text: str
    ended: bool
    end_id: int | None

    @property
    def decoder_ids(self) -> list[int]:
        """The decoder's teacher-forced input: prompt + transcript, so that each row predicts the next token."""
        return self.prompt + self.ids

    @property
    def target_ids(self) -> list[int]:
        """What each decoder row predicts: the prompt's next token, the transcript, then the end token (-1 when the
        transcript did not end)."""
        last = self.end_id if self.ended and self.end_id is not None else -1
        return (self.prompt + self.ids)[1:] + [last]


def _rules(model) -> tuple[list[int], set[int], set[int], int | None, int]:
    """(prompt, suppressed, not at the first step, end token, the decoder's length) from the generation config,
    falling back on the config."""
    gen, cfg = getattr(model.hf, "generation_config", None), model.config
    start = getattr(gen, "decoder_start_token_id", None) or cfg.decoder_start_token_id
    if start is None:
        raise BadInput(f"{model.name}'s config has no decoder_start_token_id; the decoder's input cannot be built")
    forced = sorted(getattr(gen, "forced_decoder_ids", None) or [])
    prompt = [int(start)] + [int(tok) for _, tok in forced]
    suppress = set(getattr(gen, "suppress_tokens", None) or getattr(cfg, "suppress_tokens", None) or [])
    begin = set(getattr(gen, "begin_suppress_tokens", None) or getattr(cfg, "begin_suppress_tokens", None) or [])
    end = getattr(gen, "eos_token_id", None) or cfg.eos_token_id
    end = end[0] if isinstance(end, (list, tuple)) else end
    return prompt, suppress, begin, None if end is None else int(end), int(cfg.max_target_positions)


def _text(model, ids: list[int]) -> str:
    if model.tokenizer is None:
        return " ".join(f"<{i}>" for i in ids)
    return model.tokenizer.decode(ids, skip_special_tokens=True).strip()


@torch.no_grad()
def transcribe(model, inp) -> Transcript:
    """Greedy transcript of one clip (`AudioInput`) by a Whisper model, with the encoder run once and the
    decoder's keys and values cached."""
    prompt, suppress, begin, end, length = _rules(model)
    enc = model.hf.get_encoder()(**inp.forward_kwargs(model.device, model.dtype))
    dec = torch.tensor([prompt], device=model.device)
    ids: list[int] = []
    past = None
    vocab = model.hf.config.vocab_size
    mask = torch.zeros(vocab, dtype=torch.bool, device=model.device)
    mask[[t for t in suppress if 0 <= t < vocab]] = True
    first = mask.clone()
    first[[t for t in begin if 0 <= t < vocab]] = True
    while len(prompt) + len(ids) < length:
        out = model.hf(encoder_outputs=enc, decoder_input_ids=dec, past_key_values=past, use_cache=True)
        logits = out.logits[0, -1].float().masked_fill(first if not ids else mask, float("-inf"))
        nxt = int(logits.argmax())
        if nxt == end:
            return Transcript(prompt, ids, _text(model, ids), True, end)
        ids.append(nxt)
        past, dec = out.past_key_values, torch.tensor([[nxt]], device=model.device)
    return Transcript(prompt, ids, _text(model, ids), False, end)


def given_transcript(model, text: str) -> Transcript:
    """A transcript given as text (a reference, teacher-forced): the model's prompt, then the text's tokens as
    Whisper writes them (a leading space, no special tokens), then the end token."""
    if not isinstance(text, str) or not text.strip():
        raise BadInput("decoder_text must be a non-empty string (a transcript to teacher-force) or True")
    if model.tokenizer is None:
        raise BadInput(f"{model.name} has no tokenizer: give decoder_text=True (its own transcript)")
    prompt, _, _, end, length = _rules(model)
    ids = list(model.tokenizer(" " + text.strip(), add_special_tokens=False)["input_ids"])
    if len(prompt) + len(ids) > length:
        raise BadInput(f"the transcript has {len(ids)} tokens; the decoder reads at most {length - len(prompt)}")
    return Transcript(prompt, ids, text.strip(), True, end)
