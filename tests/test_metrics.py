"""Metrics on hand-computable cases: a toy classifier whose logits we control, rank correlations,
cue alignment, batching of perturbed inputs, and the metric metadata."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import tiny_model

from ctxmix.benchmark.metrics import (
    METRICS,
    TargetProbability,
    attcat_ks,
    average_precision,
    cue_alignment,
    cue_alignment_layers,
    cue_ap,
    cue_dot,
    cue_probes,
    deletion_metrics,
    deyoung_ks,
    get_metric,
    method_agreement,
    model_agreement,
    normalise_scores,
    perturb,
    protected_positions,
    ranked_positions,
    reference_spearman,
    spearman,
)
from ctxmix.errors import BadInput

CLS, SEP, PAD, A, B, C = 101, 102, 0, 7, 8, 9  # token ids of the toy vocabulary
WEIGHTS = {A: 3.0, B: 1.0, C: 0.0}  # the toy's class-1 logit is the sum of these over the tokens present


def sig(x):
    return 1.0 / (1.0 + math.exp(-x))


class ToyNet(torch.nn.Module):
    """logits = [0, sum_i w(id_i) * mask_i]; p(class 1) = sigmoid(sum of the weights present)."""

    def __init__(self):
        super().__init__()
        w = torch.zeros(200, dtype=torch.float64)
        for t, v in WEIGHTS.items():
            w[t] = v
        self.register_buffer("w", w)
        self.seen = []

    def forward(self, input_ids, attention_mask):
        self.seen.append(input_ids.clone())
        z = (self.w[input_ids] * attention_mask).sum(-1)
        return SimpleNamespace(logits=torch.stack([torch.zeros_like(z), z], -1))


def toy_model():
    tok = SimpleNamespace(
        pad_token_id=PAD,
        unk_token_id=100,
        cls_token_id=CLS,
        sep_token_id=SEP,
        mask_token_id=103,
        all_special_ids=[PAD, 100, CLS, SEP, 103],
    )
    return SimpleNamespace(kind="classifier", device=torch.device("cpu"), tokenizer=tok, hf=ToyNet(), name="toy")


IDS = [CLS, A, B, C, SEP]
PERFECT = np.array([9.0, 3.0, 1.0, 0.0, 9.0])  # specials scored highest: they must still never be deleted
REVERSED = np.array([9.0, 0.0, 1.0, 3.0, 9.0])


def run_deletion(sal, metrics):
    m = toy_model()
    predict = TargetProbability(m, 1, batch_size=4)
    out, p0 = deletion_metrics(
        predict, IDS, {"s": sal}, metrics, protected=protected_positions(m, IDS, 0), position=0, pad_id=PAD
    )
    return out["s"], p0, m.hf.seen


def test_levels_by_hand():
    # n = 5 tokens, 3 deletable: round(j/9 * 5) = 0,1,1,2,2,3,3,4,4,5 -> 1..5, capped at 3
    assert attcat_ks(5, 3) == [1, 2, 3, 3, 3]
    # n >= 10 always gives nine levels
    assert len(attcat_ks(10, 8)) == 9 and len(attcat_ks(40, 38)) == 9
    # DeYoung bins of 3 tokens: max(1, round(b * 3)) for 1, 5, 10, 20, 50 %
    assert deyoung_ks(3) == [1, 1, 1, 1, 2]
    assert deyoung_ks(100) == [1, 5, 10, 20, 50]


def test_aopc_perfect_and_reversed_ranking_by_hand():
    p0 = sig(4)
    (perfect, q0, seen), (rev, _, _) = run_deletion(PERFECT, ["aopc"]), run_deletion(REVERSED, ["aopc"])
    assert q0 == pytest.approx(p0)
    # perfect: delete A, then A B, then A B C (three times): p = sig(1), sig(0), sig(0) x3
    assert perfect["aopc"] == pytest.approx(np.mean([p0 - sig(1), p0 - 0.5, p0 - 0.5, p0 - 0.5, p0 - 0.5]))
    # reversed: delete C (no change), then C B, then all
    assert rev["aopc"] == pytest.approx(np.mean([0.0, p0 - sig(3), p0 - 0.5, p0 - 0.5, p0 - 0.5]))
    assert perfect["aopc"] > rev["aopc"]
    # special tokens are never deleted, whatever their score
    for batch in seen:
        for row in batch.tolist():
            assert row.count(CLS) == 1


def test_lodds_and_deyoung_by_hand():
    p0 = sig(4)
    perfect, _, _ = run_deletion(PERFECT, ["lodds", "lodds_delete", "comprehensiveness", "sufficiency", "aopc_pad"])
    # [PAD] has weight 0 in the toy, so replacing equals deleting here
    expect_lodds = np.mean([math.log(sig(1) / p0)] + [math.log(0.5 / p0)] * 4)
    assert perfect["lodds"] == pytest.approx(expect_lodds)
    assert perfect["lodds_delete"] == pytest.approx(expect_lodds)
    assert perfect["aopc_pad"] == pytest.approx(np.mean([p0 - sig(1)] + [p0 - 0.5] * 4))
    # DeYoung, k = 1,1,1,1,2: comprehensiveness removes the top k, sufficiency keeps only them
    assert perfect["comprehensiveness"] == pytest.approx(np.mean([p0 - sig(1)] * 4 + [p0 - 0.5]))
    assert perfect["sufficiency"] == pytest.approx(np.mean([p0 - sig(3)] * 4 + [p0 - p0]))
    rev, _, _ = run_deletion(REVERSED, ["comprehensiveness", "sufficiency"])
    assert rev["comprehensiveness"] == pytest.approx(np.mean([0.0] * 4 + [p0 - sig(3)]))
    assert rev["sufficiency"] == pytest.approx(np.mean([p0 - sig(0)] * 4 + [p0 - sig(1)]))
    assert perfect["comprehensiveness"] > rev["comprehensiveness"]
    assert perfect["sufficiency"] < rev["sufficiency"]


def test_identical_perturbations_run_once():
    m = toy_model()
    predict = TargetProbability(m, 1, batch_size=1000)
    deletion_metrics(
        predict,
        IDS,
        {"a": PERFECT, "b": PERFECT.copy()},
        ["aopc", "lodds_delete", "comprehensiveness"],
        protected={0, 4},
        position=0,
        pad_id=PAD,
    )
    # original + deletions of {A}, {A,B}, {A,B,C}: four distinct inputs for two methods and three metrics
    assert sum(len(b) for b in m.hf.seen) == 4


def test_no_deletable_token_gives_nan():
    m = toy_model()
    out, _ = deletion_metrics(
        TargetProbability(m, 1),
        [CLS, SEP],
        {"s": np.ones(2)},
        ["aopc", "comprehensiveness"],
        protected={0, 1},
        pad_id=PAD,
    )
    assert np.isnan(out["s"]["aopc"]) and np.isnan(out["s"]["comprehensiveness"])


def test_perturb_moves_the_explained_position():
    assert perturb([1, 2, 3, 4, 5], [0, 2], "delete", 0, position=3) == ([2, 4, 5], 1)
    assert perturb([1, 2, 3, 4, 5], [0, 2], "pad", 0, position=3) == ([0, 2, 0, 4, 5], 3)
    with pytest.raises(ValueError):
        perturb([1], [0], "mask", 0)


def test_ranking_ties_by_position_nan_last():
    s = np.array([1.0, np.nan, 2.0, 2.0, -1.0])
    assert ranked_positions(s, [0, 1, 2, 3, 4]) == [2, 3, 0, 4, 1]


def test_target_probability_batches_equal_single_calls(tokenizer):
    m = tiny_model("bert", tokenizer)
    texts = ["a", "the keys to the cabinet are here", "nice", "a small dog barked at the old man on the hill"]
    seqs = [m.encode(t)[0] for t in texts]
    one = TargetProbability(m, 1, batch_size=1)
    batched = TargetProbability(m, 1, batch_size=3, max_tokens=10_000)
    a, b = one(seqs), batched(seqs)
    assert one.calls == 4 and batched.calls == 2  # bounded batch size
    np.testing.assert_allclose(a, b, atol=1e-9)
    # the same probability as a plain forward pass
    with torch.no_grad():
        p = torch.softmax(m.hf(input_ids=torch.tensor([seqs[1]])).logits[0].double(), -1)[1].item()
    assert a[1] == pytest.approx(p, abs=1e-12)
    # a token budget splits batches too
    tight = TargetProbability(m, 1, batch_size=100, max_tokens=len(seqs[3]))
    tight(seqs)
    assert tight.calls >= 2


def test_target_probability_masked_lm_position_and_foil(tokenizer):
    m = tiny_model("roberta", tokenizer)
    ids = m.encode("the keys [MASK] here")[0]
    pos = ids.index(tokenizer.mask_token_id)
    with torch.no_grad():
        logits = m.hf(input_ids=torch.tensor([ids])).logits[0, pos].double()
    full = TargetProbability(m, 2024)([ids], [pos])[0]
    two = TargetProbability(m, 2024, foil=2003)([ids], [pos])[0]
    assert full == pytest.approx(torch.softmax(logits, -1)[2024].item(), abs=1e-12)
    assert two == pytest.approx(torch.sigmoid(logits[2024] - logits[2003]).item(), abs=1e-12)
    assert protected_positions(m, ids, pos) >= {0, len(ids) - 1, pos}


def test_encoder_has_no_deletion_metrics(minilm):
    with pytest.raises(BadInput, match="head"):
        TargetProbability(minilm, 0)


def test_spearman_cases():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # d = (0, 0, 1, -1): rho = 1 - 6 * 2 / (4 * 15) = 0.8
    assert spearman([1, 2, 3, 4], [1, 2, 4, 3]) == pytest.approx(0.8)
    assert np.isnan(spearman([1, 1, 1], [1, 2, 3]))
    assert np.isnan(spearman([1, 2], [1, 2, 3]))


def test_reference_spearman_absolute_and_nopos():
    s = np.array([0.1, 0.2, 0.3, 0.4])
    r = np.array([-0.4, 0.1, 0.2, 0.3])
    assert reference_spearman(s, r, get_metric("spearman:x")) == pytest.approx(spearman(s, r))
    assert reference_spearman(s, r, get_metric("spearman:|x|")) == pytest.approx(spearman(s, np.abs(r)))
    m = get_metric("spearman:|x|/nopos")
    assert m.reference == "x" and m.reference_abs and m.exclude_position
    assert reference_spearman(s, r, m, position=0) == pytest.approx(1.0)


def test_cue_metrics_by_hand():
    scores = np.array([0.1, 0.5, 0.2, 0.2])
    assert cue_dot(scores, [2]) == pytest.approx(0.2)
    # thresholds 0.5 (no cue: P = 0) and 0.2 (1 cue in 3 tokens: P = 1/3, R = 1)
    assert cue_ap(scores, [2]) == pytest.approx(1 / 3)
    assert cue_probes(scores, [2]) == 1  # only token 1 is strictly above the cue; the tie does not count
    assert cue_ap([0.1, 0.9, 0.5], [1]) == 1.0 and cue_probes([0.1, 0.9, 0.5], [1]) == 0
    # two cues ranked 1st and 3rd: AP = (1/1 + 2/3) / 2
    assert cue_ap([0.9, 0.5, 0.4, 0.1], [0, 2]) == pytest.approx((1 + 2 / 3) / 2)
    # signed scores are compared by magnitude
    assert cue_dot([-3.0, 1.0], [0]) == pytest.approx(0.75)
    np.testing.assert_allclose(normalise_scores([0, 0]), [0.5, 0.5])
    with pytest.raises(BadInput):
        cue_dot([1.0, 2.0], [])


def test_average_precision_matches_sklearn():
    sk = pytest.importorskip("sklearn.metrics")
    rng = np.random.default_rng(0)
    for _ in range(50):
        s = rng.integers(0, 4, size=9).astype(float)  # ties on purpose
        y = rng.random(9) < 0.3
        if not y.any():
            continue
        assert average_precision(s, y) == pytest.approx(sk.average_precision_score(y, s))


def test_cue_alignment_per_layer():
    maps = np.zeros((2, 3, 3))
    maps[0, 1] = [0.6, 0.2, 0.2]  # layer 1: row 1 looks at token 0
    maps[1, 1] = [0.1, 0.1, 0.8]  # layer 2: row 1 looks at token 2 (the cue)
    out = cue_alignment_layers(maps, 1, [2])
    np.testing.assert_allclose(out["cue_dot"], [0.2, 0.8])
    np.testing.assert_allclose(out["cue_probes"], [1, 0])
    assert cue_alignment(maps[1, 1], [2], ["cue_ap"]) == {"cue_ap": 1.0}


def test_agreement_between_methods_and_models():
    sal = {"a": np.array([1.0, 2, 3]), "b": np.array([3.0, 2, 1]), "c": np.array([1.0, 3, 2])}
    M = method_agreement(sal)
    assert M.loc["a", "b"] == pytest.approx(-1.0) and M.loc["b", "a"] == pytest.approx(-1.0)
    assert (np.diag(M) == 1).all()
    assert model_agreement([1, 2, 3], [1, 2, 3], ["x", "y", "z"], ["x", "y", "z"]) == pytest.approx(1.0)
    assert np.isnan(model_agreement([1, 2, 3], [1, 2, 3], ["x", "y", "z"], ["x", "yy", "z"]))


def test_metric_metadata():
    assert METRICS["aopc"].higher_is_better is True and METRICS["lodds"].higher_is_better is False
    assert METRICS["sufficiency"].direction == "lower" and METRICS["comprehensiveness"].arrow == "↑"
    assert METRICS["cue_dot"].per_layer and METRICS["cue_dot"].range == (0.0, 1.0)
    assert METRICS["change"].higher_is_better is None
    for m in METRICS.values():
        assert m.description and m.title and m.range[0] <= m.range[1]
    with pytest.raises(BadInput, match="valid metrics"):
        get_metric("aopcc")
    with pytest.raises(BadInput, match="malformed"):
        get_metric("spearman:")


def test_stop_one_short_and_abs_ranking():
    """AttCAT's code never deletes the last deletable token (i != n - 1) and its QQP notebook ranks
    by |score|: both options change which tokens go, by hand on a 6-token example."""
    from ctxmix.benchmark.metrics import _plan

    ranked = [3, 1, 2, 4]  # 4 deletable tokens of 6
    _, full = _plan("aopc", ranked, 6, 4)
    _, short = _plan("aopc", ranked, 6, 4, stop_one_short=True)
    assert max(len(r) for r in full) == 4 and max(len(r) for r in short) == 3
    assert all(len(r) <= 3 for r in short) and [3, 1, 2] in short
    seen = []

    def predict(seqs, positions):
        seen.extend(tuple(s) for s in seqs)
        return np.linspace(1.0, 0.5, len(seqs))

    ids = [101, 11, 12, 13, 14, 102]
    sal = {"m": np.array([0.0, -5.0, 1.0, 2.0, 0.5, 0.0])}
    deletion_metrics(predict, ids, sal, ["aopc"], protected={0, 5}, abs_saliency=True)
    assert (101, 12, 13, 14, 102) in seen  # |-5| ranks token 1 first
    seen.clear()
    deletion_metrics(predict, ids, sal, ["aopc"], protected={0, 5})
    assert (101, 11, 12, 14, 102) in seen and (101, 12, 13, 14, 102) not in seen  # signed: token 3 first


def test_unknown_words_are_words_not_special_tokens(tokenizer):
    """[UNK] stands for a word: deletion metrics may delete it, IG baselines replace it, masking may
    mask it; [CLS]/[SEP] stay protected, and a [MASK] keeps its question in the IG baseline."""
    from types import SimpleNamespace

    from ctxmix.analyses.corpus import mask_tokens
    from ctxmix.methods.saliency import _baseline_ids

    unk, mask = tokenizer.unk_token_id, tokenizer.mask_token_id
    ids = [101, 2023, unk, mask, 102]
    m = SimpleNamespace(tokenizer=tokenizer, kind="classifier")
    assert protected_positions(m, ids, 0) == {0, 4}
    assert _baseline_ids(SimpleNamespace(tokenizer=tokenizer), ids, "pad") == [101, 0, 0, mask, 102]
    import random

    masked = {
        mask_tokens(SimpleNamespace(tokenizer=tokenizer, name="x"), ids, 0.4, random.Random(s))[2] for s in range(20)
    }
    assert mask in masked  # the [UNK] position can be masked


def test_raw_attention_keeps_or_zeroes_the_explained_token():
    from types import SimpleNamespace

    from ctxmix.benchmark.compute import _derived

    A = np.full((1, 3, 3), 1 / 3)
    ex = SimpleNamespace(layer_maps={"attention": A})
    zero, _ = _derived("raw_attention", ex, 0, 3, 0)
    keep, _ = _derived("raw_attention", ex, 0, 3, 0, keep_self=True)
    assert zero[0] == 0 and keep[0] == pytest.approx(1 / 3) and zero[1] == keep[1]


def test_cue_rr_ranks_signed_scores_as_the_alti_logit_code():
    """Hand-checked: dense ranks ascending -2 < 0.1 < 0.3 < 0.5 (= 1..4), rank = n - dense + 1 with n = 5,
    so the negative cue ranks 5th (a signed method that argues against the cue is not rewarded), and the
    tied top scores rank 2nd (the code's quirk: dense ranks with n, kept for parity)."""
    from ctxmix.benchmark.metrics import METRICS, cue_alignment, cue_rr

    s = [0.1, -2.0, 0.5, 0.5, 0.3]
    assert cue_rr(s, [1]) == pytest.approx(1 / 5)
    assert cue_rr(s, [2]) == pytest.approx(1 / 2)
    assert cue_rr(s, [1, 4]) == pytest.approx(1 / 3)  # the best-ranked cue counts
    assert cue_rr([3.0, 1.0, 2.0], [0]) == 1.0
    assert cue_alignment(s, [4], ["cue_mrr"]) == {"cue_mrr": pytest.approx(1 / 3)}
    assert METRICS["cue_mrr"].higher_is_better is True and METRICS["cue_mrr"].family == "cue"


def test_decompx_mask_counts_are_exact_floors():
    """floor(K m) for K = 0.1..0.9 in integer arithmetic: 0.3 * 10 in floats is 3.0000000000000004,
    0.7 * 10 is 7.000000000000001; both must give 3 and 7, and K m < 1 gives 0 (kept in the mean)."""
    from ctxmix.benchmark.metrics import decompx_mask_counts

    assert decompx_mask_counts(10) == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert decompx_mask_counts(4) == [0, 0, 1, 1, 2, 2, 2, 3, 3]
    assert decompx_mask_counts(1) == [0] * 9


def test_masked_aopc_and_accuracy_by_hand():
    """DecompX's protocol on a 4-token toy: the top floor(K m) tokens become [MASK] in place (length
    and [CLS]/[SEP] kept), AOPC is the plain signed mean of the 9 drops, accuracy the mean of
    argmax == gold over the 9 masked inputs; the least-important variants mask from the bottom."""
    MASK = 103
    w = {11: 2.0, 12: 1.0, 13: 0.5, 14: -0.5}  # class-1 logit: sum over the tokens left

    def predict(seqs, positions, with_class=False):
        z = np.array([sum(w.get(t, 0.0) for t in s) for s in seqs])
        p = 1 / (1 + np.exp(-z))
        return (p, (z > 0).astype(int)) if with_class else p

    ids = [101, 11, 12, 13, 14, 102]
    sal = {"m": np.array([9.0, 4.0, 3.0, 2.0, 1.0, 9.0])}  # ranks 11 > 12 > 13 > 14; specials protected
    out, p0 = deletion_metrics(
        predict,
        ids,
        sal,
        ["aopc_mask", "accuracy_mask", "aopc_mask_least", "accuracy_mask_least"],
        protected={0, 5},
        mask_id=MASK,
        gold=1,
    )
    sg = lambda z: 1 / (1 + math.exp(-z))  # noqa: E731
    # m = 4: counts 0,0,1,1,2,2,2,3,3 -> logits left (most first): 3,3,1,1,0,0,0,-.5,-.5
    most = [3.0, 3.0, 1.0, 1.0, 0.0, 0.0, 0.0, -0.5, -0.5]
    least = [3.0, 3.0, 3.5, 3.5, 3.0, 3.0, 3.0, 2.0, 2.0]  # 14 first, then 13, then 12
    assert p0 == pytest.approx(sg(3.0))
    assert out["m"]["aopc_mask"] == pytest.approx(np.mean([sg(3.0) - sg(z) for z in most]))
    assert out["m"]["accuracy_mask"] == pytest.approx(4 / 9)  # z > 0 at the first four ratios only
    assert out["m"]["aopc_mask_least"] == pytest.approx(np.mean([sg(3.0) - sg(z) for z in least]))
    assert out["m"]["accuracy_mask_least"] == 1.0
    # without a mask token or a gold label the metrics say NaN rather than a number
    nomask, _ = deletion_metrics(predict, ids, sal, ["aopc_mask", "accuracy_mask"], protected={0, 5}, gold=1)
    assert math.isnan(nomask["m"]["aopc_mask"]) and math.isnan(nomask["m"]["accuracy_mask"])
    nogold, _ = deletion_metrics(predict, ids, sal, ["accuracy_mask", "aopc_mask"], protected={0, 5}, mask_id=MASK)
    assert math.isnan(nogold["m"]["accuracy_mask"]) and not math.isnan(nogold["m"]["aopc_mask"])


def test_masked_inputs_keep_their_length_on_a_real_model(tokenizer):
    """The [MASK] metrics overwrite ids in place on a real classifier: every input the model sees has
    the original length and its [CLS]/[SEP], and TargetProbability's classes are the logits' argmax."""
    m = tiny_model("bert", tokenizer)
    ids = tokenizer("the movie was good and long")["input_ids"]
    seen = []
    inner = TargetProbability(m, 1)

    def predict(seqs, positions, with_class=False):
        seen.extend(seqs)
        return inner(seqs, positions, with_class=with_class)

    sal = {"m": np.arange(len(ids), dtype=float)}
    out, _ = deletion_metrics(
        predict,
        ids,
        sal,
        ["aopc_mask", "accuracy_mask"],
        protected=protected_positions(m, ids, None),
        mask_id=tokenizer.mask_token_id,
        gold=0,
    )
    assert all(len(s) == len(ids) and s[0] == ids[0] and s[-1] == ids[-1] for s in seen)
    assert any(tokenizer.mask_token_id in s for s in seen)
    p, cls = inner([ids], [None], with_class=True)
    with torch.no_grad():
        logits = m.hf(input_ids=torch.tensor([ids])).logits[0]
    assert cls[0] == int(logits.argmax()) and 0.0 <= out["m"]["accuracy_mask"] <= 1.0
