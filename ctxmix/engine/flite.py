"""Spoken stimuli with known word times, from the flite speech synthesiser (CMU; Debian's `flite` package).

A controlled sentence spoken by a synthetic voice is to speech what a minimal pair is to text: the words and where
they fall are known. flite prints each phone's end time (`-psdur`); the phones of each word, spoken alone (`-ps`),
are matched in order against the sentence's, which gives every word's start and end. flite runs as a program; it is
not a Python dependency (tests and bench/speech.py need it, ctxmix itself does not).
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ctxmix.errors import BadInput

VOICES = ("slt", "rms", "awb", "kal")  # flite 2.2's built-in voices (kal: 8 kHz, the others 16 kHz)
# sentences whisper-tiny-en is checked on (tests/test_whisper_tiny_en.py, bench/speech.py): plain words, no numbers
SENTENCES = (
    "Please call Stella and ask her to bring these things with her from the store.",
    "The quick brown fox jumps over the lazy dog.",
    "Context mixing measures how much each token reads from the others.",
    "The weather today is cold and windy, with rain in the evening.",
    "She opened the window and looked at the garden below.",
    "A small boat sailed slowly across the quiet lake.",
    "The keys to the cabinet are on the table.",
)


@dataclass(frozen=True)
class Spoken:
    """A sentence spoken by flite: samples (float64 in [-1, 1]) at `sampling_rate`, and each word's (text, start,
    end) in seconds; `words` is None where the phones could not be matched to the words (then only the audio)."""

    text: str
    samples: np.ndarray
    sampling_rate: int
    words: list[tuple[str, float, float]] | None


def _flite(*args: str) -> str:
    if shutil.which("flite") is None:
        raise BadInput("flite is not installed (Debian/Ubuntu: apt install flite)")
    return subprocess.run(["flite", *args], capture_output=True, text=True, check=True).stdout


def speak(text: str, voice: str = "slt") -> Spoken:
    """`text` spoken by flite's `voice`, with its words' times."""
    from scipy.io import wavfile

    if voice not in VOICES:
        raise BadInput(f"flite's voices are {', '.join(VOICES)}, not {voice!r}")
    if not isinstance(text, str) or not text.strip():
        raise BadInput("give a sentence to speak")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "spoken.wav"
        phones = _flite("-voice", voice, "-psdur", "-t", text, "-o", str(path)).split()
        rate, x = wavfile.read(path)
    samples = x.astype(np.float64) / 32768.0
    spans, start = [], 0.0
    for item in phones:  # "phone:end_time"
        name, _, end = item.rpartition(":")
        spans.append((name, start, float(end)))
        start = float(end)
    speech = [s for s in spans if s[0] != "pau"]
    words, k = [], 0
    for word in text.replace(",", " ").replace(".", " ").split():
        n = sum(1 for p in _flite("-voice", voice, "-ps", "-t", word, "-o", "none").split() if p != "pau")
        if n == 0 or k + n > len(speech):
            return Spoken(text, samples, int(rate), None)
        words.append((word, speech[k][1], speech[k + n - 1][2]))
        k += n
    return Spoken(text, samples, int(rate), words if k == len(speech) else None)
