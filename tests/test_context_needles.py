"""The needle check on smollm2 (SmolLM2-135M-Instruct, offline): in 12 fixed needles of the validation split
of `ctxmix.benchmark.context.data` (200-400-token shipped news texts, a fact sentence written for that split
inserted at a seeded boundary: no sentence of them is in the benchmark's test examples), the needle's sentence
ranks first for `contextcite` (32 ablations) in at least 10 and for `alti_logit` in at least 9.

The examples are `needle_examples(16, 200, 400, seed=0, split="validation")` counted in smollm2's tokens; the 12
kept are those whose greedy answer (max_new_tokens=24, measured on 2026-11-27) contains the fact; needles 3, 4,
8 and 14 did not (14 answered "Peter McGauran" for "Priya Dalton"). The greedy answers are stored below and
passed as `response=`, so a near-tie in greedy decoding on another CPU does not change what is explained.
Measured then (2 shared CPU cores, heavily loaded): the needle ranked first in 11/12 for contextcite and logit
(not needle 5, whose answer runs on to George Harrison), 10/12 for alti_logit (not 5 and 7), 1/12 for
attention; each threshold is one below its measurement. contextcite-32 with alti_logit, logit and attention took
36-164 s per example.
"""

import time

import numpy as np
import pytest

import ctxmix
from ctxmix.benchmark.context.data import VALIDATION_NEEDLES, contains_answer, needle_examples

pytestmark = pytest.mark.slow

RESPONSES = {
    0: "The gate code for the car park is 6392.",
    1: "The hospital's new surgeon is named Ingrid Halvorsen.",
    2: "The kite festival will take place on 22 August at the 22nd-day-of-the-",
    5: "The secret ingredient in the cafe's soup is fennel. The Beatles' former lead guitarist, George Harrison",
    6: 'The guest network password is "redcedar47."',
    7: "The stolen bicycle was found in the village of Thornbury, which is a cricket village in the state of "
    "Maharashtra,",
    9: "The cargo plane is called the Northern Kestrel.",
    10: "The chess tournament was moved to Hall 309, which is a separate venue from the original Hall of Mirrors",
    11: "The town's oldest oak tree is 418 years old.",
    12: "The gardener's favourite flower is the peony.",
    13: "The lost wedding ring was found under a bench near Bexley, in the town of Bexley, in the",
    15: "The new train platform number is 19.",
}
MIN_FIRST = {"contextcite": 10, "alti_logit": 9}  # of the 12: one below what was measured


@pytest.fixture(scope="module")
def smollm2():
    return ctxmix.load_model("smollm2")


def test_the_needle_ranks_first(smollm2):
    tok = smollm2.tokenizer

    def count(text):
        return len(tok(text, add_special_tokens=False)["input_ids"])

    examples = needle_examples(16, 200, 400, seed=0, count_tokens=count, split="validation")
    first = {m: [] for m in MIN_FIRST}
    t0 = time.perf_counter()
    for i, response in RESPONSES.items():
        e = examples[i]
        assert contains_answer(response, e.answer)
        assert 190 <= count(e.context) <= 410  # 200-400, give or take a token merged at a join
        ca = ctxmix.attribute_context(
            smollm2, e.context, e.query, response=response, methods=tuple(MIN_FIRST), n_ablations=32, progress=False
        )
        assert ca.sources[e.gold[0]] == VALIDATION_NEEDLES[i].fact
        for m in MIN_FIRST:
            first[m].append(int(np.argmax(ca.scores[m])) == e.gold[0])
    seconds = time.perf_counter() - t0
    for m, least in MIN_FIRST.items():
        assert sum(first[m]) >= least, (m, first[m])
    print(f"needles: {seconds:.0f} s; first: { ({m: sum(v) for m, v in first.items()}) }")
