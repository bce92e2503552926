"""The package's layout keeps its promises: stages without import cycles, a lazy `import ctxmix`,
long modules that say why, and a wheel that carries the command, the dashboard and its data."""

import ast
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


def test_no_streamlit_in_ctxmix():
    for m, p in _modules():
        assert "streamlit" not in {n.split(".")[0] for n in _imports(p)} and "import streamlit" not in p.read_text(), m


@pytest.mark.slow
def test_wheel_carries_the_command_the_dashboard_and_the_data(tmp_path):
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
    names = set(zipfile.ZipFile(wheel).namelist())
    for must in (
        "ctxmix/__init__.py",
        "ctxmix/engine/layer.py",
        "ctxmix/benchmark/configs/embedded.yaml",
        "ctxmix/benchmark/shipped/embedded.aggregates.csv",
        "ctxmix_dashboard/app.py",
        "ctxmix_dashboard/pages/3_Benchmarks.py",
        "ctxmix_dashboard/ui/common.py",
    ):
        assert must in names, must
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "ctxmix = ctxmix.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()
