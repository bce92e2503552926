"""The one-pass validation tables that ship (bench/onepass_eval.py --ship: ctxmix/benchmark/shipped/
onepass-validation*.json): what the shipped defaults of context attribution are chosen on
(`ctxmix.benchmark.context.defaults`) and what a config's AT2 weights' default kind is read from."""

from __future__ import annotations

import json
from pathlib import Path

SHIPPED_DIR = Path(__file__).resolve().parents[1] / "shipped"  # ctxmix.benchmark.shipped's folder


def shipped_tables() -> list[dict]:
    """The shipped one-pass validation tables, by name."""
    return [json.loads(f.read_text()) for f in sorted(SHIPPED_DIR.glob("onepass-validation*.json"))]
