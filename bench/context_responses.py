"""Generate and store every example's greedy response in a context benchmark config (configs/context.yaml's
`responses:`), so every machine explains the same text. Generation only (no attribution): a few minutes.

    OMP_NUM_THREADS=1 python bench/context_responses.py                       # full sizes and check sizes
    python bench/context_responses.py --config configs/context.yaml --dry-run # print, write nothing
    python bench/context_responses.py --missing   # only examples with no stored response (a task added)

Prints each example's prompt length, sources and response; needles whose response lacks the fact are
marked DROPPED (the run drops them too and counts them per task).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    import torch

    from ctxmix.benchmark.context.bench import generate_responses, load_context_config, store_responses
    from ctxmix.engine.models import load_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "context.yaml"))
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--missing", action="store_true", help="keep the stored responses; generate the others only")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_context_config(args.config)
    model = load_model(cfg["model"])
    from ctxmix.benchmark.shipped import CHECK_LIMIT

    responses = dict(cfg["responses"])
    # the full run's examples, then the check's (--check-sizes --limit CHECK_LIMIT), each stored when done
    for check, limit in ((False, None), (True, CHECK_LIMIT)):
        skip = frozenset(responses) if args.missing else frozenset()
        log = lambda s: print(s, flush=True)  # noqa: E731
        responses.update(generate_responses(cfg, model, check=check, limit=limit, log=log, skip=skip))
        if not args.dry_run:
            store_responses(args.config, responses)
            print(f"stored {len(responses)} responses in {args.config}", flush=True)


if __name__ == "__main__":
    main()
