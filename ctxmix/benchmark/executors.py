"""Executors: the local loop and Ray, with progress, throttling and clean stops."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ctxmix.benchmark.compute import _ray_task, compute_batch
from ctxmix.benchmark.config import ModelSpec, Plan
from ctxmix.benchmark.datasets import Example
from ctxmix.benchmark.store import ResultsStore
from ctxmix.errors import BadInput, CtxmixError


@dataclass
class Group:
    """One example of one (model, dataset): the units still to compute. `batch` numbers the
    engine batch it belongs to (its index in the dataset // example_batch) and `members` are all
    the examples of that batch, finished ones included, so the batch is always traced whole."""

    model: ModelSpec
    dataset: str
    example: Example
    methods: list[str]
    batch: int = 0
    members: list = field(default_factory=list)


def _batches(groups: list[Group]) -> list[list[Group]]:
    """Consecutive groups of one (model, dataset, batch number)."""
    out: list[list[Group]] = []
    for g in groups:
        if out and (out[-1][0].model.label, out[-1][0].dataset, out[-1][0].batch) == (
            g.model.label,
            g.dataset,
            g.batch,
        ):
            out[-1].append(g)
        else:
            out.append([g])
    return out


def _batch_tasks(plan: Plan, gs: list[Group], store: ResultsStore) -> list[dict]:
    """One task per member example of the batch: the unfinished ones with their methods, the
    others with none (they only keep the batch's padding, hence its numbers, the same)."""
    todo = {g.example.id: g for g in gs}
    tasks = []
    for e in gs[0].members:
        g = todo.get(e.id) or Group(model=gs[0].model, dataset=gs[0].dataset, example=e, methods=[], batch=gs[0].batch)
        tasks.append(_task(plan, g, store))
    return tasks


def _commit_batch(plan: Plan, gs: list[Group], tasks: list[dict], results: list, store: ResultsStore, bar) -> None:
    by_id = {g.example.id: g for g in gs}
    for task, res in zip(tasks, results):
        g = by_id.get(task["example"]["id"])
        if g is None:
            continue
        store.commit_result(plan.run_id, g.model, g.dataset, g.example.id, res, g.methods)
        bar.update(len(g.methods))


def _task(plan: Plan, g: Group, store: ResultsStore) -> dict:
    from ctxmix.benchmark.metrics import get_metric

    refs = {get_metric(m).reference for m in plan.metrics if get_metric(m).reference}
    options = dict(plan.options)
    spec = next((d for d in plan.datasets if d.id == g.dataset), None)
    if spec is not None and spec.options.get("min_tokens") is not None:
        options["min_tokens"] = int(spec.options["min_tokens"])  # a dataset's own filter wins
    if spec is not None and spec.options.get("abs_saliency"):
        options["abs_saliency"] = True  # rank by |score| for the deletion metrics (AttCAT's QQP notebook)
    return {
        "kind": plan.kind,
        "model": asdict(g.model),
        "dataset": g.dataset,
        "example": asdict(g.example),
        "methods": g.methods,
        "metrics": plan.metrics,
        "target": plan.target,
        "explain": plan.explain,
        "options": options,
        "seed": plan.options["seed"],
        "references": store.stored_saliency(plan.run_id, g.model.label, g.dataset, g.example.id, refs)
        if g.methods
        else {},
    }


class _Stop:
    """SIGINT/SIGTERM ask the loop to stop after the unit being committed."""

    def __init__(self):
        self.requested = False
        self._old = {}

    def __enter__(self):
        for s in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[s] = signal.signal(s, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def _handle(self, *_):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *a):
        for s, h in self._old.items():
            signal.signal(s, h)


def _throttle() -> None:
    d = float(os.environ.get("CTXMIX_BENCH_THROTTLE", "0") or 0)  # seconds per example; for tests of resuming
    if d > 0:
        time.sleep(d)


def check_label_orders(plan: Plan, groups: list[Group]) -> None:
    """Before any work: every (classifier, dataset) to compute numbers its labels as the model's
    id2label does, where both name them (`ctxmix.benchmark.datasets.check_label_order`). Loads a model
    (in this process, as "all" does) only for a dataset whose examples name their labels."""
    from ctxmix.benchmark.compute import get_model
    from ctxmix.benchmark.datasets import check_label_order, label_names

    if plan.kind != "methods":
        return
    seen: dict[tuple[str, str], list[Example]] = {}
    for g in groups:
        seen.setdefault((g.model.label, g.dataset), []).extend(g.members or [g.example])
    for (label, dataset), examples in seen.items():
        names = label_names(examples)
        if not names:
            continue
        spec = next(m for m in plan.models if m.label == label)
        model = get_model(spec.name, spec.device, spec.dtype)
        if model.kind == "classifier":
            check_label_order(dataset, names, label, getattr(model.config, "id2label", None))


def run_local(plan: Plan, groups: list[Group], store: ResultsStore, bar) -> None:
    check_label_orders(plan, groups)
    with _Stop() as stop:
        for gs in _batches(groups):
            if stop.requested:
                break
            tasks = _batch_tasks(plan, gs, store)
            try:
                results = compute_batch(tasks)
            except (CtxmixError, RuntimeError) as e:  # recorded, not committed: retried by the next run
                results = [{"status": "error", "reason": f"{type(e).__name__}: {e}"} for _ in tasks]
            _throttle()
            _commit_batch(plan, gs, tasks, results, store, bar)
        if stop.requested:
            raise KeyboardInterrupt


def _ray_env() -> dict:
    root = str(Path(__file__).resolve().parents[2])
    env = {
        "PYTHONPATH": os.pathsep.join([root] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])),
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    for k in (
        "CTXMIX_CACHE",
        "HF_HOME",
        "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE",
        "HF_DATASETS_OFFLINE",
    ):
        if os.environ.get(k):
            env[k] = os.environ[k]
    return env


def ray_device(device: str, cluster_gpus: float) -> str:
    """The device a Ray task of a model configured on `device` runs on: "auto" is "cuda" where the
    cluster has GPUs and "cpu" where it has none (Ray hides the GPUs from a task that asks for none, so
    a worker's own "auto" would always find the CPU); any CUDA device is "cuda", the GPU Ray gives the
    worker (it sets CUDA_VISIBLE_DEVICES). CUDA on a cluster without GPUs is refused: Ray would wait
    for one forever."""
    if device == "auto":
        return "cuda" if cluster_gpus > 0 else "cpu"
    if device.startswith("cuda"):
        if cluster_gpus <= 0:
            raise BadInput(f"a model is configured on {device!r} but the Ray cluster has no GPU")
        return "cuda"
    return device


def ray_task_options(device: str, cpus: int, gpus_per_task: float) -> dict:
    """Ray's resources for one task on `device` (`ray_device`'s): `cpus` CPUs (its torch threads), and
    `gpus_per_task` of a GPU on CUDA (a share below 1 puts several tasks, each with its own copy of the
    model, on one GPU); none on a CPU."""
    return {"num_cpus": cpus, **({"num_gpus": gpus_per_task} if device == "cuda" else {})}


def ray_cpus_per_task(plan: Plan) -> int:
    """CPUs (and torch threads) per Ray task: `--threads`/`threads` where given, else 1."""
    return max(1, int(os.environ.get("CTXMIX_WORKER_THREADS") or plan.options.get("threads") or 1))


def run_ray(
    plan: Plan, groups: list[Group], store: ResultsStore, bar, address: str | None = None, num_cpus: int | None = None
) -> None:
    """Each batch of examples is a Ray task: `ray_cpus_per_task` CPUs and, where the cluster has GPUs,
    `gpus_per_task` of one (`ray_task_options`), on the device `ray_device` resolves; at most twice
    the tasks the cluster runs at once in flight; the driver commits."""
    try:
        import ray
    except ImportError:
        raise BadInput("--executor ray needs Ray: pip install ray==2.60.0 (see requirements-dev.txt)") from None
    check_label_orders(plan, groups)
    started = not ray.is_initialized()
    if started:
        kw = dict(include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": _ray_env()})
        if address:
            ray.init(address=address, **kw)
        else:
            ray.init(num_cpus=num_cpus or os.cpu_count() or 1, **kw)
    try:
        cluster = ray.cluster_resources()
        gpus = float(cluster.get("GPU", 0) or 0)
        cpus, share = ray_cpus_per_task(plan), float(plan.options.get("gpus_per_task") or 1)
        devices = {m.label: ray_device(m.device, gpus) for m in plan.models}  # refused before any work
        at_once = float(cluster.get("CPU", 1) or 1) / cpus
        if any(d == "cuda" for d in devices.values()):
            at_once = min(at_once, gpus / share)
        cap = max(1, int(2 * at_once))
        remote = ray.remote(max_retries=1)(_ray_task)
        pending: dict = {}
        todo = _batches(groups)
        with _Stop() as stop:
            while (todo and not stop.requested) or pending:
                while todo and len(pending) < cap and not stop.requested:
                    gs = todo.pop(0)
                    tasks = _batch_tasks(plan, gs, store)
                    device = devices[gs[0].model.label]
                    for t in tasks:
                        t["model"]["device"] = device
                    ref = remote.options(**ray_task_options(device, cpus, share)).remote(tasks, cpus)
                    pending[ref] = (gs, tasks)
                done, _ = ray.wait(list(pending), num_returns=1)
                for ref in done:
                    gs, tasks = pending.pop(ref)
                    try:
                        results = ray.get(ref)
                    except Exception as e:  # noqa: BLE001 - a worker crash is recorded, the run goes on
                        results = [
                            {"status": "error", "reason": f"ray task failed: {type(e).__name__}: {e}"} for _ in tasks
                        ]
                    _commit_batch(plan, gs, tasks, results, store, bar)
            if stop.requested:
                raise KeyboardInterrupt
    finally:
        if started:
            ray.shutdown()
