"""Command line: `python -m ctxmix <verb> ...`; `python -m ctxmix --help` lists the verbs.
(Over 500 lines: one parser and one short handler per verb, so `--help` and the code read side by side.)"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import warnings
from pathlib import Path

import numpy as np


def _count(text: str) -> int:
    """argparse's type for a count (0 or more): a bad value stops the command before any work."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def _write_table(df, out: str | None) -> None:
    if out is None:
        print(df.to_string(index=False))
        return
    p = Path(out)
    p.parent.mkdir(parents=True, exist_ok=True)
    if p.suffix == ".json":
        p.write_text(df.to_json(orient="records", indent=1))
    else:
        df.to_csv(p, index=False)
    print(f"wrote {p} ({len(df)} rows)")


def _load(args):
    import ctxmix
    from ctxmix.engine.placement import loading_options

    return ctxmix.load_model(
        args.model, device=args.device, dtype=args.dtype, precision=args.precision, **loading_options(args)
    )


def _texts(args) -> list[str]:
    from ctxmix.data import corpus

    return corpus(args.corpus, limit=args.limit)


def _explain_call(ctxmix, m, args, text):
    """explain as the arguments ask: a text (or a pair), an image, a clip, or ALTI+ with a decoder text."""
    # on an image or a clip, a classifier's gradient methods take a target class and a foil as on text
    scored = {"target": args.target, "foil": args.foil}
    if args.image is not None:  # the mixing methods over the class token and the patches
        return ctxmix.explain(
            m, None, args.method, position=args.position, per_head=args.per_head, image=args.image, **scored
        )
    elif args.audio is not None:  # a speech model's frames; Whisper: ALTI+ over frames and transcript
        script = True if args.transcribe else args.decoder_text
        return ctxmix.explain(
            m,
            None,
            args.method,
            position=args.position,
            per_head=args.per_head,
            audio=args.audio,
            decoder_text=script,
            **scored,
        )
    elif args.decoder_text is not None:  # an encoder-decoder: ALTI+ over source and target
        return ctxmix.explain(m, text, args.method, position=args.position, decoder_text=args.decoder_text)
    else:
        return ctxmix.explain(
            m, text, args.method, target=args.target, position=args.position, foil=args.foil, per_head=args.per_head
        )


@contextlib.contextmanager
def _engine_bar():
    """A terminal progress bar for the engine's long loops (`ctxmix.progress.reporting`), on a terminal only."""
    from ctxmix.progress import progress_bar, reporting

    if not sys.stderr.isatty():
        yield
        return
    bars: list = []  # made at the first report: a call that reports nothing draws nothing

    def update(stage: str, fraction: float) -> None:
        if not bars:
            bars.append(progress_bar(100, stage, unit="%"))
        bars[0].set_description(stage)
        bars[0].n = round(100 * fraction)
        bars[0].refresh()

    try:
        with reporting(update):
            yield
    finally:
        for bar in bars:
            bar.close()


def cmd_explain(args) -> None:
    import ctxmix
    from ctxmix.errors import BadInput

    m = _load(args)
    if sum(x is not None for x in (args.text, args.image, args.audio)) != 1:
        raise BadInput(
            "give a text, or --image PATH for a vision model, or --audio PATH for a speech model (one, not both)"
        )
    if args.transcribe and args.decoder_text is not None:
        raise BadInput("--transcribe uses the model's own transcript; --decoder-text gives one: not both")
    text = args.text if args.pair is None else (args.text, args.pair)
    with _engine_bar():
        ex = _explain_call(ctxmix, m, args, text)
    d = ex.to_dict()
    if not args.maps:
        d.pop("layer_maps")
        d.pop("global_maps")
    if args.out:
        p = Path(args.out)
        p.parent.mkdir(parents=True, exist_ok=True)
        if p.suffix == ".npz":  # the saved-explanation format: ctxmix.load_explanation reopens it
            p = ex.save(p, half=args.half)
        else:
            p.write_text(json.dumps(d, indent=1))
        print(f"wrote {p}")
    elif args.image is not None:
        if ex.prediction:
            print("prediction:", ex.prediction["label"], ex.prediction["probabilities"])
        _print_patch_grids(ex)
    elif args.audio is not None:
        _print_clip(ex)
    else:
        print("tokens:", " ".join(ex.tokens))
        if args.pair is not None:
            print("segments:", " ".join(str(s) for s in ex.segments), "(0: text, 1: pair, -1: special)")
            mix = ctxmix.cross_segment_mixing(ex)
            if len(mix):
                last = mix[(mix["map"] == "aggregated") & (mix["layer"] == mix["layer"].max())]
                print("share of each text's context from the other text (aggregated, last layer):")
                print(last.drop(columns=["map", "layer"]).to_string(index=False, float_format="{:.3f}".format))
        if args.decoder_text is not None:
            S = ex.segments.count(0)
            share = ctxmix.source_contribution(ex)[-1]
            print("source contribution of each target token (ALTI+, after the last decoder layer):")
            print("  " + " ".join(f"{t}={v:.3f}" for t, v in zip(ex.tokens[S:], share)))
        if ex.prediction:
            print("prediction:", ex.prediction["label"], ex.prediction["probabilities"])
        for k, v in ex.saliency.items():
            print(f"{k:>22}: " + " ".join(f"{t}={s:.3g}" for t, s in zip(ex.tokens, v)))


def _whose(ex, method: str) -> str:
    """What a saliency vector is of: a map's row, or (a gradient method) the class it scores."""
    if method in ex.global_maps:
        return f"row {ex.position}: {ex.tokens[ex.position]}"
    labels = list((ex.prediction or {}).get("probabilities", {}))
    label = labels[ex.target] if ex.target is not None and ex.target < len(labels) else ex.target
    return f"class {label}" + (
        f" minus {labels[ex.foil] if ex.foil < len(labels) else ex.foil}" if ex.foil is not None else ""
    )


def _print_patch_grids(ex) -> None:
    """An image explanation's saliency (the explained row of each aggregated map) as the prefix tokens' shares, then
    one line per patch row."""
    img = ex.options["image"]
    prefix, (rows, cols) = img["prefix"], img["grid"]
    for k, v in ex.saliency.items():
        print(f"{k} ({_whose(ex, k)}), over a {rows} x {cols} grid of patches:")
        print("  " + " ".join(f"{t}={s:.3g}" for t, s in zip(ex.tokens[:prefix], v[:prefix])))
        grid = v[prefix:].reshape(rows, cols)
        for r in range(rows):
            print("  " + " ".join(f"{x:7.4f}" for x in grid[r]))


def _print_clip(ex, top: int = 8) -> None:
    """A clip's explanation: the transcript (Whisper), its words on the clip and the explained row's share of each,
    or each method's frames with the largest share of the explained row."""
    import ctxmix

    audio = ex.options["audio"]
    print(
        f"clip: {audio['samples'] / audio['sampling_rate']:.2f} s, {audio['valid_frames']} of {audio['frames']} "
        "positions hold it (the rest: padding)"
    )
    if ex.transcript is not None:
        print("transcript:", ex.transcript)
    if ex.options.get("words"):
        S = ex.options["n_source"]
        share = ctxmix.source_contribution(ex)[-1]
        print("source contribution of each decoder input (ALTI+, after the last decoder layer):")
        print("  " + " ".join(f"{t}={v:.3f}" for t, v in zip(ex.tokens[S:], share)))
        print(f"row {ex.position} ({ex.tokens[ex.position]}): its share of each word's frames (ALTI+)")
        for w in ctxmix.word_shares(ex):
            print(f"  {w['word']:>16} {w['start']:6.2f}-{w['end']:5.2f} s  {w['share']:.3f}")
        return
    for k, v in ex.saliency.items():
        best = sorted(range(len(v)), key=lambda j: -v[j])[:top]
        print(
            f"{k} ({_whose(ex, k)}), the {top} frames with the largest {'share' if k in ex.global_maps else 'score'}:"
        )
        print("  " + " ".join(f"{ex.tokens[j]}={v[j]:.3g}" for j in best))


def cmd_generate(args) -> None:
    """Continue a prompt; with --explain-token, explain one generated token (position t - 1)."""
    import ctxmix

    m = _load(args)
    g = ctxmix.generate(m, args.prompt, max_new_tokens=args.max_new_tokens, greedy=not args.sample, seed=args.seed)
    if args.explain_token is None:
        if args.out:
            p = Path(args.out)
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(json.dumps(g.to_dict(), indent=1))
            print(f"wrote {p}")
            return
        print("continuation:", repr(g.text))
        for s in g.steps:
            print(
                f"  {s['position']:>4} {s['token']!r:>16} p={s['probability']:.3f}  runner-up {s['runner_up_token']!r}"
            )
        return
    t = g.generated_positions[-1] if args.explain_token == -1 else args.explain_token
    kw = g.explain_kwargs(t, foil="runner_up" if args.runner_up_foil else None)
    ex = ctxmix.explain(m, None, args.method, **kw)
    if args.out:
        p = ex.save(args.out) if str(args.out).endswith(".npz") else Path(args.out)
        if not str(args.out).endswith(".npz"):
            p.write_text(json.dumps(ex.to_dict(), indent=1))
        print(f"wrote {p}")
    else:
        print("continuation:", repr(g.text))
        print(f"explained: token {t} {g.tokens[t]!r} at position {t - 1}")
        for k, v in ex.saliency.items():
            print(f"{k:>22}: " + " ".join(f"{tok}={s:.3g}" for tok, s in zip(ex.tokens, v)))


def cmd_routes(args) -> None:
    """Information flow routes to one position's top residual state, as JSON, HTML, PNG, SVG or PDF."""
    import ctxmix
    from ctxmix.export.plots import save_figure

    m = _load(args)
    r = ctxmix.routes(
        m, args.text, position=args.position, threshold=args.threshold, mode=args.mode, p=args.p, dense=args.dense
    )
    if not args.out:
        print(r)
        print(r.graph_edges().to_string(index=False, float_format="{:.3f}".format))
        return
    p = Path(args.out)
    p.parent.mkdir(parents=True, exist_ok=True)
    if p.suffix == ".json":
        p.write_text(r.to_json(indent=1))
    else:
        save_figure(r.figure(), str(p))
    print(f"wrote {p}")


def cmd_scopes(args) -> None:
    import ctxmix

    m = _load(args)
    text = args.text if args.pair is None else (args.text, args.pair)
    maps = ctxmix.scope_maps(m, text, res2=args.res2)
    tokens = m.tokens(m.encode_input(text).ids)
    p = Path(args.out)
    p.parent.mkdir(parents=True, exist_ok=True)
    if p.suffix == ".npz":
        np.savez_compressed(p, tokens=np.array(tokens), **maps)
    else:
        p.write_text(json.dumps({"tokens": tokens, "maps": {k: v.tolist() for k, v in maps.items()}}))
    print(f"wrote {p}: {', '.join(maps)} of shape {next(iter(maps.values())).shape}")


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


def _files(folder: str, suffixes: tuple[str, ...], limit: int) -> list[Path]:
    """The files of `folder` with one of `suffixes`, sorted by name, at most `limit`."""
    from ctxmix.errors import BadInput

    path = Path(folder)
    if not path.is_dir():
        raise BadInput(f"no folder at {path}")
    found = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in suffixes)
    if not found:
        raise BadInput(f"{path} holds no {'/'.join(suffixes)} file")
    return found[:limit]


def cmd_change(args) -> None:
    import ctxmix
    from ctxmix.errors import BadInput

    m = _load(args)
    if args.image_dir and args.audio_dir:
        raise BadInput("give --image-dir or --audio-dir, not both")
    if args.image_dir:
        items = _files(args.image_dir, IMAGE_SUFFIXES, args.limit)
    elif args.audio_dir:
        items = _files(args.audio_dir, (".wav",), args.limit)
    else:
        items = _texts(args)
    df = ctxmix.contextualization_change(
        m,
        items,
        ignore_low_gamma=args.ignore_low_gamma,
        mask_rate=args.mask_rate,
        seed=args.seed,
        res2=args.res2,
        lower_triangle=args.lower_triangle,
    )
    _write_table(df, args.out)


def cmd_outliers(args) -> None:
    import ctxmix

    m = _load(args)
    df = ctxmix.ff_outliers(m, _texts(args))
    _write_table(ctxmix.ff_outlier_correlations(df) if args.summary else df, args.out)


def cmd_ffamp(args) -> None:
    import ctxmix

    m = _load(args)
    _write_table(ctxmix.ff_amp(m, _texts(args), normalise=args.normalise, top_k=args.top_k), args.out)


def cmd_res2(args) -> None:
    import ctxmix

    m = _load(args)
    _write_table(ctxmix.ff_residual_norms(m, _texts(args)), args.out)


def cmd_methods(args) -> None:
    from ctxmix import METHODS
    from ctxmix.methods.registry import CONTEXT_METHODS

    for name, info in METHODS.items():
        print(
            f"{name:22} {info.group:14} {info.paper}: {info.doc}"
            + (f" Per head (explain(..., per_head=True)): {info.per_head}." if info.per_head else "")
            + (f" Caveat: {info.caveat}" if info.caveat else "")
        )
    # the same names can mean a token map above and a source score here: a section of their own
    print("\ncontext attribution (attribute_context, `ctxmix cite`): scores for the sources of a context")
    for name, info in CONTEXT_METHODS.items():
        print(
            f"{name:22} {info.paper}: {info.doc}"
            + (f" Scores are {info.units}." if info.units else "")
            + (f" Caveat: {info.caveat}" if info.caveat else "")
        )


def cmd_models(args) -> None:
    from ctxmix import MIXING_METHODS, PREDICTION_METHODS, SALIENCY_METHODS
    from ctxmix.engine.arch import families_table, supported_families
    from ctxmix.engine.embedded import EMBEDDED

    for k, v in EMBEDDED.items():
        print(f"{k:18} {v}")
    print("\nany Hugging Face id or local folder of these families:", supported_families())
    print(
        f"\nEvery family: the mixing methods ({', '.join(m for m, i in MIXING_METHODS.items() if i.group != 'scope')}) "
        f"and its scopes; with a head (classifier or language model) also {', '.join(SALIENCY_METHODS)}; "
        f"causal language models (pre-LN, parallel and sandwich layers) also {', '.join(PREDICTION_METHODS)}."
    )
    for r in families_table():
        print(
            f"\n{r['family']} ({r['model types']}): {r['norms']}, {r['norm']}, {r['FF']} FF, {r['attention']}"
            f"\n  scopes: {r['scopes']}" + (f"\n  note: {r['note']}" if r["note"] else "")
        )


def cmd_verify(args) -> None:
    import pandas as pd

    from ctxmix.verify import verify

    m = _load(args)
    df = verify(m, args.text, decoder_text=args.decoder_text)
    with pd.option_context("display.width", 200, "display.max_colwidth", 80):
        print(
            df.assign(
                error=df["error"].map("{:.2e}".format),
                tolerance=df["tolerance"].map("{:.0e}".format),
                passed=df["passed"].map({True: "pass", False: "FAIL"}),
            ).to_string(index=False)
        )
    failed = df[~df["passed"]]
    if len(failed):
        print(f"\n{len(failed)} check(s) failed on {m.name}: " + "; ".join(failed["check"]))
        raise SystemExit(1)
    print(f"\nall {len(df)} checks passed on {m.name}")


def cmd_estimate(args) -> None:
    """The memory a call would take, per device, from a config (no weights loaded) or a loaded embedded model."""
    import json as _json

    from ctxmix.engine.embedded import EMBEDDED
    from ctxmix.errors import BadInput
    from ctxmix.methods.memory import CALLS, REFERENCE_CONFIGS, estimate_memory, reference_config

    if args.call not in CALLS:
        raise BadInput(f"--call must be one of {', '.join(CALLS)}")
    try:
        lengths = [int(t) for t in str(args.tokens).split(",") if t.strip()]
    except ValueError:
        raise BadInput(f"--tokens takes integers separated by commas, got {args.tokens!r}") from None
    if args.device_map is not None:
        if args.layers_per_device is not None:
            raise BadInput("give --layers-per-device only: --device-map is its deprecated old name in ctxmix estimate")
        print(
            "--device-map in ctxmix estimate is deprecated: use --layers-per-device; it will mean a module -> device "
            "map as in the other commands",
            file=sys.stderr,
        )
    spread = args.layers_per_device if args.layers_per_device is not None else args.device_map
    flag = "--layers-per-device" if args.layers_per_device is not None else "--device-map"
    try:
        layers_per_device = _json.loads(spread) if spread else None
    except _json.JSONDecodeError as e:
        raise BadInput(f"{flag} is not valid JSON: {e}") from None
    if args.config:
        import transformers as T

        with open(args.config) as fh:
            raw = _json.load(fh)
        target: object = T.AutoConfig.for_model(**raw)
    elif args.model in REFERENCE_CONFIGS:
        target = reference_config(args.model)
    elif args.model in EMBEDDED:
        import ctxmix

        target = ctxmix.load_model(
            args.model, device=args.device, dtype="float32" if args.dtype == "auto" else args.dtype
        )
    else:
        import transformers as T

        target = T.AutoConfig.from_pretrained(args.model)  # the config only: no weights downloaded or read
    methods = [m.strip() for m in args.methods.split(",") if m.strip()] if args.methods else None
    from ctxmix.methods.context.defaults import fallback_methods

    default = {"attribute_context": list(fallback_methods()), "explain": ["alti"]}.get(args.call, [])
    for n in lengths:
        est = estimate_memory(
            target,
            n,
            call=args.call,
            methods=methods or default,
            dtype=None if args.dtype == "auto" else args.dtype,
            device=None if args.device == "auto" else args.device,
            n_response=args.n_response,
            layers_per_device=layers_per_device,
            device_memory=None if args.device_memory is None else int(args.device_memory * 10**9),
        )
        print(str(est) if args.parts else est.message())
        print(f"  fits: {'yes' if est.fits() else 'NO'}")


def build_parser() -> argparse.ArgumentParser:
    from ctxmix import METHODS

    p = argparse.ArgumentParser(
        prog="ctxmix" if os.path.basename(sys.argv[0]) == "ctxmix" else "python -m ctxmix",
        description="Context mixing in Transformers.",
    )
    sub = p.add_subparsers(dest="verb", required=True, metavar="VERB")

    def model_args(s):
        s.add_argument(
            "--model", default="minilm", help="minilm, minilm-sentiment, smollm2, gemma3, a HF id or a folder"
        )
        s.add_argument("--device", default="auto", help="auto (cuda if present), cpu or cuda")
        s.add_argument(
            "--dtype",
            default="float32",
            choices=["float32", "float64", "float16", "bfloat16"],
            help="the dtype the model is held in (half precision: decomposed on float32 activations)",
        )
        s.add_argument(
            "--precision",
            default="float32",
            choices=["float32", "tf32", "bf16"],
            help="the engine's precision for the large products (float32 is exact)",
        )
        s.add_argument(
            "--device-map",
            help="spread the model with accelerate: auto (GPUs, then CPU, then disk), balanced, sequential, or a "
            "JSON object of module name -> device / cpu / disk",
        )
        s.add_argument("--offload-folder", help="where layers mapped to disk are kept (with --device-map)")
        q = s.add_mutually_exclusive_group()
        q.add_argument("--load-in-4bit", action="store_true", help="bitsandbytes nf4 weights (exact on them)")
        q.add_argument(
            "--load-in-8bit", action="store_true", help="bitsandbytes LLM.int8 (inputs rounded too: a warning)"
        )
        q.add_argument("--load-in-int8", action="store_true", help="torchao int8 weight-only (exact on them)")

    def corpus_args(s):
        s.add_argument(
            "--corpus", default="wiki", help="wiki, pang_lee, lee, a .txt/.jsonl file, or hf:NAME:SPLIT:FIELD"
        )
        s.add_argument("--limit", type=_count, default=100, help="number of sequences")
        s.add_argument("--out", help="output .csv or .json (default: print)")

    s = sub.add_parser(
        "explain", help="every requested method on one text (or, with --image or --audio, one image or clip)"
    )
    s.add_argument("text", nargs="?", default=None, help="the text (none with --image or --audio)")
    s.add_argument(
        "--image",
        default=None,
        metavar="PATH",
        help="an image file for a vision model (ViT, DINOv2, CLIP's vision tower; e.g. --model dinov2-small)",
    )
    s.add_argument(
        "--audio",
        default=None,
        metavar="WAV",
        help="a WAV file for a speech model (wav2vec2, HuBERT, Whisper; e.g. --model whisper-tiny-en)",
    )
    s.add_argument(
        "--transcribe",
        action="store_true",
        help="Whisper: ALTI+ over the clip's frames and the model's own transcript (else the encoder's maps)",
    )
    model_args(s)
    s.add_argument(
        "--method",
        nargs="+",
        default=["alti"],
        choices=list(METHODS),
        metavar="METHOD",
        help="one or more of: " + ", ".join(METHODS),
    )
    s.add_argument("--target", default=None, help="class index/label or target token (gradient methods)")
    s.add_argument("--position", type=int, default=None, help="row used for mixing-method saliency")
    s.add_argument("--foil", default=None, help="a contrasting class or token: explain target minus foil")
    s.add_argument(
        "--pair",
        default=None,
        metavar="TEXT_B",
        help="a second text: explain the sentence pair (text, TEXT_B) as the tokenizer pairs them",
    )
    s.add_argument(
        "--decoder-text",
        default=None,
        metavar="TARGET",
        help="encoder-decoder models: the target the decoder reads (ALTI+ source/target contributions; on Whisper "
        "with --audio, a transcript to teacher-force)",
    )
    s.add_argument("--per-head", action="store_true", help="also per-head maps (attention, norm)")
    s.add_argument("--maps", action="store_true", help="include the (L, n, n) maps in the JSON")
    s.add_argument("--out", help="output .json, or .npz (a saved explanation: ctxmix.load_explanation reopens it)")
    s.add_argument("--half", action="store_true", help="with --out .npz: maps in float16, for viewing (half the size)")
    s.set_defaults(func=cmd_explain)

    s = sub.add_parser("generate", help="continue a prompt (causal LMs); --explain-token explains one new token")
    s.add_argument("prompt")
    model_args(s)
    s.add_argument("--max-new-tokens", type=int, default=20)
    s.add_argument("--sample", action="store_true", help="sample (seeded) instead of greedy decoding")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument(
        "--explain-token",
        type=int,
        default=None,
        metavar="T",
        help="explain the generated token at position T (-1: the last): the row at T - 1 predicts it",
    )
    s.add_argument("--method", nargs="+", default=["alti_logit"], choices=sorted(METHODS), metavar="METHOD")
    s.add_argument("--runner-up-foil", action="store_true", help="explain the token minus the runner-up")
    s.add_argument("--out", help="output .json (the continuation, or the explanation) or .npz (a saved explanation)")
    s.set_defaults(func=cmd_generate)

    s = sub.add_parser("routes", help="information flow routes to one position's top residual state")
    s.add_argument("text")
    model_args(s)
    s.add_argument("--position", type=int, default=None, help="the explained position (default: the last token)")
    s.add_argument("--threshold", type=float, default=0.04, help="tau (the LM Transparency Tool's default 0.04)")
    s.add_argument("--mode", choices=["subedge_renorm", "summed_edge"], default="subedge_renorm")
    s.add_argument("--p", type=float, default=1, help="the distance's norm (1: L1, the default)")
    s.add_argument(
        "--dense",
        action="store_true",
        help="allow a threshold below 0.01 on more than 256 tokens: nearly every edge is kept, "
        "about layers x heads x n^2/2 rows (refused without this flag)",
    )
    s.add_argument("--out", help="output .json (the graph) or .html/.png/.svg/.pdf (the figure)")
    s.set_defaults(func=cmd_routes)

    s = sub.add_parser("scopes", help="the FF paper's per-layer scope maps of one text")
    s.add_argument("text")
    model_args(s)
    s.add_argument("--res2", choices=["exact", "diagonal"], default="exact")
    s.add_argument("--pair", default=None, metavar="TEXT_B", help="a second text: scope maps of the sentence pair")
    s.add_argument("--out", required=True, help="output .npz or .json")
    s.set_defaults(func=cmd_scopes)

    s = sub.add_parser("change", help="per-layer contextualization change (1 - Spearman rho) over a corpus")
    model_args(s)
    corpus_args(s)
    s.add_argument("--ignore-low-gamma", type=float, default=0.0, help="fraction of lowest-gamma dims to drop (0.01)")
    s.add_argument("--mask-rate", type=float, default=0.0, help="mask this fraction of tokens (0.12 as the paper)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--res2", choices=["exact", "diagonal"], default="exact")
    s.add_argument("--pair", default=None, metavar="TEXT_B", help="a second text: scope maps of the sentence pair")
    s.add_argument("--lower-triangle", action="store_true", help="causal models: compare j <= i cells only")
    s.add_argument("--image-dir", default=None, metavar="DIR", help="an image model's corpus: the images of DIR")
    s.add_argument("--audio-dir", default=None, metavar="DIR", help="a speech model's corpus: the WAV files of DIR")
    s.set_defaults(func=cmd_change)

    s = sub.add_parser("outliers", help="FF outlier dimensions vs the next norm's gamma")
    model_args(s)
    corpus_args(s)
    s.add_argument("--summary", action="store_true", help="per-layer Pearson and Spearman r only")
    s.set_defaults(func=cmd_outliers)

    s = sub.add_parser("ff-amp", help="token pairs the FF amplifies most, per layer")
    model_args(s)
    corpus_args(s)
    s.add_argument("--normalise", choices=["column", "row"], default="column")
    s.add_argument("--top-k", type=int, default=50)
    s.set_defaults(func=cmd_ffamp)

    s = sub.add_parser("res2", help="mean norm of the FF output vs the vector RES2 bypasses")
    model_args(s)
    corpus_args(s)
    s.set_defaults(func=cmd_res2)

    s = sub.add_parser("bench", help="run a benchmark config: models x methods x datasets x metrics (resumable)")
    from ctxmix.benchmark.command import add_bench_arguments, cmd_bench

    add_bench_arguments(s)
    s.set_defaults(func=cmd_bench)

    s = sub.add_parser(
        "cite", help="which sources of text files made a causal LM give its answer (context attribution)"
    )
    from ctxmix.export.context.cite import add_cite_arguments, cmd_cite

    model_args(s)
    add_cite_arguments(s)
    s.set_defaults(func=cmd_cite)

    s = sub.add_parser("at2-train", help="train at2_exact's per-head weights for context attribution (resumable)")
    from ctxmix.benchmark.context.at2_train import add_at2_arguments, cmd_at2_train

    model_args(s)
    add_at2_arguments(s)
    s.set_defaults(func=cmd_at2_train)

    s = sub.add_parser("serve", help="start the dashboard (local: 127.0.0.1; --hosted: login, caps, no error details)")
    from ctxmix.service.serve import add_serve_arguments, cmd_serve

    add_serve_arguments(s)
    s.set_defaults(func=cmd_serve)

    s = sub.add_parser(
        "estimate", help="the memory a call would take, per device, before loading a model (from its config)"
    )
    s.add_argument(
        "--model",
        default="llama-3-8b",
        help="llama-3-8b, llama-3-70b, qwen3-8b (their published widths), an embedded name (loaded), or a HF id / "
        "folder (its config only)",
    )
    s.add_argument("--config", help="a config.json to estimate from instead (no weights)")
    s.add_argument("--tokens", default="1024", help="input lengths, comma-separated (e.g. 4096,16384,32768)")
    s.add_argument("--call", default="explain", help="explain, scope_maps, routes or attribute_context")
    s.add_argument("--methods", help="comma-separated (default: alti for explain, attribute_context's own for context)")
    s.add_argument("--dtype", default="auto", help="how the weights would be held: auto (the config's), bfloat16, ...")
    s.add_argument("--device", default="auto", help="the engine's device: auto (cuda if present), cpu, cuda")
    s.add_argument(
        "--layers-per-device", metavar="JSON", help='layers per device for a config, JSON: {"cuda:0": 40, "cuda:1": 40}'
    )
    s.add_argument(
        "--device-map", metavar="JSON", help="deprecated: --layers-per-device's old name (to be a module -> device map)"
    )
    s.add_argument("--device-memory", type=float, help="GB per device (default: read; an absent card: 80)")
    s.add_argument("--n-response", type=int, help="response tokens for attribute_context (default 32)")
    s.add_argument("--parts", action="store_true", help="print every part, by device")
    s.set_defaults(func=cmd_estimate)
    s = sub.add_parser("methods", help="list the methods")
    s.set_defaults(func=cmd_methods)
    s = sub.add_parser("models", help="list the embedded models and supported families")
    s.set_defaults(func=cmd_models)
    s = sub.add_parser("verify", help="run ctxmix's correctness checks on a model (exit code 1 if any fails)")
    model_args(s)
    s.add_argument(
        "--text",
        default="The keys to the cabinet are on the table .",
        help="a short text (at most 48 tokens) to check on",
    )
    s.add_argument(
        "--decoder-text",
        default=None,
        metavar="TARGET",
        help="encoder-decoder models: the decoder's text (default: the text itself)",
    )
    s.set_defaults(func=cmd_verify)
    return p


def main(argv: list[str] | None = None) -> int:
    from ctxmix.errors import CtxmixError

    args = build_parser().parse_args(argv)  # bad flags stop here, before any model is loaded
    warnings.simplefilter("default")
    if args.verb != "serve":  # a command's output holds its own words: no weight-loading progress bars
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    if args.verb not in ("serve", "methods", "models"):
        from ctxmix.engine.budget import keep_cpu_buffers

        keep_cpu_buffers()  # this process is ours: faster chunked products on CPU (see its docstring)
    try:
        args.func(args)
    except (CtxmixError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a path that is a folder, not writable, missing...
        where = f": {e.filename}" if getattr(e, "filename", None) else ""
        print(f"error: {e.strerror or e}{where}", file=sys.stderr)
        return 2
    return 0
