"""Streamlit widgets shared by the pages: model picker, URL state, exports, errors, hosted mode.

Only layout and widget code lives here; every number comes from `ctxmix`.
"""

from __future__ import annotations

import contextlib
import hmac
import math
import os
import re
import threading
from dataclasses import asdict

import streamlit as st
from streamlit.runtime.scriptrunner_utils.exceptions import ScriptControlException

import ctxmix
from ctxmix.engine.embedded import IMAGE_MODELS, SPEECH_MODELS
from ctxmix.export import plots
from ctxmix.service.limits import Limits, check_tokens, hosted_mode, load_limits
from ctxmix.service.limits import password as ctxmix_password

# every embedded text model (one whose package is missing says which); the pages read text, so the image and
# speech models (IMAGE_MODELS, SPEECH_MODELS) are left out of their pickers
EMBEDDED_MODELS = [k for k in ctxmix.EMBEDDED if k not in IMAGE_MODELS + SPEECH_MODELS]
DEFAULT_TEXT = "The keys to the cabinet are on the table ."


# ---------------------------------------------------------------- hosted mode


def _secret(name: str, default=None):
    try:
        return st.secrets.get(name, default)
    except Exception:  # noqa: BLE001 - no secrets.toml at all
        return default


def _secrets() -> dict:
    try:
        return st.secrets.to_dict()
    except Exception:  # noqa: BLE001 - no secrets.toml at all
        return {}


def hosted() -> bool:
    """Hosted mode: CTXMIX_HOSTED, `hosted = true` in .streamlit/secrets.toml, or any password
    (ctxmix.service.limits.hosted_mode: a password means the server is shared, so everything applies)."""
    return hosted_mode(os.environ, _secrets())


def server_limits() -> Limits:
    """The caps of this server (ctxmix.service.limits): generous locally, tight in hosted mode."""
    return load_limits(hosted(), _secrets())


def limits() -> dict:
    """server_limits() as a dict."""
    return asdict(server_limits())


def stop_over_cap(n_tokens: int, what: str = "The text") -> None:
    """Before any model call: a sequence over the per-sequence cap is an error message and the page stops."""
    try:
        check_tokens(n_tokens, server_limits(), what)
    except ctxmix.CtxmixError as e:
        st.error(str(e))
        st.stop()


LONG_INPUT_TOKENS = 1024  # from this length on, the page shows the call's memory estimate beside the run


def memory_caption(model, n_tokens: int, call: str, methods=(), **options) -> None:
    """For a long input, the call's memory estimate (`ctxmix.estimate_memory`) as a caption: its peak, what the
    device can give and the largest part. A call that would not fit is refused by ctxmix itself, before it runs."""
    if n_tokens < LONG_INPUT_TOKENS:
        return
    try:
        est = ctxmix.estimate_memory(model, int(n_tokens), call=call, methods=tuple(methods), **options)
    except ctxmix.CtxmixError:
        return  # the call reports the same problem when it runs
    name, dev, size = est.largest
    verdict = "fits" if est.fits() else "does not fit"
    st.caption(
        f"Memory estimate for {n_tokens:,} tokens: about {est.peak_bytes / 2**30:.1f} GiB over the loaded model on "
        f"{est.device} ({verdict}; largest part: {name}, {size / 2**30:.1f} GiB)."
    )


def allowed_models() -> list[str]:
    if hosted():
        return list(_secret("allowed_models", EMBEDDED_MODELS))
    return EMBEDDED_MODELS


def allowed_image_models() -> list[str]:
    """The Images page's models: the embedded image encoders, those of `allowed_models` in hosted mode when the
    secrets list them."""
    listed = _secret("allowed_models", None) if hosted() else None
    return [m for m in IMAGE_MODELS if listed is None or m in listed]


def allowed_speech_models() -> list[str]:
    """The Speech page's models: the embedded speech models, those of `allowed_models` in hosted mode when the
    secrets list them."""
    listed = _secret("allowed_models", None) if hosted() else None
    return [m for m in SPEECH_MODELS if listed is None or m in listed]


def require_login() -> bool:
    """In hosted mode: Streamlit's OIDC login when [auth] is configured, else a password
    (CTXMIX_PASSWORD or `password` in secrets). Returns True when the page may render."""
    if not hosted():
        return True
    if _secret("auth") is not None:
        if not getattr(st.user, "is_logged_in", False):
            st.title("ctxmix")
            st.button("Log in", on_click=st.login, type="primary")
            return False
        st.sidebar.caption(f"Signed in as {getattr(st.user, 'email', '') or getattr(st.user, 'name', '')}")
        st.sidebar.button("Log out", on_click=st.logout)
        return True
    password = ctxmix_password(os.environ, _secrets())
    if not password:
        st.error(
            "Hosted mode needs a login: set CTXMIX_PASSWORD (or `password` in .streamlit/secrets.toml), "
            "or configure OIDC in an [auth] section of secrets.toml."
        )
        return False
    if st.session_state.get("authenticated"):
        return True
    from ctxmix_dashboard.ui.throttle import THROTTLE

    st.title("ctxmix")
    client = client_address()
    with st.form("login"):
        given = st.text_input("Password", type="password")
        if st.form_submit_button("Enter", type="primary"):
            wait = THROTTLE.wait(client)
            if wait > 0:
                st.error(f"Too many wrong passwords from here: try again in {wait:.0f} s.")
            elif hmac.compare_digest(given.encode(), str(password).encode()):
                THROTTLE.succeeded(client)
                st.session_state["authenticated"] = True
                st.rerun()
            else:
                delay = THROTTLE.failed(client)
                st.error(f"Wrong password. The next try is possible in {delay:.0f} s.")
    return False


def client_address() -> str:
    """Who is logging in: the address the proxy forwarded (its rightmost X-Forwarded-For entry,
    only when CTXMIX_TRUST_PROXY is set: clients can write that header themselves), else the
    connection's address, else "local"."""
    try:
        if os.environ.get("CTXMIX_TRUST_PROXY", "") not in ("", "0"):
            fwd = st.context.headers.get("X-Forwarded-For")
            if isinstance(fwd, str) and fwd.strip():
                return fwd.split(",")[-1].strip()
        ip = st.context.ip_address
        return ip if isinstance(ip, str) and ip else "local"
    except Exception:  # noqa: BLE001 - no request context (tests)
        return "local"


# ---------------------------------------------------------------- pages

# Material icons (Streamlit ships their font): emoji render as empty boxes where no emoji font is installed
PAGES = [
    ("app.py", "Explain", ":material/search:"),
    ("pages/0_Context_attribution.py", "Context attribution", ":material/format_quote:"),
    ("pages/1_Contextualization_change.py", "Contextualization change", ":material/bar_chart:"),
    ("pages/2_LN_gamma_vs_FF_outliers.py", "LN γ vs FF outliers", ":material/scatter_plot:"),
    ("pages/3_Benchmarks.py", "Benchmarks", ":material/leaderboard:"),
    ("pages/4_Saved_explanation.py", "Saved explanation", ":material/folder_open:"),
    ("pages/5_Images.py", "Images", ":material/image:"),
    ("pages/6_Speech.py", "Speech", ":material/graphic_eq:"),
]
SHARED = ("model", "corpus", "n")  # carried from page to page


def page_setup() -> None:
    """First call of every page: page config, login in hosted mode, the shared sidebar links."""
    st.set_page_config(page_title="ctxmix", page_icon=":material/shuffle:", layout="wide")
    if not require_login():
        st.stop()
    for path, label, icon in PAGES:
        st.sidebar.page_link(
            path,
            label=label,
            icon=icon,
            query_params={k: st.session_state[f"_qp_{k}"] for k in SHARED if f"_qp_{k}" in st.session_state},
        )
    st.sidebar.divider()
    st.sidebar.caption(f"ctxmix {ctxmix.__version__} · " + ("hosted mode" if hosted() else "local"))


# ---------------------------------------------------------------- URL state


def qp(name: str, default=None):
    """A view setting from the URL (so shared links reproduce the view), else from this session."""
    v = st.query_params.get(name)
    if v in (None, ""):
        v = st.session_state.get(f"_qp_{name}")
    return default if v in (None, "") else v


def qp_int(name: str, default: int, lo: int, hi: int) -> int:
    """A whole-number view setting from the URL, within [lo, hi]; anything else falls back to
    the default (clamped) with a notice, never an error."""
    default = min(max(int(default), lo), hi)
    v = qp(name)
    if v is None:
        return default
    try:
        n = int(str(v).strip())
    except ValueError:
        n = None
    if n is None or not lo <= n <= hi:
        shown = str(v) if len(str(v)) <= 40 else str(v)[:40] + "…"
        st.warning(f"The link's `{name}={shown}` is not a whole number from {lo} to {hi}; showing {default}.")
        st.session_state.pop(f"_qp_{name}", None)
        return default
    return n


def qp_text(name: str, default: str, max_chars: int = 20_000) -> str:
    """A text setting from the URL, at most max_chars characters (longer ones fall back with a notice)."""
    v = qp(name, default)
    if len(v) > max_chars:
        st.warning(f"The link's `{name}` has {len(v)} characters; at most {max_chars} are taken from a link.")
        return default
    return v


def qp_index(name: str, options: list) -> int:
    """The index of the link's (or this session's) `name` among a select box's options; 0 otherwise."""
    v = qp(name)
    return options.index(v) if v in options else 0


def qp_list(name: str, default: list[str]) -> list[str]:
    v = st.query_params.get_all(name)
    return v or default


def set_qp(**values) -> None:
    """Write the view's state to the URL so a copied link opens the same view."""
    for k, v in values.items():
        if v is None:
            continue
        if isinstance(v, (list, tuple)):
            st.query_params[k] = [str(x) for x in v]
        else:
            st.query_params[k] = str(v)
            st.session_state[f"_qp_{k}"] = str(v)


# ---------------------------------------------------------------- models


@st.cache_resource(show_spinner="Loading the model (once per server process)…")
def get_model(
    name: str,
    dtype: str = "float32",
    device_map: str | None = None,
    quantization: str | None = None,
    offload_folder: str | None = None,
) -> ctxmix.Model:
    return ctxmix.load_model(
        name, dtype=dtype, device_map=device_map, quantization=quantization, offload_folder=offload_folder
    )


LOADING_DTYPES = ("float32", "bfloat16", "float16")
LOADING_QUANTIZATION = ("none", "4bit", "8bit", "int8")


def loading_picker(key: str = "model") -> dict:
    """The sidebar's loading options for a big model (dtype, device map, quantization, offload folder), as
    `load_model`'s keywords; shared through the URL. A hosted copy offers none of them: its operator's
    allow-list loads as configured."""
    if hosted():
        return {}
    dtype = qp("dtype", "float32")
    quant = qp("quant", "none")
    dmap = qp("device_map", "none")
    with st.sidebar.expander("Big models: precision, placement, quantization", expanded=dtype != "float32"):
        dtype = st.selectbox(
            "dtype",
            LOADING_DTYPES,
            index=LOADING_DTYPES.index(dtype) if dtype in LOADING_DTYPES else 0,
            key=f"{key}_dtype",
            help="bfloat16 / float16 halve the model's memory; ctxmix decomposes one layer at a time in float32.",
        )
        dmap = st.selectbox(
            "Device map",
            ("none", "auto"),
            index=1 if dmap == "auto" else 0,
            key=f"{key}_device_map",
            help="auto: accelerate spreads the model over the GPUs, then the CPU, then disk.",
        )
        quant = st.selectbox(
            "Quantization",
            LOADING_QUANTIZATION,
            index=LOADING_QUANTIZATION.index(quant) if quant in LOADING_QUANTIZATION else 0,
            key=f"{key}_quant",
            help="4bit: bitsandbytes nf4; 8bit: LLM.int8 (rounds the inputs too: a warning says how far); "
            "int8: torchao weight-only. Weight-only schemes decompose exactly.",
        )
        folder = st.text_input("Offload folder (for layers on disk)", value="", key=f"{key}_offload")
    set_qp(dtype=dtype, quant=quant, device_map=dmap)
    return {
        "dtype": dtype,
        "device_map": None if dmap == "none" else dmap,
        "quantization": None if quant == "none" else quant,
        "offload_folder": folder.strip() or None,
    }


HF_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")


def model_picker(key: str = "model") -> str:
    """Sidebar model choice, shared by the pages through the URL's `model` parameter."""
    options = allowed_models()
    current = qp("model", options[0])
    custom = ""
    if not hosted():
        options = options + ["other (Hugging Face id or local folder)"]
    index = options.index(current) if current in options else (len(options) - 1 if not hosted() else 0)
    choice = st.sidebar.selectbox(
        "Model",
        options,
        index=index,
        key=f"{key}_select",
        help="Embedded models work offline. In hosted mode only the allow-list is offered.",
    )
    if choice.startswith("other"):
        custom = st.sidebar.text_input(
            "Hugging Face id or folder",
            value=current if current not in EMBEDDED_MODELS else "",
            placeholder="bert-base-uncased",
            key=f"{key}_custom",
        )
        if not custom:
            st.sidebar.info("Type a model id (needs network) or a local folder path.")
            st.stop()
        choice = custom.strip()
    set_qp(model=choice)
    st.session_state["_loading"] = loading_picker(key)
    return choice


def load_or_stop(name: str) -> ctxmix.Model:
    with errors_as_messages():
        m = get_model(name, **st.session_state.get("_loading", {}))
        badge = f"{m.spec.family} · {m.spec.position}-LN · {m.n_layers} layers · {m.kind} · {m.device}"
        if str(m.dtype) != "torch.float32" or m.quantization_schemes:
            badge += f" · {str(m.dtype).removeprefix('torch.')}" + "".join(f" · {s}" for s in m.quantization_schemes)
        st.sidebar.caption(badge)
        if m.info.get("heldout_accuracy") is not None:
            st.sidebar.caption(
                f"Held-out accuracy {m.info['heldout_accuracy']:.1%} "
                f"({m.info.get('heldout_size', '?')} Pang & Lee sentences)"
            )
        return m
    st.stop()


# ---------------------------------------------------------------- corpus jobs

_JOBS = [0]  # corpus jobs running in this server process (module state: shared by every session)
_JOBS_LOCK = threading.Lock()


@contextlib.contextmanager
def corpus_job():
    """A slot for one corpus job, or a polite "busy" and st.stop() when the server runs its cap."""
    cap = limits()["max_concurrent_jobs"]
    with _JOBS_LOCK:
        busy = _JOBS[0] >= cap
        if not busy:
            _JOBS[0] += 1
    if busy:
        st.info(f"The server is busy with {cap} corpus job(s) already; try again in a minute.")
        st.stop()
    try:
        yield
    finally:
        with _JOBS_LOCK:
            _JOBS[0] -= 1


def corpus_caps() -> dict:
    """The per-sequence and per-job token caps every corpus computation gets (ctxmix.service.limits)."""
    lim = limits()
    return {"max_tokens": lim["max_tokens"], "max_total_tokens": lim["max_job_tokens"]}


# ---------------------------------------------------------------- errors


_PATH = re.compile(r"(?:[A-Za-z]:)?[\\/](?:[\w.\-~]+[\\/])+[\w.\-~]*")


def public_message(msg: str) -> str:
    """An error message as a browser may see it: in hosted mode, server paths become "(path)"."""
    return _PATH.sub("(path)", msg) if hosted() else msg


@contextlib.contextmanager
def engine_progress(what: str):
    """A progress bar fed by the engine's loops (`ctxmix.progress.reporting`: this session's call only, another
    session's work on the same model never moves it), removed when the block ends."""
    from ctxmix.progress import reporting

    bar = st.progress(0.0, text=what)
    shown: list = [None]

    def update(stage: str, fraction: float) -> None:
        now = (stage, int(100 * fraction))
        if now != shown[0]:  # one message to the browser per percent, not per chunk
            shown[0] = now
            bar.progress(fraction, text=f"{what} {stage}: {fraction:.0%}")

    try:
        with reporting(update):
            yield
    finally:
        bar.empty()


@contextlib.contextmanager
def errors_as_messages():
    """Show errors as messages in the page, never as tracebacks (hosted mode: no server paths,
    and unexpected errors only as an id to look up in the server log)."""
    try:
        yield
    except ScriptControlException:  # st.stop() and st.rerun() must pass through
        raise
    except (ctxmix.CtxmixError, ValueError, FileNotFoundError) as e:
        st.error(public_message(str(e)))
    except Exception as e:  # noqa: BLE001 - anything else: a short message, the details in the server log
        import logging
        import uuid

        ref = uuid.uuid4().hex[:8]
        logging.getLogger("ctxmix").exception("page error %s", ref)
        if hosted():
            st.error(f"Something went wrong (error {ref}); the details are in the server's log.")
        else:
            st.error(f"Something went wrong: {type(e).__name__}: {e} (error {ref} in the server's log)")


# ---------------------------------------------------------------- exports


def set_provenance(**info) -> dict:
    """What made this page's figures and tables (model, weights, options, text or corpus); every
    export of the page carries it, with the ctxmix version and the date."""
    import datetime

    prov = {
        "ctxmix_version": ctxmix.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        **{k: v for k, v in info.items() if v is not None},
    }
    st.session_state["_provenance"] = prov
    return prov


def _provenance() -> dict | None:
    return st.session_state.get("_provenance")


def reproduce(command: str) -> None:
    """The "Cite / reproduce" box: the CLI command that makes the same numbers, and their provenance."""
    with st.expander("Cite / reproduce", icon=":material/format_quote:"):
        st.caption("The same numbers from the command line (offline for the embedded models):")
        st.code(command, language="bash")
        prov = _provenance()
        if prov:
            st.caption("Every download of this page carries this provenance:")
            st.json(prov, expanded=False)


def export_figure(fig, name: str, data=None, key: str | None = None, presets: bool = True) -> None:
    """Download buttons for a figure (PNG, SVG, PDF via kaleido + Chromium; HTML always) and its data,
    in one row that wraps (so a figure in a narrow column keeps readable buttons). presets=False: no
    paper-size box (a figure that sizes itself, e.g. the shaded context at a chosen width)."""
    key = key or name
    row = st.container(horizontal=True, wrap=True, gap="small", vertical_alignment="center")
    static = plots.static_export_available()
    sizes = {
        "screen": None,
        "ACL column (3.03 in)": "acl-column",
        "ACL page (6.3 in)": "acl-page",
        "NeurIPS / ICLR (5.5 in)": "neurips",
    }
    prov = _provenance()  # captured now: the downloads' data is produced later
    # the size box is drawn after the buttons
    preset = sizes.get(st.session_state.get(f"{key}_size", "screen")) if presets else None
    buttons = row.container(horizontal=True, wrap=False, gap="small", width="content")
    for fmt in ["png", "svg", "pdf"]:
        buttons.download_button(
            fmt.upper(),
            data=(lambda f=fmt: plots.figure_bytes(fig, f, preset=preset, provenance=prov)) if static else b"",
            file_name=f"{name}.{fmt}",
            mime={"png": "image/png", "svg": "image/svg+xml", "pdf": "application/pdf"}[fmt],
            key=f"{key}_{fmt}",
            disabled=not static,
            on_click="ignore",
            help=None if static else plots.STATIC_HINT,
        )
    buttons.download_button(
        "HTML",
        data=lambda: plots.figure_bytes(fig, "html", provenance=prov),
        file_name=f"{name}.html",
        mime="text/html",
        key=f"{key}_html",
        on_click="ignore",
    )
    if data is not None:
        fmt = "csv" if hasattr(data, "to_csv") else "json"
        row.download_button(
            f"data ({fmt.upper()})",
            data=lambda: plots.figure_data_bytes(data, fmt, prov),
            file_name=f"{name}.{fmt}",
            key=f"{key}_data",
            on_click="ignore",
        )
    if presets:
        row.selectbox(
            "Size",
            list(sizes),
            key=f"{key}_size",
            label_visibility="collapsed",
            width=200,
            help="Static exports at a paper's column or page width, with 9 pt text.",
        )
    if not static:
        row.caption("PNG/SVG/PDF need Chromium")


def export_table(df, name: str, key: str | None = None, caption: str | None = None) -> None:
    key = key or name
    prov = _provenance()
    c1, c2, _ = st.columns([1, 1, 4])
    c1.download_button(
        "CSV",
        data=lambda: plots.table_bytes(df, "csv", provenance=prov),
        file_name=f"{name}.csv",
        mime="text/csv",
        key=f"{key}_csv",
        on_click="ignore",
    )
    c2.download_button(
        "LaTeX",
        data=lambda: plots.table_bytes(df, "tex", caption, prov),
        file_name=f"{name}.tex",
        mime="text/x-tex",
        key=f"{key}_tex",
        on_click="ignore",
    )


def plot(fig, name: str, data=None, key: str | None = None) -> None:
    st.plotly_chart(
        fig,
        key=f"chart_{key or name}",
        config={"displaylogo": False, "toImageButtonOptions": {"format": "svg", "filename": name}},
    )
    export_figure(fig, name, data, key)


# ---------------------------------------------------------------- corpora


def corpus_picker(key: str = "corpus") -> tuple[list[str], str]:
    """Corpus choice (embedded texts or an upload) and the number of sequences, capped in hosted mode."""
    from ctxmix import data

    lim = limits()
    names = {
        "wiki": "English Wikipedia extract (gensim)",
        "pang_lee": "Pang & Lee movie-review sentences (gensim)",
        "upload": "Upload a .txt (one sequence per line) or .jsonl file (field 'text')",
    }
    choice = st.selectbox(
        "Corpus",
        list(names),
        format_func=names.get,
        key=f"{key}_name",
        index=qp_index("corpus", list(names)),
    )
    n = st.number_input("Sequences", 1, lim["max_sequences"], qp_int("n", 20, 1, lim["max_sequences"]), key=f"{key}_n")
    set_qp(corpus=choice, n=n)
    if choice == "upload":
        up = st.file_uploader(
            "Text file",
            type=["txt", "jsonl", "json"],
            key=f"{key}_file",
            max_upload_size=max(1, math.ceil(lim["max_upload_mb"])),
        )  # the browser enforces it
        if up is None:
            st.info("Upload a file to analyse it.")
            st.stop()
        if up.size > lim["max_upload_mb"] * 2**20:  # checked again here: a client can skip the browser's check
            st.error(f"The file is {up.size / 2**20:.1f} MB; the limit here is {lim['max_upload_mb']:g} MB.")
            st.stop()
        import tempfile
        from pathlib import Path

        suffix = Path(up.name).suffix or ".txt"
        with tempfile.NamedTemporaryFile(suffix=suffix, delete=False) as fh:
            fh.write(up.getvalue())
        try:
            return data.read_texts(fh.name, limit=int(n)), f"upload:{up.name}:{hash(up.getvalue())}"
        except (ctxmix.CtxmixError, ValueError, UnicodeError) as e:  # the message names the upload, not the temp path
            st.error(str(e).replace(fh.name, up.name).replace(str(Path(fh.name).parent), "(upload)"))
            st.stop()
        finally:
            os.unlink(fh.name)
    return data.corpus(choice, limit=int(n)), choice
