"""One table per model for the context benchmark (docs/context.md, "Shipped results"): every method's mean over
the tasks of LDS, top-k drops and time relative to ContextCite, and the moonshot's verdict (a method within
`MOONSHOT_GAP` of ContextCite-32's mean LDS at no more than `MOONSHOT_TIME` of its time).

Means are over tasks (each task's mean over its examples, as the runner aggregates them), so a task with few
examples weighs as much as one with many, the way the docs have always quoted "mean LDS". A method that ran on
only some tasks (leave_one_out: documents; grad_x_input: not the long task) is summarised over those, its
"tasks" column says how many, and it is no moonshot candidate: the verdict needs every task.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd

REFERENCE = "contextcite"
MOONSHOT_GAP = 0.05  # LDS points behind ContextCite-32's mean
MOONSHOT_TIME = 1 / 8  # of ContextCite-32's time
# column -> (metric in the aggregates, higher is better)
COLUMNS = {
    "lds ↑": ("lds", True),
    "gap to contextcite ↓": (None, False),
    "topk_drop@1 ↑": ("topk_drop@1", True),
    "topk_drop@3 ↑": ("topk_drop@3", True),
    "time_vs_contextcite ↓": ("time_vs_contextcite", False),
}


def _means(agg: pd.DataFrame, metric: str) -> pd.DataFrame:
    """(task x method) task means of one metric; NaN where a method did not run or the metric is absent."""
    t = agg[agg["metric"] == metric]
    return t.pivot_table(index="task", columns="method", values="mean", aggfunc="first")


def summary_table(agg: pd.DataFrame, tasks: list[str] | None = None) -> pd.DataFrame:
    """Method x column table (`COLUMNS`, plus "tasks": how many tasks the method's LDS covers), sorted by LDS.
    agg: the runner's aggregates (task, method, metric, mean, ...); tasks: a subset (default every task).
    "gap to contextcite" is ContextCite's mean LDS minus the method's over the tasks both ran on;
    "time_vs_contextcite" is the mean over tasks of the per-example ratios (NaN where no time was recorded)."""
    if tasks is not None:
        agg = agg[agg["task"].isin(tasks)]
    lds = _means(agg, "lds")
    if lds.empty:
        return pd.DataFrame(columns=[*COLUMNS, "tasks"])
    out = pd.DataFrame(index=pd.Index(lds.columns, name="method"))
    out["lds ↑"] = lds.mean()
    ran = lds.notna()
    if REFERENCE in lds:
        ref = lds[REFERENCE]
        both = ran.mul(ran[REFERENCE], axis=0)
        out["gap to contextcite ↓"] = [ref[both[m]].mean() - lds[m][both[m]].mean() for m in lds.columns]
    else:
        out["gap to contextcite ↓"] = math.nan
    for col, (metric, _) in COLUMNS.items():
        if metric is not None and metric != "lds":
            means = _means(agg, metric)
            out[col] = means.mean().reindex(out.index) if not means.empty else math.nan
    out["tasks"] = ran.sum().astype(int)
    out.columns.name = None
    # a method that ran on every task ContextCite ran on (its LDS defined there) is comparable with it; the others
    # (leave_one_out on documents only) go last, whatever their LDS on their own tasks
    if REFERENCE in lds:
        covers = ran.ge(ran[REFERENCE], axis=0).all() & bool(ran[REFERENCE].any())
    else:
        covers = ran.all()
    out = out.assign(_covers=covers.reindex(out.index).fillna(False).astype(bool))
    out = out.sort_values(["_covers", "lds ↑"], ascending=[False, False], kind="stable")
    comparable = out.pop("_covers")
    out.attrs["comparable"] = {m: bool(v) for m, v in comparable.items()}
    return out


@dataclass(frozen=True)
class Moonshot:
    """The verdict on one summary table: `met` (None where no time was recorded), the best candidate (every task,
    time ratio <= MOONSHOT_TIME) with its gap and time ratio, and the closest method of any cost besides the
    reference (None where none)."""

    met: bool | None
    reference_lds: float
    best: str | None
    gap: float
    time: float
    closest: str | None
    closest_gap: float
    closest_time: float
    tied: tuple[str, ...] = ()  # other cheap methods with the best one's LDS (at2_exact untrained = logit)

    def sentence(self) -> str:
        """One line for a page or the docs."""
        goal = f"within {MOONSHOT_GAP:.2f} of ContextCite-32's mean LDS ({self.reference_lds:.3f}) at ≤ 1/8 of its time"
        if self.met is None and self.closest is None:
            return f"Moonshot ({goal}): not measurable here (no other method ran on every task ContextCite ran on)."
        if self.met is None:
            near = f"; closest: {self.closest}, {self.closest_gap:.3f} behind"
            return f"Moonshot ({goal}): not measurable here (no time recorded){near}."
        best = f"{self.best} (tied with {', '.join(self.tied)})" if self.tied else str(self.best)
        if self.met:
            return f"Moonshot ({goal}): met by {best}, {self.gap:.3f} behind at {self.time:.3f} of the time."
        if self.best is None:
            head = "no method covering every task is that cheap"
        else:
            head = f"the best that cheap is {best}, {self.gap:.3f} behind at {self.time:.3f} of the time"
        tail = ""
        if self.closest is not None and self.closest != self.best:
            tail = f"; closest at any cost: {self.closest}, {self.closest_gap:.3f} behind at {self.closest_time:.3f}"
        return f"Moonshot ({goal}): not met: {head}{tail}."


def _best(rows: pd.DataFrame) -> tuple[str, tuple[str, ...]]:
    """The row with the smallest gap, ties (within float rounding) broken by the smaller time ratio, and the other
    tied methods."""
    gap = rows["gap to contextcite ↓"]
    tied = rows[(gap - gap.min()).abs() <= 1e-12]
    best = tied["time_vs_contextcite ↓"].fillna(math.inf).idxmin()
    return str(best), tuple(str(m) for m in tied.index if m != best)


def moonshot(table: pd.DataFrame) -> Moonshot:
    """The moonshot's verdict on a `summary_table` (the reference must be in it). Candidates: the methods that ran
    on every task ContextCite ran on (`table.attrs["comparable"]`). Met where the best candidate at a time ratio
    <= MOONSHOT_TIME is within MOONSHOT_GAP (compared at 1e-9, so a gap that prints as 0.050 counts)."""
    if REFERENCE not in table.index:
        raise ValueError(f"the summary table has no {REFERENCE} row")
    comparable = table.attrs.get("comparable") or {
        m: t == table.loc[REFERENCE, "tasks"] for m, t in table["tasks"].items()
    }
    keep = [bool(comparable.get(m, False)) and m != REFERENCE for m in table.index]
    others = table[keep]
    others = others[others["gap to contextcite ↓"].notna()]
    time = others["time_vs_contextcite ↓"]
    ref = float(table.loc[REFERENCE, "lds ↑"])
    nan = math.nan
    if others.empty:
        return Moonshot(None, ref, None, nan, nan, None, nan, nan)
    closest, _ = _best(others)
    c_gap, c_time = float(others.loc[closest, "gap to contextcite ↓"]), float(time[closest])
    if time.isna().all():
        return Moonshot(None, ref, None, nan, nan, closest, c_gap, c_time)
    cheap = others[time <= MOONSHOT_TIME]
    if cheap.empty:
        return Moonshot(False, ref, None, nan, nan, closest, c_gap, c_time)
    best, tied = _best(cheap)
    gap, t = float(cheap.loc[best, "gap to contextcite ↓"]), float(time[best])
    return Moonshot(bool(gap <= MOONSHOT_GAP + 1e-9), ref, best, gap, t, closest, c_gap, c_time, tied)


def markdown_table(table: pd.DataFrame, digits: int = 3) -> str:
    """The summary as a Markdown table (methods in backticks, NaN as "-")."""
    cols = list(table.columns)
    lines = ["| method | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for m, row in table.iterrows():
        cells = [str(int(v)) if c == "tasks" else ("-" if pd.isna(v) else f"{v:.{digits}f}") for c, v in row.items()]
        lines.append(f"| `{m}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)
