"""Print the one-table-per-model summary of every shipped context benchmark (docs/context.md, "Shipped results"),
as Markdown: means over tasks of LDS, the gap to ContextCite-32, top-k drops and the time ratio, then the same over
the long task alone, each with the moonshot's verdict (ctxmix.benchmark.context.summary).

    python bench/context_summary.py                 # every shipped context result
    python bench/context_summary.py context-gemma3  # one
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ctxmix.benchmark import shipped
from ctxmix.benchmark.context.summary import markdown_table, moonshot, summary_table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help="shipped context results (default: all)")
    names = ap.parse_args().names or shipped.shipped_names("context")
    for name in names:
        agg, meta = shipped.load_context_shipped(name)
        print(f"## {name} ({meta.get('model', '?')}, {meta['date'][:10]}, {meta.get('cpu', '')})\n")
        print(meta.get("counts", ""), "\n")
        parts = [("every task", None)] + ([("long task", ["long"])] if "long" in set(agg["task"]) else [])
        for title, tasks in parts:
            table = summary_table(agg, tasks)
            print(f"**{title}**\n\n{markdown_table(table)}\n\n{moonshot(table).sentence()}\n")


if __name__ == "__main__":
    main()
