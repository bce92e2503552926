"""`ctxmix cite`: which sources of some text files made a causal language model give its answer, on the
command line (`ctxmix.attribute_context` and `ContextAttribution.evaluate`; docs/cli.md). Over 500 lines because
its flags, their checks and the reproduce command that gives them back are read together.

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
    """The options after `model_args` (cli.py gives --model, --device, --dtype, --precision): one flag per
    option of `attribute_context` (and of `attribute_contexts` for --batch)."""
    from ctxmix.methods.context.at2 import ESTIMATORS, KIND_ALIASES
    from ctxmix.methods.context.defaults import fallback_methods
    from ctxmix.methods.context.onepass import TARGETS
    from ctxmix.methods.registry import CONTEXT_METHODS

    s.set_defaults(model="smollm2")  # model_args' default is minilm, an encoder: cite needs a causal LM
    what = s.add_argument_group("what to attribute (one of --context, --messages, --batch)")
    what.add_argument(
        "--context",
        nargs="+",
        default=None,
        metavar="FILE",
        help="UTF-8 text files; several files are several documents (joined with a blank line)",
    )
    what.add_argument("--query", default=None, help="the question (default: none, the context alone is the prompt)")
    what.add_argument(
        "--messages",
        default=None,
        metavar="FILE.json",
        help='a conversation: a JSON list of {"role", "content"} messages (system, user, assistant, tool), the '
        'last one answered; "attribute": false keeps a message out of the sources, "sources": [[start, end], ...] '
        "gives its sources as spans",
    )
    what.add_argument(
        "--batch",
        default=None,
        metavar="FILE.jsonl",
        help="many examples, one JSON object per line ({context, query} or {messages}, optional response, "
        "sources, id): one table (ctxmix.attribute_contexts); --out must be .csv",
    )
    what.add_argument(
        "--store",
        default=None,
        metavar="FILE.jsonl",
        help="with --batch: keep each finished example here; the same command resumes a killed run",
    )
    s.add_argument("--sources", choices=SOURCE_UNITS, default="sentence", help="the unit scored (default: sentence)")
    s.add_argument(
        "--method",
        nargs="+",
        default=None,
        metavar="METHOD",
        help="context-attribution methods: "
        + ", ".join(CONTEXT_METHODS)
        + " (default: attribute_context's, "
        + " ".join(fallback_methods())
        + ")",
    )
    s.add_argument("--n-ablations", type=int, default=32, help="ContextCite's random ablations (default 32)")
    s.add_argument("--seed", type=int, default=0, help="ContextCite's first mask seed (default 0)")
    s.add_argument(
        "--seeds",
        choices=["example", "official"],
        help="ContextCite's mask seeds: example (each example its own, hashed from --seed and the texts; the "
        "default) or official (--seed + i for every example; the default with --compat)",
    )
    s.add_argument("--keep-prob", type=float, default=0.5, help="ContextCite's keep probability (default 0.5)")
    s.add_argument("--alpha", type=float, default=0.01, help="ContextCite's LASSO penalty (default 0.01)")
    s.add_argument(
        "--batch-size", type=int, default=8, help="ablation passes per forward batch (default 8; numbers unchanged)"
    )
    s.add_argument(
        "--target-kind",
        choices=TARGETS,
        default="log_prob",
        help="what the logit methods explain per response token (explain's target_kind=; --target before)",
    )
    s.add_argument("--target", choices=TARGETS, dest="target_kind", action=_DeprecatedTarget, help=argparse.SUPPRESS)
    s.add_argument(
        "--template",
        choices=["chat", "plain"],
        default=None,
        help="chat: the chat template; plain: BOS + the message (default: chat when the model has a template)",
    )
    s.add_argument("--chat-template", default=None, metavar="FILE", help="a Jinja chat template file to use instead")
    s.add_argument(
        "--query-suffix",
        default="auto",
        metavar="TEXT",
        help="text after the query, an answer cue, \\n a line break (default auto: '\\nAnswer:' for a model "
        "without a chat template, else none; '' for none)",
    )
    s.add_argument(
        "--stop",
        choices=["auto", "sentence", "line", "none"],
        default="auto",
        help="where a generated response is cut (default auto: its first sentence for a model without a chat "
        "template, else where the model stops)",
    )
    s.add_argument(
        "--compat",
        action="store_true",
        help="reproduce the official ContextCite package (context and query only)",
    )
    s.add_argument(
        "--key-mask-levels",
        type=int,
        default=4,
        help="the key-mask integrated gradient's gate levels K (midpoints of K steps of (0, 1); default 4)",
    )
    s.add_argument(
        "--at2-features",
        choices=[*ESTIMATORS, *KIND_ALIASES],  # the names of files written before 2026-11-28 too
        default=None,
        help="AT2's features (default: the weights' own, chosen on their validation table; uniform: logit)",
    )
    s.add_argument(
        "--at2-weights",
        default=None,
        metavar="FILE",
        help="AT2's weights: a file from ctxmix at2-train, or 'untrained' (default: those shipped for the model)",
    )
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


def read_document(path: str, flag: str = "--context") -> str:
    """A file's text, or BadInput naming what is wrong (after `flag`): missing, a folder, unreadable, too
    large, empty, binary (a NUL byte), or not UTF-8. A UTF-8 byte-order mark is dropped and Windows line ends
    become \\n."""
    p = Path(path)
    if not p.exists():
        raise BadInput(f"{flag}: no such file: {path}")
    if p.is_dir():
        raise BadInput(f"{flag}: {path} is a folder; give text files (each file is one document)")
    try:
        size = p.stat().st_size
        if size > MAX_FILE_BYTES:
            raise BadInput(
                f"{flag}: {path} has {size:,} bytes, over the {MAX_FILE_BYTES:,}-byte limit for one file "
                "(far more than any model's window): give an excerpt"
            )
        data = p.read_bytes()
    except PermissionError:
        raise BadInput(f"{flag}: cannot read {path}: permission denied") from None
    except OSError as e:
        raise BadInput(f"{flag}: cannot read {path}: {e.strerror or e}") from None
    if b"\x00" in data:
        raise BadInput(f"{flag}: {path} looks binary (it holds NUL bytes); give a UTF-8 text file (.txt, .md)")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise BadInput(
            f"{flag}: {path} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); "
            "convert it first, e.g. iconv -f latin1 -t utf-8"
        ) from None
    text = text.replace("\r\n", "\n")
    if not text.strip():
        raise BadInput(f"{flag}: {path} is empty: nothing to attribute")
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


def check_args(args) -> tuple[dict, list[str], Path | None]:
    """(what to attribute, methods, output path), or BadInput before any model is loaded. What to attribute:
    {"documents": [...]}, {"messages": [...]} or {"examples": [...]} (--batch)."""
    import json

    from ctxmix.engine.generate import MAX_NEW_TOKENS
    from ctxmix.methods.context.ablation import check_n_ablations
    from ctxmix.methods.context.attribution import DEFAULT_METHODS, check_span
    from ctxmix.methods.context.sources import make_chat_sources, make_sources

    given = [f for f, v in (("--context", args.context), ("--messages", args.messages), ("--batch", args.batch)) if v]
    if len(given) != 1:
        raise BadInput(
            "give one of --context FILE..., --messages FILE.json or --batch FILE.jsonl"
            + (f" (got {' and '.join(given)})" if given else "")
        )
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
    if args.query is not None and not args.context:
        raise BadInput("--query goes with --context (a conversation's question is its last message)")
    if args.store and not args.batch:
        raise BadInput("--store keeps the examples of a --batch run; give --batch FILE.jsonl")
    if args.context:
        docs = [read_document(f) for f in args.context]
        make_sources(context_arg(docs, args.sources), args.sources)  # one source only: refused before the load
        return {"documents": docs}, methods, out
    if args.messages:
        try:
            messages = json.loads(read_document(args.messages, "--messages"))
        except ValueError as e:
            raise BadInput(f"--messages: {args.messages} is not JSON: {e}") from None
        make_chat_sources(messages, args.sources)  # the messages' own checks, before the load
        return {"messages": messages}, methods, out
    from ctxmix.benchmark.context.many import read_examples

    if out is not None and out.suffix.lower() != ".csv":
        raise BadInput("--batch writes one table: give --out FILE.csv")
    for flag in ("response", "span", "evaluate"):
        if getattr(args, flag):
            raise BadInput(f"--{flag} is per example: put it in the --batch file (response) or drop it")
    read_document(args.batch, "--batch")
    return {"examples": read_examples(args.batch)}, methods, out


class _DeprecatedTarget(argparse.Action):
    """--target, the earlier name of --target-kind (explain's --target is the predicted token): taken, with a note."""

    def __call__(self, parser, namespace, values, option_string=None):
        print("ctxmix cite: --target is deprecated: use --target-kind", file=sys.stderr)
        setattr(namespace, self.dest, values)


def attribution_options(args, methods: list[str]) -> dict:
    """attribute_context's options from the command line (what --context, --messages and --batch share), in its
    groups (prompt form, ablations, AT2)."""
    from ctxmix.methods.context.options import unescape_cue

    chat_template = read_document(args.chat_template, "--chat-template") if args.chat_template else None
    return {
        "sources": args.sources,
        "methods": methods,
        "target_kind": args.target_kind,
        "max_new_tokens": args.max_new_tokens,
        "compat": args.compat,
        "key_mask_levels": args.key_mask_levels,
        "prompt": {
            "template": args.template,
            "chat_template": chat_template,
            "query_suffix": unescape_cue(args.query_suffix),
            "stop": None if args.stop == "none" else args.stop,
        },
        "ablations": {
            "n": args.n_ablations,
            "seed": args.seed,
            "seeds": args.seeds,
            "keep_prob": args.keep_prob,
            "alpha": args.alpha,
            "batch_size": args.batch_size,
        },
        "at2": {"features": args.at2_features, "weights": args.at2_weights},
    }


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
    from ctxmix.engine.placement import loading_options
    from ctxmix.methods.context.attribution import attribute_context

    what, methods, out = check_args(args)
    options = attribution_options(args, methods)
    model = models.load_model(
        args.model, device=args.device, dtype=args.dtype, precision=args.precision, **loading_options(args)
    )
    if "examples" in what:
        return _cite_batch(model, what["examples"], options, args, out)
    if "messages" in what:
        ca = attribute_context(model, messages=what["messages"], response=args.response, progress=True, **options)
        about = f"{len(what['messages'])} messages"
    else:
        docs = what["documents"]
        ca = attribute_context(
            model, context_arg(docs, args.sources), args.query, response=args.response, progress=True, **options
        )
        about = f"{len(docs)} file{'s' if len(docs) > 1 else ''}"
    span = tuple(args.span) if args.span is not None else None
    if span is not None:
        ca.token_range(span)  # a generated response's span is checked once the response is known
    how = ca.options["response"]
    print(f"response ({how}, {len(ca.response_ids)} tokens): {ca.response}")
    print(
        f"{ca.n_sources} sources ({args.sources}s of {about}; {len(ca.prompt_ids)} prompt tokens), model {model.name}"
    )
    what_span = (
        "the whole response" if span is None else f"characters {span[0]}..{span[1]}: {ca.response[span[0] : span[1]]!r}"
    )
    print(f"\ntop {min(args.top, ca.n_sources)} sources per method, for {what_span} (#: source index):")
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


def _cite_batch(model, examples: list[dict], options: dict, args, out: Path | None) -> None:
    """--batch: every example attributed (`ctxmix.attribute_contexts`), each method's top source per example
    printed, the whole table written to --out (.csv)."""
    from ctxmix.benchmark.context.many import attribute_contexts

    table = attribute_contexts(model, examples, store=args.store, progress=True, **options)
    best = table[table["rank"] == 1][["example", "method", "source", "score", "text"]]
    print(f"{len(examples)} examples, model {model.name}; each method's top source:")
    print(best.to_string(index=False, float_format=lambda v: f"{v:+.4g}", max_colwidth=60))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        table.to_csv(out, index=False)
        print(f"\nwrote {out}")


def reproduce_command(
    ca,
    model: str,
    files: list[str] | None = None,
    out: str = "context_attribution.npz",
    max_new_tokens: int | None = None,
    tokenizer=None,
) -> str:
    """The `ctxmix cite` command that gives `ca`'s scores again: every option it was made with (the response
    included, so the command explains the same text; max_new_tokens: the caller's setting, default the
    attribution's when it generated), the context from `files` (default "context.txt", the pasted text) or,
    for a conversation, "messages.json" (`messages_json(ca)` is its content). With the model's `tokenizer`, a
    generated response whose text does not tokenise back to its ids is left out (greedy decoding with the same
    --max-new-tokens makes the same ids again, where the text would give others)."""
    import shlex

    from ctxmix.methods.registry import CONTEXT_METHODS

    o = ca.options
    q = shlex.quote
    cmd = ["python -m ctxmix cite"]
    form = o.get("prompt_form")  # None: an attribution made before the form was recorded (none was used)
    query = ca.query
    suffix = (form or {}).get("query_suffix") or ""
    if query and suffix and query.endswith(suffix):  # the query as given; the form's cue goes in its own option
        query = query[: -len(suffix)]
    if o.get("prompt", {}).get("format") == "messages":
        cmd += ["--messages", "messages.json"]
    else:
        cmd += ["--context", *(q(f) for f in (files or ["context.txt"]))]
        cmd += ["--query", q(query)] if query else []
    cmd += ["--model", q(model), "--sources", str(o.get("sources")), "--method", *ca.methods]
    if any(CONTEXT_METHODS[m].cost == "ablation" for m in ca.methods if m in CONTEXT_METHODS):
        cmd += ["--n-ablations", str(int(o["n_ablations"])), "--seed", str(int(o["seed"]))]
        default_seeds = "official" if o.get("compat") else "example"
        cmd += ["--seeds", str(o["seeds"])] if o.get("seeds", default_seeds) != default_seeds else []
        cmd += ["--keep-prob", repr(float(o["keep_prob"]))] if float(o["keep_prob"]) != 0.5 else []
        cmd += ["--alpha", repr(float(o["alpha"]))] if float(o["alpha"]) != 0.01 else []
    cmd += ["--target-kind", str(o["target"])] if o.get("target", "log_prob") != "log_prob" else []
    cmd += ["--compat"] if o.get("compat") else []
    levels = o.get("key_mask_levels", 4)
    cmd += ["--key-mask-levels", str(levels)] if isinstance(levels, int) and levels != 4 else []
    if "at2" in o:
        at2 = o["at2"]
        # always named: the default kind is the weights' (chosen on their validation table), and may change with them
        from ctxmix.methods.context.at2 import canonical_kind

        cmd += ["--at2-features", str(canonical_kind(at2["kind"]))] if at2.get("kind") else []
        weights = str(at2.get("weights", ""))
        if weights == "untrained" or not (weights.startswith("shipped:") or weights.startswith("untrained")):
            cmd += ["--at2-weights", q(weights)]  # a file, or uniform weights asked for (not the shipped default)
    kind = (o.get("prompt") or {}).get("template")
    if tokenizer is not None and kind and not (o.get("prompt") or {}).get("chat_template"):
        default = "chat" if getattr(tokenizer, "chat_template", None) else "plain"
        cmd += ["--template", str(kind)] if kind != default else []  # the model's own template otherwise
    cmd += _form_flags(form, o, tokenizer)
    new = max_new_tokens if max_new_tokens is not None else o.get("max_new_tokens")
    cmd += ["--max-new-tokens", str(int(new))] if new else []
    if tokenizer is None or _round_trips(tokenizer, ca):
        cmd += ["--response", q(ca.response)]
    cmd += ["--out", q(out)]
    return " ".join(cmd)


def _form_flags(form: dict | None, options: dict, tokenizer) -> list[str]:
    """--query-suffix and --stop where the attribution's prompt form is not what "auto" gives the model (known from
    its `tokenizer`; without it, always named)."""
    import shlex

    from ctxmix.methods.context.options import escape_cue

    form = form or {"query_suffix": "", "stop": None}
    if tokenizer is not None:
        from ctxmix.methods.context.defaults import prompt_form_for

        info = options.get("prompt") or {}
        has_chat = bool(getattr(tokenizer, "chat_template", None) or info.get("chat_template"))
        auto = {} if options.get("compat") else prompt_form_for(has_chat and info.get("template") != "plain")
        if (auto.get("query_suffix", ""), auto.get("stop")) == (form.get("query_suffix") or "", form.get("stop")):
            return []
    cue = escape_cue(form.get("query_suffix") or "")
    return ["--query-suffix", shlex.quote(cue), "--stop", str(form.get("stop") or "none")]


def _round_trips(tokenizer, ca) -> bool:
    """Whether `--response TEXT` gives the attribution's response ids (compat re-tokenises it as the library does)."""
    if ca.options.get("compat"):
        return True
    ids = tokenizer(ca.response, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    return list(ids) == list(ca.response_ids)


def messages_json(ca) -> str:
    """A conversation's messages as the JSON file `ctxmix cite --messages` reads."""
    import json

    return json.dumps(ca.messages, ensure_ascii=False, indent=1)
