"""The package's layout keeps its promises: stages without import cycles, a lazy `import ctxmix`,
long modules that say why, and a wheel that carries the command, the dashboard and its data."""

import ast
import os
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
