"""The context benchmark's per-model summary and the moonshot verdict (ctxmix.benchmark.context.summary), on
hand-made aggregates whose answers are worked out below, and on the shipped results."""

from pathlib import Path

import pandas as pd
import pytest

from ctxmix.benchmark import shipped
from ctxmix.benchmark.context.summary import MOONSHOT_TIME, markdown_table, moonshot, summary_table


def _agg(values: dict) -> pd.DataFrame:
    """{(task, method): {metric: mean}} -> the runner's aggregates' columns."""
    rows = [
        {"task": t, "method": m, "metric": k, "mean": v, "std": 0.0, "n": 3, "nan": 0, "higher_is_better": 1}
        for (t, m), metrics in values.items()
        for k, v in metrics.items()
    ]
    return pd.DataFrame(rows)


def _bench(cheap_lds_b: float, with_time: bool = True) -> pd.DataFrame:
    def m(lds, drop, time):
        out = {"lds": lds, "topk_drop@1": drop, "topk_drop@3": 2 * drop}
        return {**out, "time_vs_contextcite": time} if with_time else out

    return _agg(
        {
            ("a", "contextcite"): m(0.90, 10.0, 1.0),
            ("b", "contextcite"): m(0.80, 20.0, 1.0),
            ("a", "cheap"): m(0.88, 9.0, 0.10),
            ("b", "cheap"): m(cheap_lds_b, 19.0, 0.12),
            ("a", "slow"): m(0.90, 10.0, 0.50),
            ("b", "slow"): m(0.79, 20.0, 0.70),
            ("a", "partial"): m(0.95, 11.0, 0.01),  # one task only: never a candidate
        }
    )


def test_summary_means_over_tasks_and_gap_over_the_tasks_a_method_ran():
    t = summary_table(_bench(0.76))
    assert t.loc["contextcite", "lds ↑"] == pytest.approx(0.85) and t.loc["contextcite", "gap to contextcite ↓"] == 0
    assert t.loc["cheap", "lds ↑"] == pytest.approx(0.82)
    assert t.loc["cheap", "gap to contextcite ↓"] == pytest.approx(0.03)
    assert t.loc["cheap", "time_vs_contextcite ↓"] == pytest.approx(0.11)
    assert t.loc["cheap", "topk_drop@3 ↑"] == pytest.approx(28.0)
    # partial ran on task a only: its gap is against ContextCite's 0.90 there, not the 0.85 over both tasks
    assert t.loc["partial", "gap to contextcite ↓"] == pytest.approx(-0.05) and t.loc["partial", "tasks"] == 1
    # by LDS, the methods that did not run on every task last (partial's 0.95 is on one task only)
    assert list(t.index) == ["contextcite", "slow", "cheap", "partial"]
    assert t.attrs["comparable"] == {"contextcite": True, "slow": True, "cheap": True, "partial": False}


def test_moonshot_met_not_met_and_unmeasured():
    v = moonshot(summary_table(_bench(0.76)))  # cheap: gap 0.03 at 0.11 of the time
    assert v.met is True and v.best == "cheap" and v.gap == pytest.approx(0.03) and v.time <= MOONSHOT_TIME
    assert "met by cheap" in v.sentence()
    v = moonshot(summary_table(_bench(0.70)))  # cheap: gap 0.06, slow closer (0.005) at 0.6 of the time
    assert v.met is False and v.best == "cheap" and v.gap == pytest.approx(0.06)
    assert v.closest == "slow" and v.closest_gap == pytest.approx(0.005) and v.closest_time == pytest.approx(0.6)
    assert "not met" in v.sentence() and "slow" in v.sentence()
    # a tie on LDS goes to the cheaper method (at2_exact untrained = logit, each timed on its own pass)
    tie = _bench(0.70)
    twin = tie[tie.method == "cheap"].assign(method="twin")
    twin.loc[twin.metric == "time_vs_contextcite", "mean"] -= 0.01
    v = moonshot(summary_table(pd.concat([tie, twin])))
    assert v.best == "twin" and v.tied == ("cheap",) and "twin (tied with cheap)" in v.sentence()
    # "within 0.05": a gap that is 0.05 up to float rounding (0.85 - 0.80 = 0.05000000000000004) counts
    edge = _bench(0.70)
    edge.loc[(edge.method == "cheap") & (edge.metric == "lds"), "mean"] = [0.88, 0.72]
    v = moonshot(summary_table(edge))
    assert v.gap > 0.05 and v.gap == pytest.approx(0.05) and v.met is True
    # a method on as many tasks as ContextCite, but other ones, is no candidate; with none left: no verdict
    other = _agg({("a", "contextcite"): {"lds": 0.9, "time_vs_contextcite": 1.0}, ("b", "x"): {"lds": 0.9}})
    v = moonshot(summary_table(other))
    assert v.met is None and v.closest is None and "no other method ran on every task" in v.sentence()
    v = moonshot(summary_table(_bench(0.76, with_time=False)))  # runs before the time columns
    assert v.met is None and "no time recorded" in v.sentence()
    with pytest.raises(ValueError, match="contextcite"):
        moonshot(summary_table(_bench(0.76)).drop(index="contextcite"))


def test_summary_of_a_task_subset():
    t = summary_table(_bench(0.70), tasks=["b"])
    assert set(t.index) == {"contextcite", "cheap", "slow"}  # partial never ran on b
    assert t.loc["cheap", "gap to contextcite ↓"] == pytest.approx(0.10)
    assert moonshot(t).met is False


def test_markdown_table_has_a_row_per_method():
    t = summary_table(_bench(0.76, with_time=False))
    md = markdown_table(t).splitlines()
    assert len(md) == 2 + len(t) and md[-1].startswith("| `partial` |") and md[-1].endswith("| - | 1 |")


@pytest.mark.parametrize("name", shipped.shipped_names("context"))
def test_summary_of_the_shipped_results(name):
    agg, _ = shipped.load_context_shipped(name)
    t = summary_table(agg)
    lds = agg[agg.metric == "lds"]
    ref = lds[lds.method == "contextcite"].groupby("task")["mean"].first()
    assert t.loc["contextcite", "lds ↑"] == pytest.approx(ref.mean(), rel=1e-12)
    assert t.loc["contextcite", "tasks"] == agg.task.nunique()
    v = moonshot(t)
    assert v.reference_lds == t.loc["contextcite", "lds ↑"] and v.best is not None and v.time <= MOONSHOT_TIME
    # the docs' per-model section quotes this table and this verdict as they are computed now
    docs = (Path(__file__).resolve().parents[1] / "docs" / "context.md").read_text()
    assert markdown_table(t) in docs and v.sentence() in docs
