"""A transcript's words on the clip's time axis, and a row's shares gathered into those words.

Whisper writes no word times by itself (tiny.en was run without timestamp tokens). ctxmix aligns the transcript's
tokens to the encoder's frames by the cross-attention of the decoder's alignment heads (those the model's
generation config names, found by Whisper's authors to follow time; else every head of the decoder's upper half):
the heads' weights over the clip's frames, standardised per frame over the tokens, median-filtered along time (7
frames) and averaged, give a (tokens, frames) similarity, and dynamic time warping finds the monotonic path through
it. A token starts where the path first reaches its row; a word spans its tokens. This is the method of Whisper's
own word timestamps (Radford et al. 2022's code, "timing.py"), written here over ctxmix's traced pass so that the
same probabilities serve the maps and the alignment. docs/speech.md measures it against flite's own phone timings.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from ctxmix.errors import BadInput
from ctxmix.methods.explanation import map_row

FILTER_FRAMES = 7  # the median filter's width along time


@dataclass(frozen=True)
class Word:
    """One word of a transcript: its text, its tokens (positions among the decoder's inputs), its time span in
    seconds and the encoder frames [first, last) that span covers."""

    text: str
    tokens: tuple[int, ...]
    start: float
    end: float
    frames: tuple[int, int]

    def record(self) -> dict:
        return {**asdict(self), "tokens": list(self.tokens), "frames": list(self.frames)}


def alignment_heads(model) -> list[tuple[int, int]]:
    """(decoder layer, head) pairs whose cross-attention follows time: the generation config's, else every head of
    the decoder's upper half (transformers' default for Whisper)."""
    gen = getattr(model.hf, "generation_config", None)
    given = getattr(gen, "alignment_heads", None)
    if given:
        return [(int(layer), int(head)) for layer, head in given]
    layers, heads = int(model.config.decoder_layers), int(model.config.decoder_attention_heads)
    return [(layer, head) for layer in range(layers // 2, layers) for head in range(heads)]


def dtw_path(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The monotonic path (rows, columns) from (0, 0) to (T - 1, S - 1) of least total cost through a (T, S) matrix,
    moving right, down or diagonally; ties prefer the diagonal, then down (a new token), then right."""
    T, S = cost.shape
    total = np.full((T + 1, S + 1), np.inf)
    total[0, 0] = 0.0
    move = np.zeros((T + 1, S + 1), dtype=np.int8)  # 0 diagonal, 1 down (from the row above), 2 right
    for i in range(1, T + 1):
        for j in range(1, S + 1):
            steps = (total[i - 1, j - 1], total[i - 1, j], total[i, j - 1])
            k = int(np.argmin(steps))
            total[i, j], move[i, j] = cost[i - 1, j - 1] + steps[k], k
    i, j, rows, cols = T, S, [], []
    while i > 0 and j > 0:
        rows.append(i - 1)
        cols.append(j - 1)
        k = int(move[i, j])
        i, j = (i - 1, j - 1) if k == 0 else (i - 1, j) if k == 1 else (i, j - 1)
    return np.array(rows[::-1]), np.array(cols[::-1])


def token_similarity(cross: np.ndarray, frames: int) -> np.ndarray:
    """(T, frames) similarity of the tokens and the clip's frames from alignment heads' cross-attention
    `cross` (heads, T, S): standardised over the tokens, median-filtered along time, averaged over the heads."""
    from scipy.ndimage import median_filter

    w = cross[:, :, :frames].astype(np.float64)
    w = (w - w.mean(1, keepdims=True)) / np.maximum(w.std(1, keepdims=True), 1e-12)
    w = median_filter(w, size=(1, 1, min(FILTER_FRAMES, frames)), mode="nearest")
    return w.mean(0)


def align_words(model, tr, script, inp) -> list[Word]:
    """The transcript's words on the clip (`Seq2SeqTrace` tr of `script.decoder_ids` over `AudioInput` inp): each
    token's start is where the DTW path through the alignment heads' similarity reaches it; a word runs from its
    first token's start to the next word's (the last to the path's end)."""
    heads = alignment_heads(model)
    P, T = len(script.prompt), len(script.ids)
    if T == 0:
        return []
    if any(layer >= len(tr.decoder) for layer, _ in heads):
        raise BadInput(f"{model.name}'s alignment heads name a decoder layer it does not have")
    # the rows that predict the tokens (row P + t - 1 predicts token t), as Whisper's own alignment takes them: on
    # flite speech their starts fell 0.11 s from the true ones on average, the rows that read them 0.38 s (late)
    cross = np.stack([tr.decoder[layer].alpha_cross[0, head].double().cpu().numpy() for layer, head in heads])
    sim = token_similarity(cross[:, P - 1 : P - 1 + T], inp.n_valid)
    rows, cols = dtw_path(-sim)
    firsts = np.searchsorted(rows, np.arange(T))  # the path's first step in each token's row
    starts = cols[firsts]
    stop = int(cols[-1]) + 1
    pieces = [model.tokenizer.convert_ids_to_tokens([i])[0] if model.tokenizer else f"<{i}>" for i in script.ids]
    groups: list[list[int]] = []
    for t, piece in enumerate(pieces):
        text = model.tokenizer.convert_tokens_to_string([piece]) if model.tokenizer else piece
        if not groups or text.startswith(" ") or not model.tokenizer:
            groups.append([t])
        else:
            groups[-1].append(t)
    step = inp.stride / inp.sampling_rate
    words = []
    for k, g in enumerate(groups):
        first = int(starts[g[0]])
        last = int(starts[groups[k + 1][0]]) if k + 1 < len(groups) else stop
        last = max(last, first + 1)
        text = model.tokenizer.decode([script.ids[t] for t in g]).strip() if model.tokenizer else pieces[g[0]]
        words.append(Word(text, tuple(P + t for t in g), first * step, last * step, (first, last)))
    return words


def word_shares(ex, method: str = "alti", row: int | None = None) -> list[dict]:
    """A row's shares gathered into the transcript's words (an explanation from
    explain(whisper, audio=..., decoder_text=True) or a transcript): for each word, the sum over the frames it spans
    of the row's global-map entries (the row: `row`, or the explained position). Frames outside every word (silence,
    padding) are left out, so the shares sum to at most the row's frame share."""
    words = ex.options.get("words")
    if not words:
        raise BadInput("word_shares needs an explanation of a Whisper transcript (explain(..., decoder_text=True))")
    if method not in ex.global_maps:
        raise BadInput(f"{method} is not among the explanation's global maps ({', '.join(ex.global_maps)})")
    r = ex.position if row is None else int(row)
    values = ex.global_maps[method][-1][r]
    return [
        {"word": w["text"], "start": w["start"], "end": w["end"], "share": float(values[slice(*w["frames"])].sum())}
        for w in words
    ]


def frame_values(ex, method: str, position: int | None = None, layer: int | None = None) -> np.ndarray:
    """Row `position` (default: the explanation's) of `method`'s aggregated map, or of layer `layer`'s map
    (1-based), over the clip's frames: (frames,) values, the padding's included (`options["audio"]["valid_frames"]`
    says where it starts). For a transcript's explanation (ALTI+), the frames are the source columns."""
    audio = (ex.options or {}).get("audio")
    if not audio:
        raise BadInput("this explanation is not of a clip (no options['audio'])")
    v = map_row(ex, method, position, layer)
    return v[: int(audio["frames"])]


def transcript_words(text: str) -> list[str]:
    """A transcript's words for scoring: lower case, letters and apostrophes only."""
    import re

    return re.sub(r"[^a-z' ]", " ", text.lower()).split()


def word_error_rate(references: list[str], hypotheses: list[str]) -> float:
    """Word error rate of transcripts against their references: word edits (substitutions, insertions, deletions;
    Levenshtein over `transcript_words`) summed over the pairs, over the references' words."""
    errors = total = 0
    for ref, hyp in zip(references, hypotheses, strict=True):
        a, b = transcript_words(ref), transcript_words(hyp)
        row = list(range(len(b) + 1))
        for i, x in enumerate(a, 1):
            diagonal, row[0] = row[0], i
            for j, y in enumerate(b, 1):
                diagonal, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, diagonal + (x != y))
        errors += row[-1]
        total += len(a)
    if total == 0:
        raise BadInput("the references hold no word")
    return errors / total
