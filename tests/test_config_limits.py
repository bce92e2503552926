"""Benchmark configs refuse alias bombs and unbounded text before any work: YAML
anchors and aliases are refused on the parser's events, and `validate_config` bounds every string,
list and mapping of any config, YAML or not, so `bench --check` accepts exactly what a run accepts."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from ctxmix.benchmark import config
from ctxmix.benchmark.config import load_config, validate_config
from ctxmix.errors import BadInput

ROOT = Path(__file__).resolve().parents[1]
PYTHON = ROOT / ".venv/bin/python" if (ROOT / ".venv/bin/python").exists() else Path(sys.executable)
BASE = {"name": "t", "models": ["minilm"], "datasets": ["pang_lee"], "methods": ["alti"], "metrics": []}


def _bomb(tmp: Path) -> Path:
    """Level 1 is 9 strings, level k a list of 9 aliases to level k-1, up to 9: 72 aliases, 9**9 strings once built."""
    levels = ["&a1 [" + ", ".join(['"lol"'] * 9) + "]"]
    levels += [f"&a{k} [" + ", ".join([f"*a{k - 1}"] * 9) + "]" for k in range(2, 10)]
    p = tmp / "bomb.yaml"
    p.write_text(f"name: bomb\nmodels: [minilm]\ndatasets: [pang_lee]\ndescription: [{', '.join(levels)}]\n")
    assert p.read_text().count("*a") == 72
    return p


def _refused(raw, *words) -> str:
    with pytest.raises(BadInput) as e:
        validate_config(raw, check_models=False)
    msg = str(e.value)
    for w in words:
        assert w in msg, msg
    return msg


def test_alias_bomb_is_refused_by_load_config_at_once(tmp_path):
    p = _bomb(tmp_path)
    t = time.perf_counter()
    with pytest.raises(BadInput) as e:
        load_config(p, check_models=False)
    assert time.perf_counter() - t < 1.0
    msg = str(e.value)
    assert "aliases are not accepted" in msg and "line 4" in msg and "write the value out in full" in msg, msg


@pytest.mark.parametrize("check", [True, False], ids=["--check", "run"])
def test_alias_bomb_is_refused_by_bench_check_and_run(tmp_path, check):
    db = tmp_path / "bomb.sqlite"
    argv = [str(PYTHON), "-m", "ctxmix", "bench", "--config", str(_bomb(tmp_path)), "--db", str(db)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    r = subprocess.run(argv + ["--check"] * check, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert "aliases are not accepted" in r.stderr and "line 4" in r.stderr, r.stderr
    assert not db.exists() and not (tmp_path / "results").exists()


@pytest.mark.parametrize(
    "text, line, mark",
    [
        ("name: t\nmodels: &m [minilm]\ndatasets: [pang_lee]\n", 2, "&m"),  # an anchor, never used
        ("name: t\nmodels: [minilm]\ndatasets: [pang_lee]\ndescription: &d hi\npaper: {source: *d}\n", 4, "&d"),
        ("name: t\nmodels: [minilm]\ndatasets: [pang_lee]\npaper: {source: *nowhere}\n", 4, "*nowhere"),
    ],
    ids=["anchor", "anchor and alias", "alias"],
)
def test_any_anchor_or_alias_is_refused_with_its_line(tmp_path, text, line, mark):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    with pytest.raises(BadInput) as e:
        load_config(p, check_models=False)
    msg = str(e.value)
    assert f"line {line}:" in msg and f"found {mark} " in msg and "aliases are not accepted" in msg, msg


def test_deep_yaml_is_refused_before_it_is_built(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("name: t\nmodels: [minilm]\ndatasets: [pang_lee]\ndescription: " + "[" * 30 + "]" * 30 + "\n")
    with pytest.raises(BadInput, match="nested more than 20 levels deep"):
        load_config(p, check_models=False)


@pytest.mark.parametrize(
    "text, words",
    [
        ("name: t\nseed: " + "1" * 5000 + "\n", "integer string conversion"),
        ("name: t\nmodels: [minilm]\ndatasets: [pang_lee]\ndescription: 2020-13-01\n", "month must be in 1..12"),
    ],
    ids=["5000-digit integer", "13th month"],
)
def test_values_yaml_cannot_build_are_bad_input(tmp_path, text, words):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    with pytest.raises(BadInput, match="a value YAML cannot build") as e:
        load_config(p, check_models=False)
    assert words in str(e.value)


def test_description_is_bounded_text():
    validate_config({**BASE, "description": "d" * config.CONFIG_MAX_DESCRIPTION}, check_models=False)
    _refused({**BASE, "description": "d" * 2001}, "description is 2001 characters long; at most 2000")
    _refused({**BASE, "description": ["a", "list"]}, "description must be text (a string), got list")
    _refused({**BASE, "description": {"a": "mapping"}}, "description must be text (a string), got dict")


def test_every_string_is_bounded_wherever_it_is():
    long = "x" * (config.CONFIG_MAX_STRING + 1)
    values = [{"method": "alti", "metric": "aopc", "mean": 0.5, "row": long}]
    _refused({**BASE, "paper": {"source": "s", "values": values}}, "paper.values[0].row is 4097 characters long")
    _refused({**BASE, "paper": {"source": long}}, "paper.source is 4097 characters long; at most 4096")
    _refused({**BASE, "models": [{"name": "minilm", "label": long}]}, "models[0].label is 4097 characters")
    _refused({**BASE, "datasets": [{"id": long, "source": "pang_lee"}]}, "datasets[0].id is 4097 characters")
    _refused({**BASE, "models": [long]}, "models[0] is 4097 characters")
    _refused({**BASE, long: 1}, "(a key) is 4097 characters")
    _refused({**BASE, "name": "n" * 129}, "the config name is 129 bytes long; at most 128")


def test_free_text_fields_must_be_text():
    _refused({**BASE, "models": [{"name": ["minilm"]}]}, "a model's name must be text, got list")
    _refused({**BASE, "models": [{"name": "minilm", "label": {"a": 1}}]}, "label must be text, got dict")
    _refused({**BASE, "datasets": [{"id": ["x"], "source": "pang_lee"}]}, "a dataset's id must be text, got list")
    _refused({**BASE, "paper": {"source": ["x"]}}, "paper.source must be text, got list")
    _refused({**BASE, "paper": {"values": [1, {"mean": "high"}]}}, "paper.values[0] must be a mapping")
    _refused({**BASE, "paper": {"values": [{"mean": "high"}]}}, "paper.values[0].mean must be a number")
    _refused({**BASE, "runs": [{"model": ["minilm"], "dataset": "pang_lee"}]}, "by label and id (text)")
    _refused({**BASE, 1: 2}, "unknown config key(s) 1")


def test_containers_and_whole_configs_are_bounded():
    n = config.CONFIG_MAX_ITEMS + 1
    values = [{"method": "alti", "metric": "aopc", "mean": 0.5}] * n
    _refused({**BASE, "paper": {"values": values}}, f"paper.values has {n} items; a config list or mapping")
    wide = {**BASE, "paper": {"values": [[[0] * 900] * 900]}}
    _refused(wide, f"the config holds more than {config.CONFIG_MAX_VALUES} values")
    deep: list = []
    for _ in range(30):
        deep = [deep]
    _refused({**BASE, "paper": {"values": deep}}, "is nested more than 20 levels deep")


def test_python_structures_that_share_or_contain_themselves_are_refused_fast():
    validate_config(BASE, check_models=False)  # imports done: time the refusal only
    bomb: list = ["lol"] * 9
    for _ in range(9):
        bomb = [bomb] * 9  # 9**9 strings by reference, what the YAML bomb builds
    t = time.perf_counter()
    _refused({**BASE, "description": bomb}, "more than 50000 values")
    assert time.perf_counter() - t < 1.0
    loop: list = []
    loop.append(loop)
    t = time.perf_counter()
    _refused({**BASE, "paper": {"values": [{"row": loop}]}}, "paper.values[0].row[0] contains itself")
    assert time.perf_counter() - t < 1.0


def test_check_and_run_refuse_the_same_config(tmp_path, capsys):
    import ctxmix.cli

    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump({**BASE, "description": "d" * 2500}))
    db = tmp_path / "c.sqlite"
    for extra in (["--check"], []):
        assert ctxmix.cli.main(["bench", "--config", str(p), "--db", str(db), *extra]) == 2
        assert "description is 2500 characters long; at most 2000" in capsys.readouterr().err
    assert not db.exists()


def test_shipped_configs_still_load(tmp_path, monkeypatch):
    monkeypatch.setattr(config, "_check_hub_datasets", lambda specs, errors: None)  # offline here
    monkeypatch.chdir(tmp_path)  # alti-table2 reads data/lgd_dataset.tsv, relative to where it runs
    (tmp_path / "data").mkdir()
    (tmp_path / "data/lgd_dataset.tsv").write_text("1\tthe keys are here\tthe keys ***mask*** here\tare\tis\n")
    paths = sorted((ROOT / "ctxmix/benchmark/configs").glob("*.yaml"))
    assert len(paths) >= 6
    for p in paths:
        if yaml.safe_load(p.read_text()).get("kind") == "context":  # context attribution's own runner
            from ctxmix.benchmark.context.bench import load_context_config

            assert load_context_config(p)["name"] == p.stem
            continue
        plan = load_config(p, check_models=False)
        assert plan.name == p.stem
