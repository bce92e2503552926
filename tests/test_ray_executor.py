"""The Ray executor's resources: tasks ask for a GPU share where the cluster has GPUs and run on the
device the executor resolved (Ray hides the GPUs from a task that asks for none, so the worker's own
"auto" always found the CPU), and CPU tasks run as many torch threads as CPUs they hold. On this CPU
a local Ray declares a GPU that does not exist (Ray takes `num_gpus` on trust)."""

from __future__ import annotations

import pytest
from test_runner import cfg, tiny_dir  # noqa: F401 - tiny_dir is a fixture

from ctxmix.benchmark import command as runner
from ctxmix.benchmark import executors
from ctxmix.benchmark.config import load_config
from ctxmix.benchmark.executors import ray_cpus_per_task, ray_device, ray_task_options
from ctxmix.errors import BadInput


def test_the_device_and_resources_of_a_task_follow_the_cluster():
    assert ray_device("auto", 2) == "cuda" and ray_device("auto", 0) == "cpu"
    assert ray_device("cuda:1", 0.5) == "cuda" and ray_device("cpu", 4) == "cpu"
    with pytest.raises(BadInput, match="has no GPU"):
        ray_device("cuda", 0)
    assert ray_task_options("cuda", 1, 0.25) == {"num_cpus": 1, "num_gpus": 0.25}
    assert ray_task_options("cpu", 3, 0.25) == {"num_cpus": 3}


def test_gpus_per_task_and_threads_are_config_options(tmp_path, monkeypatch, tiny_dir):  # noqa: F811
    monkeypatch.delenv("CTXMIX_WORKER_THREADS", raising=False)
    plan = load_config(cfg(tmp_path, tiny_dir["bert"], gpus_per_task=0.5, threads=3))
    assert plan.options["gpus_per_task"] == 0.5 and ray_cpus_per_task(plan) == 3
    base = load_config(cfg(tmp_path, tiny_dir["bert"], name="u"))
    assert base.options["gpus_per_task"] is None and ray_cpus_per_task(base) == 1
    assert plan.config_hash() == load_config(cfg(tmp_path, tiny_dir["bert"], name="v", threads=3)).config_hash()
    monkeypatch.setenv("CTXMIX_WORKER_THREADS", "2")  # what --threads sets
    assert ray_cpus_per_task(base) == 2
    for bad in (0, -1, 1.5, True, "half"):
        with pytest.raises(BadInput, match="gpus_per_task must be"):
            load_config(cfg(tmp_path, tiny_dir["bert"], name="w", gpus_per_task=bad))


def _run_on_cluster(ray, tmp_path, model, monkeypatch, cluster: dict, **config) -> tuple[list, list]:
    """Run a one-batch benchmark on a local Ray started with `cluster`; (the options of each task, the
    results as the driver received them)."""
    asked, got = [], []
    real_options, real_commit = executors.ray_task_options, executors._commit_batch
    monkeypatch.setattr(executors, "ray_task_options", lambda *a: asked.append(real_options(*a)) or asked[-1])
    monkeypatch.setattr(
        executors, "_commit_batch", lambda p, gs, t, res, *a: got.extend(res) or real_commit(p, gs, t, res, *a)
    )
    ray.init(include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": executors._ray_env()}, **cluster)
    try:
        p = cfg(
            tmp_path,
            model,
            methods=["attention"],
            metrics=["aopc"],
            datasets=[{"id": "pl", "source": "pang_lee", "limit": 2}],
            **config,
        )
        runner.run_bench(p, db=tmp_path / "r.sqlite", executor="ray", quiet=True)
    finally:
        ray.shutdown()
    return asked, [r for r in got if r is not None]


@pytest.mark.slow
def test_tasks_ask_for_a_gpu_share_where_the_cluster_has_gpus(tmp_path, monkeypatch, tiny_dir):  # noqa: F811
    ray = pytest.importorskip("ray")
    import torch

    asked, results = _run_on_cluster(
        ray, tmp_path, tiny_dir["bert"], monkeypatch, {"num_cpus": 2, "num_gpus": 1}, gpus_per_task=0.5
    )
    assert asked and all(o == {"num_cpus": 1, "num_gpus": 0.5} for o in asked)
    assert results and all(r["worker"]["resources"] == {"CPU": 1.0, "GPU": 0.5} for r in results)
    for r in results:  # the worker loads the model on the GPU it was given, not on the CPU "auto" found
        if torch.cuda.is_available():
            assert r["device"].startswith("cuda")
        else:  # the GPU is declared, not real: loading on it fails, and says so
            assert r["status"] == "error" and "device 'cuda' was asked for" in r["reason"]


@pytest.mark.slow
def test_a_cpu_cluster_asks_for_no_gpu_and_threads_follow_the_cpu_share(tmp_path, monkeypatch, tiny_dir):  # noqa: F811
    ray = pytest.importorskip("ray")
    monkeypatch.delenv("CTXMIX_WORKER_THREADS", raising=False)
    asked, results = _run_on_cluster(
        ray, tmp_path, tiny_dir["bert"], monkeypatch, {"num_cpus": 2, "num_gpus": 0}, threads=2
    )
    assert asked and all(o == {"num_cpus": 2} for o in asked)
    assert results and all(r.get("status") != "error" for r in results)
    for r in results:
        assert r["device"] == "cpu" and r["worker"] == {"threads": 2, "resources": {"CPU": 2.0}}
