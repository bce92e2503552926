"""The package's layout keeps its promises: stages that import only downwards and without cycles, a
lazy `import ctxmix`, long modules that say why, no citations of tickets or of notes outside the
repository, and a wheel that carries the command, the dashboard and its data."""

import ast
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "ctxmix"
LONG = 520  # "no module over ~500 lines without a line at its top saying why"


def _modules():
    for p in sorted(PKG.rglob("*.py")):
        yield ".".join(("ctxmix",) + p.relative_to(PKG).with_suffix("").parts).removesuffix(".__init__"), p


def _imports(path: Path) -> set[str]:
    """Every ctxmix module this file imports, at the top or inside a function."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("ctxmix"):
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("ctxmix."))
    return out


def test_no_import_cycles():
    graph = {m: _imports(p) - {m} for m, p in _modules()}
    # a module importing from a package imports that package's __init__ only (lazy attributes)
    state: dict[str, int] = {}

    def visit(m, stack):
        state[m] = 1
        for d in graph.get(m, ()):
            if d not in graph:
                continue
            assert state.get(d) != 1, "import cycle: " + " -> ".join(stack + [m, d])
            if not state.get(d):
                visit(d, stack + [m])
        state[m] = 2

    for m in graph:
        if not state.get(m):
            visit(m, [])


# The stages, lowest first (why each sits where it does: test_stages_import_only_downwards).
STAGES = {
    "ctxmix.errors": 0,
    "ctxmix.lazy": 0,
    "ctxmix.progress": 0,
    "ctxmix.hub": 0,
    "ctxmix.data": 1,
    "ctxmix.engine": 2,
    "ctxmix.methods": 3,
    "ctxmix.analyses": 4,
    "ctxmix.service": 5,
    "ctxmix.export": 6,
    "ctxmix.benchmark": 6,
    "ctxmix.verify": 6,
    "ctxmix.service.serve": 7,
    "ctxmix.cli": 7,
    "ctxmix.__main__": 7,
    "ctxmix": 7,
    "ctxmix_dashboard": 7,
}
ROOT_OWN = {"__version__"}  # defined in ctxmix/__init__ itself, loaded before any submodule: stage 0
# A result object's presentation methods (public contract: Explanation.show, ._repr_html_, Routes.figure)
# draw with `export`; they may import it inside the method, never at a module's top. Each name maps to the
# one package it may reach: ContextAttribution.save writes through export.context_file (the reader of that
# format needs service's upload limits, so the format lives in export, the stage of files), and
# ContextAttribution.evaluate runs benchmark.context_metrics (the metrics, with their directions, are the
# benchmark's; the method is a one-example shortcut to them, as show is to export's figures).
PRESENTATION = {
    "show": "ctxmix.export",
    "figure": "ctxmix.export",
    "_repr_html_": "ctxmix.export",
    "save": "ctxmix.export",
    "evaluate": "ctxmix.benchmark",
}


def _stage(module: str) -> int:
    if module in STAGES:
        return STAGES[module]
    parts = module.split(".")
    for k in range(len(parts) - 1, 1, -1):  # longest placed prefix below the root ("ctxmix" is exact only)
        if ".".join(parts[:k]) in STAGES:
            return STAGES[".".join(parts[:k])]
    if parts[0] == "ctxmix_dashboard":
        return STAGES["ctxmix_dashboard"]
    raise AssertionError(f"{module} has no stage: place it in tests/test_layout.py's STAGES")


def _scoped_imports(module: str, path: Path):
    """(target module, enclosing qualified name or "", line) for every ctxmix import of a file, resolved:
    `from pkg import sub` is the submodule, `from ctxmix import name` the module the facade forwards to."""
    import ctxmix

    modules = {m for m, _ in _modules()}
    is_pkg = path.name == "__init__.py"
    out = []

    def resolve(base: str, name: str) -> str:
        if f"{base}.{name}" in modules:
            return f"{base}.{name}"
        if base == "ctxmix" and name in ctxmix._API:
            return "ctxmix." + ctxmix._API[name]
        if base == "ctxmix" and name in ctxmix._SUBMODULES:
            return "ctxmix." + ctxmix._SUBMODULES[name]
        if base == "ctxmix" and name in ROOT_OWN:
            return "ctxmix.errors"  # any stage-0 module: the root's own constant
        return base

    def walk(node, scope: str):
        for ch in ast.iter_child_nodes(node):
            if isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                walk(ch, f"{scope}.{ch.name}" if scope else ch.name)
                continue
            if isinstance(ch, ast.ImportFrom):
                base = ch.module or ""
                if ch.level:
                    pkg = module.split(".") if is_pkg else module.split(".")[:-1]
                    pkg = pkg[: len(pkg) - (ch.level - 1)]
                    base = ".".join(pkg + ([base] if base else []))
                if base.split(".")[0] in ("ctxmix", "ctxmix_dashboard"):
                    out.extend((resolve(base, a.name), scope, ch.lineno) for a in ch.names)
            elif isinstance(ch, ast.Import):
                out.extend(
                    (a.name, scope, ch.lineno)
                    for a in ch.names
                    if a.name.split(".")[0] in ("ctxmix", "ctxmix_dashboard")
                )
            walk(ch, scope)

    walk(ast.parse(path.read_text()), "")
    return out


def _upward(module: str, path: Path) -> list[str]:
    """The imports of one file that go to a higher stage, outside a presentation method's body."""
    bad = []
    for target, scope, line in _scoped_imports(module, path):
        if _stage(target) <= _stage(module):
            continue
        parts = scope.split(".")
        allowed = PRESENTATION.get(parts[-1]) if len(parts) >= 2 else None
        if allowed and (target == allowed or target.startswith(allowed + ".")):
            continue
        where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name}:{line} ({scope or 'top'})"
        bad.append(f"{where}: {module} (stage {_stage(module)}) imports {target} (stage {_stage(target)})")
    return bad


def test_stages_import_only_downwards():
    """engine < methods < analyses < export / benchmark < cli / dashboard: a module imports from its own
    stage or a lower one, never a higher one, at its top or in any function. Every subpackage and
    top-level module of ctxmix is placed in STAGES (a new one fails `_stage` until it is); a module may
    be placed apart from its package (the longest name wins). Lowest first:

    0 errors, lazy, progress, hub: the foundations; they import no other ctxmix module.
    1 data: the text corpora (and the hub datasets behind them); below the engine because
      engine.sentiment fine-tunes the embedded classifier on pang_lee.
    2 engine: architectures, loading, the trace, the exact layer maths, input encoding, scope names.
    3 methods: what the engine's decompositions become (maps, saliency, prediction methods, explain).
    4 analyses: corpus analyses built on the methods.
    5 service (cache, limits): the results cache keyed by model fingerprints, and the hosted limits;
      the runner fingerprints models with it and saved explanations are opened under its archive
      limits, so it sits below export and benchmark.
    6 export, benchmark, verify: consumers that turn results into figures, files, tables and checks.
    7 cli, __main__, service.serve, the `ctxmix` facade (its __init__) and ctxmix_dashboard: the
      commands and the dashboard (`serve` starts it). `from ctxmix import name` is judged by the module
      that defines the name (the facade only forwards it lazily); `__version__` is the root's own.

    The one exception (PRESENTATION): a result object's `show()`, `_repr_html_()` and `figure()`, part
    of the public contract, may import `export` inside the method (`Explanation.show` / `._repr_html_`
    import `export.notebook`, `Routes.figure` imports `export.plots`); never at a module's top. So may
    `ContextAttribution.save` (export.context_file) and `ContextAttribution.evaluate` (only benchmark).

    Violations at 15eecc5, all removed: `engine/generate.py` imported `encode_one` (in `generate`) and
    `check_input_ids` (in `continuation`) from `methods/explain.py`: they live in `engine/encoding.py`
    now; `engine/arch.py`'s `families_table` imported `scope_names` from `methods/registry.py`: the
    scope names live in `engine/scopes.py` now and the registry imports them."""
    bad = [v for m, p in _modules() for v in _upward(m, p)]
    assert bad == [], "imports from a lower stage to a higher one:\n" + "\n".join(bad)


def test_the_stage_check_sees_what_it_must(tmp_path):
    """The check itself: every module has a stage and a new top-level one must be placed; an engine
    module importing upwards is caught at the top, in a plain function, in a method that is not a
    presentation method, and in a presentation method importing anything but `export`; the facade's
    names are judged by their defining module."""
    for m, _ in _modules():
        _stage(m)
    with pytest.raises(AssertionError, match="no stage"):
        _stage("ctxmix.newtoplevel")
    assert _stage("ctxmix.service.serve") > _stage("ctxmix.service.cache") > _stage("ctxmix.methods.explain")
    p = tmp_path / "x.py"
    p.write_text(
        "from ctxmix import explain, __version__, load_model\n"  # 1: explain is methods (up), the others not
        "def show(self):\n"
        "    from ctxmix.export import plots\n"  # 3: a plain function, not a method
        "class R:\n"
        "    def figure(self):\n"
        "        from ctxmix.export.plots import routes_figure\n"  # 6: allowed
        "        from ctxmix.methods import routes\n"  # 7: a presentation method importing the methods
        "    def other(self):\n"
        "        from ctxmix.export.plots import maps\n"  # 9: not a presentation method
        "    def evaluate(self):\n"
        "        from ctxmix.benchmark.context.metrics import evaluate_context\n"  # 11: allowed
        "        from ctxmix.export.context.npz_file import save_context_attribution\n"  # 12: not benchmark
        "    def save(self):\n"
        "        from ctxmix.benchmark import metrics\n"  # 14: not export
    )
    lines = [int(v.split(":")[1].split()[0]) for v in _upward("ctxmix.engine.x", p)]
    assert lines == [1, 3, 7, 9, 12, 14], _upward("ctxmix.engine.x", p)


def test_import_ctxmix_is_lazy():
    code = "import sys, ctxmix; print(sorted(m for m in ('torch', 'plotly', 'streamlit') if m in sys.modules))"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr
    code = "import sys, ctxmix.benchmark.tables, ctxmix.analyses.corpus; "
    code += "print('plotly' in sys.modules, 'streamlit' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.stdout.strip() == "False False", r.stdout + r.stderr  # aggregating and analysing need no plotting


def test_public_names_resolve():
    import ctxmix

    for name in ctxmix.__all__:
        assert getattr(ctxmix, name) is not None
    assert ctxmix.data.corpus and ctxmix.analysis.ff_amp and ctxmix.engine.arch.FAMILIES
    with pytest.raises(AttributeError):
        ctxmix.no_such_name  # noqa: B018


def test_long_modules_say_why():
    files = [p for _, p in _modules()] + sorted((ROOT / "bench").glob("*.py"))
    for p in files:
        lines = p.read_text().splitlines()
        if len(lines) > LONG:
            head = "\n".join(lines[:12])
            assert "500 lines" in head, (
                f"{p.relative_to(ROOT)} has {len(lines)} lines and no note at its top saying why"
            )


def test_no_attention_switch_after_loading():
    """A model is shared by every session of a server: ctxmix sets its attention once, when it is loaded
    (`ctxmix.engine.attention.use_ctxmix_attention`), and configures each pass per call, never the model. No other
    module of ctxmix, the dashboard or the pages switches a model's attention implementation or writes its
    config's `_attn_implementation`. (DeBERTa-v2 has no attention interface and keeps its own eager attention:
    nothing is switched for it either.)"""
    allowed = {PKG / "engine" / "attention.py"}
    pattern = re.compile(r"set_attn_implementation\s*\(|_attn_implementation\w*\s*=[^=]")
    seen = []
    for root in (PKG, ROOT / "ctxmix_dashboard", ROOT / "pages", ROOT / "app.py"):
        for p in [root] if root.is_file() else sorted(root.rglob("*.py")):
            if p in allowed:
                continue
            for i, line in enumerate(p.read_text().splitlines(), 1):
                if pattern.search(line):
                    seen.append(f"{p.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not seen, seen
    # the one call: at loading, once
    text = (PKG / "engine" / "attention.py").read_text()
    assert len(re.findall(r"\.set_attn_implementation\(", text)) == 1
    assert "def use_ctxmix_attention" in text


def test_the_attention_switch_check_sees_what_it_must():
    """The pattern above catches a switch and a config write, and lets a comparison through."""
    pattern = re.compile(r"set_attn_implementation\s*\(|_attn_implementation\w*\s*=[^=]")
    assert pattern.search('hf.set_attn_implementation("eager")')
    assert pattern.search('cfg._attn_implementation = "sdpa"')
    assert pattern.search('cfg._attn_implementation_internal = "sdpa"')
    assert not pattern.search('if cfg._attn_implementation == "eager":')


def test_no_streamlit_in_ctxmix():
    for m, p in _modules():
        assert "streamlit" not in {n.split(".")[0] for n in _imports(p)} and "import streamlit" not in p.read_text(), m


# A citation the reader cannot follow: this project's ticket numbers (the word issue or ticket, then a number,
# with or without "#") and paths into the papers' notes folder, which is not part of the repository. Say what
# was chosen and cite the paper or docs/ instead; another project's ticket is written as "inseq #286".
UNFOLLOWABLE = re.compile(r"\b(?:issue|ticket)s?\s*#?\s*\d+|papers/+notes\b", re.IGNORECASE)
# Where the check looks: the package (its configs included), the dashboard, docs, bench scripts, tests and the
# top-level files; the docs pages gen_pages.py writes are checked at their source.
CITATION_ROOTS = ("ctxmix", "ctxmix_dashboard", "pages", "docs", "bench", "tests")
CITATION_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".cfg", ".ini", ".html", ".js", ".css", ".sh"}
GENERATED_DOCS = ("docs/methods/", "docs/analyses/", "docs/families.md")
# Files that other work is editing now and that still cite one; remove an entry once its file is clean (the
# test then insists on it).
CITATIONS_ALLOWED: set[str] = set()


def _citation_files(root: Path):
    tops = [p for p in root.iterdir() if p.is_file() and (p.suffix in CITATION_SUFFIXES or p.name == "Makefile")]
    tops += [p for p in root.iterdir() if p.is_file() and p.name.startswith("Dockerfile")]
    for p in sorted(tops):
        yield p
    for top in CITATION_ROOTS:
        for p in sorted((root / top).rglob("*")):
            rel = p.relative_to(root).as_posix()
            if p.is_file() and p.suffix in CITATION_SUFFIXES and "__pycache__" not in rel:
                if not rel.startswith(GENERATED_DOCS):
                    yield p


def unfollowable_citations(root: Path) -> dict[str, list[str]]:
    """{path relative to root: ["line: text", ...]} of every file under root that cites a ticket number or
    the notes folder."""
    found: dict[str, list[str]] = {}
    for p in _citation_files(root):
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        hits = [f"{k}: {line.strip()}" for k, line in enumerate(text.splitlines(), 1) if UNFOLLOWABLE.search(line)]
        if hits:
            found[p.relative_to(root).as_posix()] = hits
    return found


def test_no_ticket_numbers_or_notes_paths():
    """Code, docs, configs, bench scripts and tests say what a choice is, not which ticket or which note item
    made it: no ticket number and no path into the notes folder (CITATIONS_ALLOWED: files being cleaned
    elsewhere, each of which must still hold one, so the list only shrinks; empty now)."""
    found = unfollowable_citations(ROOT)
    extra = {f: hits for f, hits in found.items() if f not in CITATIONS_ALLOWED}
    assert not extra, "cite the paper or docs/ and say what was chosen, not the ticket or the note:\n" + "\n".join(
        f"{f}:{hit}" for f, hits in extra.items() for hit in hits
    )
    assert CITATIONS_ALLOWED <= set(found), f"clean now, drop from CITATIONS_ALLOWED: {CITATIONS_ALLOWED - set(found)}"


def test_the_citation_check_sees_what_it_must(tmp_path):
    """The check finds each spelling in each kind of file it covers, and not other projects' tickets."""
    cases = {
        "ctxmix/a.py": "# see the issue" + " 27 for why",
        "ctxmix/benchmark/configs/b.yaml": "# Issue" + " #27, point 3",
        "docs/c.md": "The spec is `../shared/papers/" + "notes/context-attribution.md`.",
        "tests/test_d.py": '"""issues' + ' 26 and 27"""',
        "bench/e.py": "# ticket" + "#12",
        "app.py": "# papers/" + "notes/flow-routes.md",
    }
    for rel, line in cases.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(line + "\n")
    (tmp_path / "pages").mkdir()
    (tmp_path / "pages" / "f.py").write_text("# inseq #286 and captum #1451 are fine; so is an issue of tokenizers\n")
    (tmp_path / "docs" / "methods").mkdir()
    (tmp_path / "docs" / "methods" / "g.md").write_text("generated: issue" + " 5\n")
    assert set(unfollowable_citations(tmp_path)) == set(cases)


def test_the_dashboard_is_the_top_level_and_the_package_list_is_whole():
    """The card's shape: app.py and pages/ at the top (what `streamlit run app.py` starts). pyproject maps
    the top level's *.py modules into the wheel, so app.py must stay the only one; and its package list,
    written out because of that mapping, must hold every package under ctxmix/ and ctxmix_dashboard/."""
    import tomllib

    from setuptools import find_packages

    assert (ROOT / "app.py").is_file() and (ROOT / "pages" / "3_Benchmarks.py").is_file()
    assert [p.name for p in ROOT.glob("*.py")] == ["app.py"]
    assert not (ROOT / "ctxmix_dashboard" / "app.py").exists() and not (ROOT / "ctxmix_dashboard" / "pages").exists()
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = set(find_packages(str(ROOT), include=["ctxmix", "ctxmix.*", "ctxmix_dashboard", "ctxmix_dashboard.*"]))
    assert set(cfg["packages"]) == found | set(cfg["package-dir"]), set(cfg["packages"]) ^ (
        found | set(cfg["package-dir"])
    )


def _wheel(tmp_path: Path) -> Path:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    (wheel,) = tmp_path.glob("ctxmix-*.whl")
    return wheel


@pytest.mark.slow
def test_wheel_carries_the_command_the_dashboard_and_the_data(tmp_path):
    wheel = _wheel(tmp_path)
    z = zipfile.ZipFile(wheel)
    names = set(z.namelist())
    for must in (
        "ctxmix/__init__.py",
        "ctxmix/engine/layer.py",
        "ctxmix/benchmark/configs/embedded.yaml",
        "ctxmix/benchmark/shipped/embedded.aggregates.csv",
        "ctxmix/benchmark/shipped/context.aggregates.csv",
        "ctxmix/benchmark/configs/context.yaml",
        "ctxmix/methods/context/at2_weights/smollm2.npz",  # at2_exact's default weights and their held-out table
        "ctxmix/methods/context/at2_weights/smollm2.json",
        "ctxmix_dashboard/toplevel/app.py",
        "ctxmix_dashboard/toplevel/pages/3_Benchmarks.py",
        "ctxmix_dashboard/ui/common.py",
    ):
        assert must in names, must
    # the very files of the top level, and nothing else of it (no second copy of any page)
    top = sorted(n for n in names if n.startswith("ctxmix_dashboard/toplevel/"))
    assert top == ["ctxmix_dashboard/toplevel/app.py"] + [
        f"ctxmix_dashboard/toplevel/pages/{p.name}" for p in sorted((ROOT / "pages").glob("*.py"))
    ], top
    assert z.read("ctxmix_dashboard/toplevel/app.py") == (ROOT / "app.py").read_bytes()
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "ctxmix = ctxmix.cli:main" in z.read(entry).decode()


@pytest.mark.slow
def test_installed_wheel_serves_the_same_pages_from_another_folder(tmp_path):
    """`pip install .` then `ctxmix serve` anywhere: the launcher starts the wheel's own app.py, and
    that copy renders the Explain page and every other page (Streamlit's AppTest, in a subprocess
    whose imports come from the installed files, not from this checkout)."""
    wheel = _wheel(tmp_path / "dist")
    site = tmp_path / "site"
    r = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1"}
    env.pop("CTXMIX_PASSWORD", None)
    env.pop("CTXMIX_HOSTED", None)
    script = """
import sys
import ctxmix, ctxmix_dashboard
from ctxmix.service.serve import serve_plan
app = serve_plan()["command"][4]
assert app == str(ctxmix_dashboard.APP), app
print(ctxmix.__file__, app)
from streamlit.testing.v1 import AppTest
at = AppTest.from_file(app, default_timeout=600)
at.query_params["method"] = ["norm"]
at.run()
assert not at.exception, at.exception
assert at.get("plotly_chart"), "no figure on the Explain page"
for page in ("pages/3_Benchmarks.py", "pages/4_Saved_explanation.py"):
    at.switch_page(page).run()
    assert not at.exception, (page, at.exception)
print("ok")
"""
    r = subprocess.run(
        [sys.executable, "-c", script], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=900
    )
    assert r.returncode == 0 and r.stdout.rstrip().endswith("ok"), r.stdout + r.stderr
    where, app = r.stdout.split()[:2]
    assert where.startswith(str(site)) and app == str(site / "ctxmix_dashboard" / "toplevel" / "app.py"), r.stdout
    # and `ctxmix serve` itself, started there, answers on localhost
    import socket
    import time
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = open(tmp_path / "serve.log", "w+b")  # noqa: SIM115 - a file, not a pipe nobody reads
    proc = subprocess.Popen(
        [sys.executable, "-m", "ctxmix", "serve", "--port", str(port)], cwd=elsewhere, env=env, stdout=log, stderr=log
    )
    try:
        for _ in range(120):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2) as page:
                    assert page.status == 200 and b"<html" in page.read().lower()
                    break
            except OSError:
                time.sleep(0.5)
        else:
            log.seek(0)
            pytest.fail("ctxmix serve did not answer:\n" + log.read().decode(errors="replace")[-2000:])
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def test_context_attribution_lives_in_one_subpackage_per_stage():
    """Context attribution's modules sit in methods/context, export/context and benchmark/context, named
    without a `context_` prefix, not spread over the stages' top levels."""
    for stage in ("methods", "export", "benchmark"):
        assert (PKG / stage / "context" / "__init__.py").is_file(), stage
    prefixed = [p.relative_to(ROOT).as_posix() for p in PKG.rglob("context_*.py")]
    prefixed += [p.relative_to(ROOT).as_posix() for p in (ROOT / "ctxmix_dashboard").rglob("context_*.py")]
    assert prefixed == [], prefixed
    assert not (PKG / "methods" / "sources.py").exists() and not (PKG / "export" / "cite.py").exists()
