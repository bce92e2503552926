"""whisper-tiny-en on spoken sentences (flite's voices): word error rate, the word alignment's error against
flite's own phone times, and the cost of explain on a clip (time and peak memory), in one table.

    python bench/speech.py                 # every row (about 3 minutes on 2 cores)
    python bench/speech.py --voices slt    # one voice

Needs Debian's flite. The alignment is the cross-attention DTW of `ctxmix.methods.speech` (Whisper's own method);
its error is |aligned - true| for each word's start and end, from flite's phone end times.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from perf_common import cpu_name, markdown_table, peak_rss_mb, reset_peak_rss  # noqa: E402

import ctxmix  # noqa: E402
from ctxmix.engine.flite import SENTENCES, speak  # noqa: E402
from ctxmix.engine.inputs import audio_input  # noqa: E402
from ctxmix.engine.transcribe import transcribe  # noqa: E402
from ctxmix.methods.speech import word_error_rate  # noqa: E402


def voice_rows(model, voice: str) -> dict:
    heard = []
    starts, ends = [], []
    for text in SENTENCES:
        spoken = speak(text, voice)
        inp = audio_input(model, spoken.samples, spoken.sampling_rate)
        heard.append(transcribe(model, inp).text)
        if spoken.words is None:
            continue
        ex = ctxmix.explain(model, None, ["alti"], audio=inp, decoder_text=text)
        aligned = ex.options["words"]
        if len(aligned) != len(spoken.words):
            continue
        for (_, a, b), w in zip(spoken.words, aligned):
            starts.append(abs(w["start"] - a))
            ends.append(abs(w["end"] - b))
    s, e = np.array(starts), np.array(ends)
    return {
        "voice": voice,
        "WER": round(word_error_rate(SENTENCES, heard), 3),
        "words aligned": len(s),
        "start error, mean s": round(float(s.mean()), 3),
        "start error, median s": round(float(np.median(s)), 3),
        "end error, mean s": round(float(e.mean()), 3),
        "starts within 0.1 s": round(float((s < 0.1).mean()), 2),
    }


def cost_rows(model, seconds: float = 5.0) -> list[dict]:
    text = " ".join(SENTENCES)
    spoken = speak(text, "slt")
    x = spoken.samples[: int(seconds * spoken.sampling_rate)]
    rows = []
    for what, kwargs in (
        ("explain(alti), encoder", {}),
        ("explain(alti, decoder_text=True): ALTI+", {"decoder_text": True}),
        ("explain(alti, value_zeroing, globenc), encoder", {"methods": ["alti", "value_zeroing", "globenc"]}),
    ):
        methods = kwargs.pop("methods", ["alti"])
        reset_peak_rss()
        t = time.perf_counter()
        ex = ctxmix.explain(model, None, methods, audio=x, sampling_rate=spoken.sampling_rate, **kwargs)
        rows.append(
            {
                "call": f"{what}, {seconds:g} s clip",
                "seconds": round(time.perf_counter() - t, 1),
                "peak RSS GiB": round(peak_rss_mb() / 1024, 2),
                "positions": len(ex.tokens),
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--voices", nargs="+", default=["slt", "rms", "awb"])
    args = ap.parse_args()
    import pandas as pd

    model = ctxmix.load_model("whisper-tiny-en")
    print(f"# whisper-tiny-en on flite speech, {cpu_name()}, torch threads {__import__('torch').get_num_threads()}")
    print(markdown_table(pd.DataFrame([voice_rows(model, v) for v in args.voices])))
    print()
    print(markdown_table(pd.DataFrame(cost_rows(model))))


if __name__ == "__main__":
    main()
