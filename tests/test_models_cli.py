"""Model loading errors, cache recovery, and the command line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import transformers as T
from conftest import tiny_model

import ctxmix
from ctxmix.engine.models import _cached_build

ROOT = Path(__file__).resolve().parents[1]


def test_unsupported_architecture_names_the_families(tokenizer):
    hf = T.T5Model(T.T5Config(vocab_size=100, d_model=16, num_layers=1, num_heads=2, d_ff=32, d_kv=8))
    with pytest.raises(ctxmix.UnsupportedArchitecture, match="BERT.*GPT-2.*Llama"):
        ctxmix.model_from_hf(hf, tokenizer)


def test_missing_folder_and_unknown_id():
    with pytest.raises(ctxmix.ModelLoadError, match="no such folder"):
        ctxmix.load_model("./definitely/not/here")
    with pytest.raises(ctxmix.ModelLoadError, match="Embedded models that work offline"):
        ctxmix.load_model("someone/no-such-model-xyz")
    with pytest.raises(ctxmix.BadInput):
        ctxmix.load_model("minilm", dtype="float8")


def test_corrupt_model_cache_is_rebuilt(tmp_path, tokenizer):
    """A cached model whose weights file is damaged is rebuilt, not crashed on."""
    builds = []

    def build(folder: Path):
        builds.append(folder)
        m = tiny_model("bert", tokenizer)
        m.hf.save_pretrained(folder, safe_serialization=True)
        tokenizer.save_pretrained(folder)
        (folder / "ctxmix_meta.json").write_text(json.dumps({"built": len(builds)}))

    CPU, FLOAT32 = ctxmix.engine.placement.resolve_device("cpu"), torch.float32
    folder = tmp_path / "m"
    m1 = _cached_build(folder, build, "tiny", CPU, FLOAT32)
    assert len(builds) == 1 and m1.info["built"] == 1 and "model.safetensors" in m1.info["weights"]
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.warns(UserWarning, match="rebuilding"):
        m2 = _cached_build(folder, build, "tiny", CPU, FLOAT32)
    assert len(builds) == 2 and m2.info["built"] == 2
    # weights altered but still a valid file (same size): the recorded checksum catches it
    from safetensors.torch import load_file, save_file

    sd = load_file(folder / "model.safetensors")
    sd["classifier.weight"] = sd["classifier.weight"] * 2
    save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.warns(UserWarning, match="rebuilding"):
        m3 = _cached_build(folder, build, "tiny", CPU, FLOAT32)
    assert len(builds) == 3 and m3.info["built"] == 3


def _saved(tmp_path, tokenizer, edit=None, tokenizer_files=True):
    """A tiny BERT classifier saved as a folder, its tensors edited by `edit(state_dict)`."""
    from safetensors.torch import load_file, save_file

    m = tiny_model("bert", tokenizer, dtype=torch.float32)
    d = tmp_path / "model"
    m.hf.save_pretrained(d, safe_serialization=True)
    if tokenizer_files:
        tokenizer.save_pretrained(d)
    if edit is not None:
        sd = load_file(d / "model.safetensors")
        edit(sd)
        save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    return str(d)


@pytest.mark.parametrize(
    "case, words",
    [
        ("head missing", "missing from the checkpoint"),
        ("a layer tensor missing", "missing from the checkpoint"),
        ("wrong shape", "wrong shape"),
        ("NaN weights", "non-finite"),
        ("no tokenizer", "tokenizer has"),
    ],
)
def test_broken_model_folders_are_refused(tmp_path, tokenizer, case, words):
    def edit(sd):
        if case == "head missing":
            del sd["classifier.weight"]
        elif case == "a layer tensor missing":
            del sd["bert.encoder.layer.1.output.dense.weight"]
        elif case == "wrong shape":
            sd["classifier.weight"] = torch.zeros(2, 7)
        elif case == "NaN weights":
            sd["bert.encoder.layer.0.attention.self.value.weight"][0, 0] = float("nan")

    path = _saved(tmp_path, tokenizer, None if case == "no tokenizer" else edit, tokenizer_files=case != "no tokenizer")
    with pytest.raises(ctxmix.ModelLoadError, match=words):
        ctxmix.load_model(path, device="cpu")


def test_unexpected_tensors_are_listed_in_a_warning(tmp_path, tokenizer):
    path = _saved(tmp_path, tokenizer, lambda sd: sd.__setitem__("cls.predictions.bias", torch.zeros(3)))
    with pytest.warns(UserWarning, match="cls.predictions.bias"):
        m = ctxmix.load_model(path, device="cpu")
    assert m.kind == "classifier"


def test_result_cache_survives_corruption(tmp_path, monkeypatch, tokenizer):
    from ctxmix.service import cache

    monkeypatch.setenv("CTXMIX_RESULTS", str(tmp_path))
    m = tiny_model("bert", tokenizer)
    a = cache.cached_explain(m, "the keys are here", ["alti", "norm"])
    files = sorted((tmp_path / "explain").glob("*.npz"))
    assert len(files) == 2
    for f in files:
        f.write_bytes(b"garbage")
    cache.mem_clear()
    b = cache.cached_explain(m, "the keys are here", ["alti", "norm"])
    np.testing.assert_allclose(a.layer_maps["alti"], b.layer_maps["alti"])
    cache.mem_clear()
    c = cache.cached_explain(m, "the keys are here", ["alti"])  # from disk, rewritten after the corruption
    np.testing.assert_allclose(a.global_maps["alti"], c.global_maps["alti"])


def _cli(*args, timeout=600):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "ctxmix", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_cli_help_lists_verbs():
    r = _cli("--help")
    assert r.returncode == 0
    for verb in ("explain", "scopes", "change", "outliers", "ff-amp", "res2", "methods", "models"):
        assert verb in r.stdout


def test_cli_methods_lists_the_context_methods_in_their_own_section(capsys):
    """`ctxmix methods` lists every token method, then the context-attribution methods (some share a name with a
    token method and mean another thing) with their units and caveats."""
    from ctxmix import METHODS
    from ctxmix.cli import main
    from ctxmix.methods.registry import CONTEXT_METHODS

    main(["methods"])
    out = capsys.readouterr().out
    head, sep, context = out.partition("\ncontext attribution")
    assert sep and all(line.split()[0] in METHODS for line in head.splitlines())
    listed = [line.split()[0] for line in context.splitlines()[1:]]
    assert listed == list(CONTEXT_METHODS)
    (at2_line,) = [line for line in context.splitlines() if line.startswith("at2_exact ")]
    assert "Scores are scale-free" in at2_line and "Caveat: Cost: one forward pass" in at2_line


def test_cli_bad_input_is_a_message():
    r = _cli("explain", "  ", "--model", "minilm")
    assert r.returncode == 2 and "error: the text is empty" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_cli_explain_and_change(tmp_path):
    out = tmp_path / "result.json"
    r = _cli(
        "explain",
        "The keys to the cabinet are on the table .",
        "--model",
        "minilm",
        "--method",
        "alti",
        "--maps",
        "--out",
        str(out),
    )
    assert r.returncode == 0, r.stderr
    d = json.loads(out.read_text())
    assert d["tokens"][0] == "[CLS]" and np.array(d["layer_maps"]["alti"]).shape == (6, 12, 12)
    csv = tmp_path / "change.csv"
    r = _cli("change", "--model", "minilm", "--corpus", "wiki", "--limit", "2", "--out", str(csv))
    assert r.returncode == 0, r.stderr
    df = pd.read_csv(csv)
    assert list(df.columns) == ["layer", "comparison", "change", "std", "n"] and (df.n == 2).all()


def test_malloc_tuning_is_an_explicit_opt_in():
    """Loading a CPU model leaves glibc's malloc settings alone (a notebook or server that imports
    ctxmix keeps its own); the CLI, which owns its process, opts in."""
    import platform

    if not (platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"):
        pytest.skip("glibc only")
    code = (
        "import ctxmix, ctxmix.engine.budget as M; ctxmix.load_model('minilm', device='cpu'); a = M._ALLOCATOR_TUNED; "
        "from ctxmix.cli import main; main(['scopes', 'a b', '--device', 'cpu', '--out', '{out}']); "
        "print(a, M._ALLOCATOR_TUNED)"
    )
    with __import__("tempfile").TemporaryDirectory() as tmp:
        r = subprocess.run(
            [sys.executable, "-c", code.format(out=f"{tmp}/s.npz")],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[-2:] == ["False", "True"]


def test_cli_precision_and_dtype(tmp_path):
    """--precision and --dtype reach the engine (in-process: the CLI's main, as `python -m ctxmix`)."""
    from ctxmix.cli import main

    out32, out16 = tmp_path / "a.npz", tmp_path / "b.npz"
    text = "The keys to the cabinet are on the table ."
    assert main(["scopes", text, "--model", "minilm", "--device", "cpu", "--out", str(out32)]) == 0
    assert (
        main(
            [
                "scopes",
                text,
                "--model",
                "minilm",
                "--device",
                "cpu",
                "--precision",
                "bf16",
                "--dtype",
                "bfloat16",
                "--out",
                str(out16),
            ]
        )
        == 0
    )
    a, b = np.load(out32), np.load(out16)
    d = np.abs(a["AtbFf"] - b["AtbFf"]).max() / np.abs(a["AtbFf"]).max()
    assert 0 < d < 2e-2
    with pytest.raises(SystemExit) as e:
        main(["scopes", text, "--precision", "fp8", "--out", str(out32)])
    assert e.value.code == 2


@pytest.mark.slow
def test_a_commands_output_holds_its_own_words_only():
    """Where torchao is installed (requirements-dev.txt installs it), loading any model imported transformers'
    torchao quantizer, and every command printed torchao's "Failed to load ..." lines, torch's deprecation
    warnings and a weight-loading progress bar before its own output, even for a bad flag whose answer is one line.
    Now a bad count stops at the parser with its own message, and a command's output is its own (its progress
    bar and table)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "default"}
    bad = subprocess.run(
        [sys.executable, "-m", "ctxmix", "change", "--limit", "-3"], capture_output=True, text=True, env=env
    )
    assert bad.returncode == 2 and "argument --limit: must be 0 or more, got -3" in bad.stderr
    assert "Failed to load" not in bad.stderr and "Loading weights" not in bad.stderr
    ok = subprocess.run(
        [sys.executable, "-m", "ctxmix", "change", "--model", "minilm", "--corpus", "wiki", "--limit", "1"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert ok.returncode == 0, ok.stderr[-2000:]
    noise = ("Failed to load", "Enum subclass", "Loading weights", "torchao")
    assert not [line for line in ok.stderr.splitlines() if any(w in line for w in noise)], ok.stderr[-2000:]
    assert "comparison" in ok.stdout
