"""Print the one-table-per-model summary of every shipped context benchmark (docs/context.md, "Shipped results"),
as Markdown: means over tasks of LDS, the gap to ContextCite-32, top-k drops and the time ratio, then the same over
the long task alone, each with the moonshot's verdict (ctxmix.benchmark.context.summary).

    python bench/context_summary.py                 # every shipped context result
    python bench/context_summary.py context-gemma3  # one
    python bench/context_summary.py --per-task      # and each task's method x metric table (means)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ctxmix.benchmark import shipped
from ctxmix.benchmark.context.summary import markdown_table, moonshot, summary_table

TASK_METRICS = ["lds", "topk_drop@1", "topk_drop@3", "topk_drop@5", "recall@1", "recall@3", "time_vs_contextcite"]


def task_table(agg, task: str) -> str:
    """One task's methods (by LDS) x TASK_METRICS means, Markdown, with its example count."""
    import pandas as pd

    t = agg[agg["task"] == task]
    metrics = [m for m in TASK_METRICS if m in set(t["metric"])]
    up = dict(zip(t["metric"], t["higher_is_better"]))
    piv = t.pivot(index="method", columns="metric", values="mean")[metrics].sort_values("lds", ascending=False)
    lines = [
        f"**{task}** (n = {int(t['n'].max())})",
        "",
        "| method | " + " | ".join(f"{m} {'↑' if up[m] else '↓'}" for m in metrics) + " |",
        "|---" * (len(metrics) + 1) + "|",
    ]
    for m, r in piv.iterrows():
        lines.append(f"| `{m}` | " + " | ".join("-" if pd.isna(v) else f"{v:.3f}" for v in r.values) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help="shipped context results (default: all)")
    ap.add_argument("--per-task", action="store_true", help="each task's table too")
    args = ap.parse_args()
    names = args.names or shipped.shipped_names("context")
    for name in names:
        agg, meta = shipped.load_context_shipped(name)
        print(f"## {name} ({meta.get('model', '?')}, {meta['date'][:10]}, {meta.get('cpu', '')})\n")
        print(meta.get("counts", ""), "\n")
        parts = [("every task", None)] + ([("long task", ["long"])] if "long" in set(agg["task"]) else [])
        for title, tasks in parts:
            table = summary_table(agg, tasks)
            print(f"**{title}**\n\n{markdown_table(table)}\n\n{moonshot(table).sentence()}\n")
        if args.per_task:
            for task in dict.fromkeys(agg["task"]):
                print(task_table(agg, task) + "\n")


if __name__ == "__main__":
    main()
