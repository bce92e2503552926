"""`ctxmix cite`: which sources of some text files made a causal language model give its answer, on the
command line (`ctxmix.attribute_context` and `ContextAttribution.evaluate`; docs/cli.md).

    ctxmix cite --context a.txt b.txt --query "What is the code?" --method logit contextcite --out ca.json

Every argument that can be checked without the model is checked first (the files, the methods, the output
extension, the counts, a span of a given response): a mistake costs no model load. What needs the model
(the window, an encoder-only model) is refused by `attribute_context` before any pass. Refusals are
`BadInput`s, which the command line prints as one line with exit code 2. Progress bars go to stderr, the
response and the tables to stdout. The command sits in `export` (the stage of files, as `benchmark.command`
sits in its own): it reads text files, runs the library's calls and writes the result's files.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from ctxmix.errors import BadInput

OUT_FORMATS = {
    ".json": "the whole result (ctxmix.load_context_attribution reopens it)",
    ".npz": "the whole result (ctxmix.load_context_attribution reopens it)",
    ".html": "the context shaded by each method's scores",
    ".csv": "one row per source, one score column per method",
}
SOURCE_UNITS = ("sentence", "paragraph", "document")
MAX_FILE_BYTES = 4_000_000  # ~1M tokens of English: far beyond any model's window; refused unread above it
TEXT_WIDTH = (40, 100)  # a source's text is cut to the terminal's width, within these bounds (characters)


def add_cite_arguments(s: argparse.ArgumentParser) -> None:
    """The options after `model_args` (cli.py gives --model, --device, --dtype, --precision)."""
    s.set_defaults(model="smollm2")  # model_args' default is minilm, an encoder: cite needs a causal LM
    s.add_argument(
        "--context",
        nargs="+",
        required=True,
        metavar="FILE",
        help="UTF-8 text files; several files are several documents (joined with a blank line)",
    )
    s.add_argument("--query", default=None, help="the question (default: none, the context alone is the prompt)")
    s.add_argument("--sources", choices=SOURCE_UNITS, default="sentence", help="the unit scored (default: sentence)")
    s.add_argument(
        "--method",
        nargs="+",
        default=None,
        metavar="METHOD",
        help="context-attribution methods: logit, alti_logit, attention, grad_x_input, contextcite, leave_one_out "
        "(default: attribute_context's, logit contextcite)",
    )
    s.add_argument("--n-ablations", type=int, default=32, help="contextcite's random ablations (default 32)")
    s.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated when no --response is given")
    s.add_argument("--response", default=None, help="the response to attribute (default: generated greedily)")
    s.add_argument(
        "--span",
        nargs=2,
        type=int,
        default=None,
        metavar=("START", "END"),
        help="score a character span of the response (0 <= START < END <= its length) instead of all of it",
    )
    s.add_argument("--top", type=int, default=5, metavar="K", help="sources listed per method (default 5)")
    s.add_argument(
        "--evaluate",
        action="store_true",
        help="also measure each method by ablation: topk_drop@1/3/5 and LDS (higher is better)",
    )
    s.add_argument("--eval-ablations", type=int, default=100, help="--evaluate's held-out ablations (default 100)")
    s.add_argument("--out", default=None, help="write " + "; ".join(f"{k}: {v}" for k, v in OUT_FORMATS.items()))


# ---------------------------------------------------------------- checks before the model


def read_document(path: str) -> str:
    """A file's text, or BadInput naming what is wrong: missing, a folder, unreadable, too large, empty,
    binary (a NUL byte), or not UTF-8. A UTF-8 byte-order mark is dropped and Windows line ends become \\n."""
    p = Path(path)
    if not p.exists():
        raise BadInput(f"--context: no such file: {path}")
    if p.is_dir():
        raise BadInput(f"--context: {path} is a folder; give text files (each file is one document)")
    try:
        size = p.stat().st_size
        if size > MAX_FILE_BYTES:
            raise BadInput(
                f"--context: {path} has {size:,} bytes, over the {MAX_FILE_BYTES:,}-byte limit for one file "
                "(far more than any model's window): give an excerpt"
            )
        data = p.read_bytes()
    except PermissionError:
        raise BadInput(f"--context: cannot read {path}: permission denied") from None
    except OSError as e:
        raise BadInput(f"--context: cannot read {path}: {e.strerror or e}") from None
    if b"\x00" in data:
        raise BadInput(f"--context: {path} looks binary (it holds NUL bytes); give a UTF-8 text file (.txt, .md)")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise BadInput(
            f"--context: {path} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); "
            "convert it first, e.g. iconv -f latin1 -t utf-8"
        ) from None
    text = text.replace("\r\n", "\n")
    if not text.strip():
        raise BadInput(f"--context: {path} is empty: nothing to attribute")
    return text


def check_methods(names: list[str]) -> list[str]:
    """Context-attribution methods only; explain's token-level methods are pointed to `ctxmix explain`."""
    from ctxmix.methods.registry import CONTEXT_METHODS, METHODS

    token_level = [m for m in names if m not in CONTEXT_METHODS and m in METHODS]
    if token_level:
        raise BadInput(
            f"{', '.join(token_level)}: a token-level method (which tokens one prediction mixes; see ctxmix explain), "
            f"not a context-attribution method; ctxmix cite takes {', '.join(CONTEXT_METHODS)}"
        )
    unknown = [m for m in names if m not in CONTEXT_METHODS]
    if unknown:  # the library's message
        raise BadInput(
            f"unknown context-attribution method(s) {', '.join(map(repr, unknown))}; "
            f"valid: {', '.join(CONTEXT_METHODS)}"
        )
    return list(dict.fromkeys(names))


def check_out(out: str | None) -> Path | None:
    if out is None:
        return None
    p = Path(out)
    if p.suffix.lower() not in OUT_FORMATS:
        raise BadInput(
            f"--out {out}: unknown extension {p.suffix or '(none)'!r}; valid: {', '.join(OUT_FORMATS)} "
            "(.json/.npz the whole result, .html the shaded context, .csv the scores)"
        )
    if p.is_dir():
        raise BadInput(f"--out {out} is a folder; give a file name")
    return p


def check_args(args) -> tuple[list[str], list[str], Path | None]:
    """(documents, methods, output path), or BadInput before any model is loaded."""
    from ctxmix.engine.generate import MAX_NEW_TOKENS
    from ctxmix.methods.context.ablation import check_n_ablations
    from ctxmix.methods.context.attribution import DEFAULT_METHODS, check_span
    from ctxmix.methods.context.sources import make_sources

    methods = check_methods(list(DEFAULT_METHODS) if args.method is None else args.method)
    out = check_out(args.out)
    check_n_ablations(args.n_ablations)
    if args.evaluate:
        check_n_ablations(args.eval_ablations)
    if not 1 <= args.max_new_tokens <= MAX_NEW_TOKENS:  # attribute_context's check, before the model loads
        raise BadInput(f"max_new_tokens must be a whole number from 1 to {MAX_NEW_TOKENS}, got {args.max_new_tokens}")
    if args.top < 1:
        raise BadInput(f"--top must be a positive whole number, got {args.top}")
    if args.query is not None and not args.query.strip():
        raise BadInput("--query is empty: give the question, or leave it out (the context alone is the prompt)")
    if args.response is not None and not args.response.strip():
        raise BadInput("--response is empty: give the text whose sources you want, or leave it out to generate it")
    if args.span is not None and args.response is not None:
        check_span(tuple(args.span), len(args.response))
    docs = [read_document(f) for f in args.context]
    make_sources(context_arg(docs, args.sources), args.sources)  # one source only: refused before the load
    return docs, methods, out


def context_arg(docs: list[str], unit: str):
    """What attribute_context takes: the one file's text, or the documents (each a source by document)."""
    return docs if len(docs) > 1 or unit == "document" else docs[0]


# ---------------------------------------------------------------- printing


def _cut(text: str, width: int) -> str:
    """One line of at most `width` characters: whitespace runs collapsed, an ellipsis where cut."""
    one = " ".join(text.split())
    return one if len(one) <= width else one[: width - 1].rstrip() + "…"


def top_table(ca, k: int, span=None) -> str:
    """Each method's k best sources: rank, source index, score, text (cut to the terminal)."""
    width = min(max(shutil.get_terminal_size((100, 24)).columns - 30, TEXT_WIDTH[0]), TEXT_WIDTH[1])
    lines = []
    for m in ca.methods:
        top = ca.top(m, min(k, ca.n_sources), span=span)
        cost = ca.cost.get(m, {})
        lines.append(f"{m}  ({cost.get('seconds', float('nan')):.1f} s)")
        for r, (i, v, text) in enumerate(top, 1):
            lines.append(f"  {r:>2}  #{i:<4} {v:>+11.4g}  {_cut(text, width)}")
    return "\n".join(lines)


def evaluation_table(table) -> str:
    """evaluate's table (one row per method), recall columns dropped when no gold source is known."""
    cols = [c for c in table.columns if not (c.startswith("recall@") and table[c].isna().all())]
    return table[cols].to_string(index=False, float_format=lambda v: f"{v:.4g}", na_rep="n/a")


def scores_frame(ca, span=None):
    """Sources x methods: source, start, end, text, then one score column per method (the span's, if any)."""
    import pandas as pd

    df = pd.DataFrame(
        {
            "source": range(ca.n_sources),
            "start": [a for a, _ in ca.source_spans],
            "end": [b for _, b in ca.source_spans],
            "text": ca.sources,
        }
    )
    for m in ca.methods:
        df[m] = ca.scores[m] if span is None else ca.scores_for(m, span)
    return df


def html_page(ca, span=None) -> str:
    """A standalone HTML page: the context shaded by each method (ContextAttribution.show), the summary."""
    import html

    from ctxmix.export.context.html import context_html, summary_html

    title = html.escape(f"ctxmix cite: {ca.model_name}, {ca.n_sources} sources")
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{title}</title></head>\n'
        f"<body>\n{summary_html(ca)}\n<hr>\n{context_html(ca, None, span)}\n</body></html>\n"
    )


def write_out(ca, p: Path, span=None) -> Path:
    p.parent.mkdir(parents=True, exist_ok=True)
    suffix = p.suffix.lower()
    if suffix == ".npz":
        return ca.save(p)
    if suffix == ".json":
        from ctxmix.export.context.json_file import save_context_attribution_json

        return save_context_attribution_json(ca, p)
    if suffix == ".html":
        p.write_text(html_page(ca, span), encoding="utf-8")
    else:
        scores_frame(ca, span).to_csv(p, index=False)
    return p


# ---------------------------------------------------------------- the command


def cmd_cite(args) -> None:
    from ctxmix.engine import models
    from ctxmix.methods.context.attribution import attribute_context

    docs, methods, out = check_args(args)
    model = models.load_model(args.model, device=args.device, dtype=args.dtype, precision=args.precision)
    ca = attribute_context(
        model,
        context_arg(docs, args.sources),
        args.query,
        response=args.response,
        sources=args.sources,
        methods=methods,
        max_new_tokens=args.max_new_tokens,
        n_ablations=args.n_ablations,
        progress=True,
    )
    span = tuple(args.span) if args.span is not None else None
    if span is not None:
        ca.token_range(span)  # a generated response's span is checked once the response is known
    how = ca.options["response"]
    print(f"response ({how}, {len(ca.response_ids)} tokens): {ca.response}")
    files = f"{len(docs)} file{'s' if len(docs) > 1 else ''}"
    print(
        f"{ca.n_sources} sources ({args.sources}s of {files}; {len(ca.prompt_ids)} prompt tokens), model {model.name}"
    )
    what = (
        "the whole response" if span is None else f"characters {span[0]}..{span[1]}: {ca.response[span[0] : span[1]]!r}"
    )
    print(f"\ntop {min(args.top, ca.n_sources)} sources per method, for {what} (#: source index):")
    print(top_table(ca, args.top, span))
    for w in ca.warnings:
        print(f"warning: {w}", file=sys.stderr)
    if args.evaluate:
        table = ca.evaluate(model, n_ablations=args.eval_ablations, span=span, progress=True)
        print(f"\nevaluation ({args.eval_ablations} held-out ablations; every column higher is better):")
        print(evaluation_table(table))
        for note in table.attrs.get("notes", []) or []:
            print(f"  note: {note}")
    if out is not None:
        p = write_out(ca, out, span)
        print(f"\nwrote {p}")
