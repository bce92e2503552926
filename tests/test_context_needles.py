"""The needle check on smollm2 (SmolLM2-135M-Instruct, offline): in 10 fixed needles of
`ctxmix.benchmark.context.data` (200-400-token shipped news texts, a fact sentence inserted at a seeded
boundary), the needle's sentence ranks first for `contextcite` (32 ablations) and for `alti_logit` in at
least 9 of 10.

The examples are `needle_examples(16, 200, 400, seed=0)` counted in smollm2's tokens; the 10 kept are those
whose greedy answer (max_new_tokens=24, measured on 2026-11-24) contains the fact; needles 1, 5, 6, 11, 14
and 15 did not (6 answered "BENCER22" for "bluefern22"). The greedy answers are stored below and passed as
`response=`, so a near-tie in greedy decoding on another CPU does not change what is explained.
Measured then (2 shared CPU cores): the needle ranked first in 10/10 for both methods (logit too; attention
in 1/10); contextcite-32 took 10-13 s and alti_logit 2-8 s per example on an idle machine.
"""

import time

import numpy as np
import pytest

import ctxmix
from ctxmix.benchmark.context.data import NEEDLES, contains_answer, needle_examples

pytestmark = pytest.mark.slow

RESPONSES = {
    0: "The code for the staff entrance is 4817.",
    2: "The harbour festival will be held on 14 March at the Red Lion, a popular venue in Sydney, Australia,",
    3: "The mayor's new car is a bright orange.",
    4: "The lighthouse keeper's dog is called Biscuit.",
    7: "The winning lottery ticket was sold in the town of Merrivale, Queensland, Australia.",
    8: "The school choir's conductor plays the bassoon.",
    9: "The research ship is called the Southern Albatross.",
    10: "The room where the council meeting was moved to is Room 214.",
    12: "The chef's favourite spice is saffron.",
    13: "The missing painting was found in a barn near Ashford, Australia.",
}
METHODS = ("contextcite", "alti_logit")


@pytest.fixture(scope="module")
def smollm2():
    return ctxmix.load_model("smollm2")


def test_the_needle_ranks_first(smollm2):
    tok = smollm2.tokenizer

    def count(text):
        return len(tok(text, add_special_tokens=False)["input_ids"])

    examples = needle_examples(16, 200, 400, seed=0, count_tokens=count)
    first = {m: [] for m in METHODS}
    t0 = time.perf_counter()
    for i, response in RESPONSES.items():
        e = examples[i]
        assert contains_answer(response, e.answer)
        assert 190 <= count(e.context) <= 410  # 200-400, give or take a token merged at a join
        ca = ctxmix.attribute_context(
            smollm2, e.context, e.query, response=response, methods=METHODS, n_ablations=32, progress=False
        )
        assert ca.sources[e.gold[0]] == NEEDLES[i].fact
        for m in METHODS:
            first[m].append(int(np.argmax(ca.scores[m])) == e.gold[0])
    seconds = time.perf_counter() - t0
    for m in METHODS:
        assert sum(first[m]) >= 9, (m, first[m])
    print(f"needles: {seconds:.0f} s; first: { ({m: sum(v) for m, v in first.items()}) }")
