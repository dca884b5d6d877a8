"""Stratified training batches (lemon.train.episodes.CurriculumSampler with `strata`): every step sees every task type
of its world when it has room for them, and the unstratified curriculum draws exactly as it did before
stratification."""
import random

from lemon.train.episodes import CurriculumSampler, QuestionLabels, _seed

IDS = [f"a/{i}" for i in range(6)] + [f"b/{i}" for i in range(10)]
STRATA = [i.split("/")[0] for i in IDS]


def _blocks(sampler, q, g, repeat=1):
    flat = list(iter(sampler))
    per = q * g * repeat
    return [flat[k:k + per] for k in range(0, len(flat), per)]


def test_every_step_of_two_questions_sees_both_types():
    s = CurriculumSampler(IDS, QuestionLabels(), questions=2, generations=4, repeat=1, seed=3, strata=STRATA)
    for block in _blocks(s, 2, 4):
        assert {STRATA[i] for i in block} == {"a", "b"}
        assert all(block[k] == block[k - k % 4] for k in range(len(block)))  # each question G times in a row


def test_one_question_per_step_alternates_types():
    s = CurriculumSampler(IDS, QuestionLabels(), questions=1, generations=2, repeat=1, seed=0, strata=STRATA,
                          weighted=False)
    types = [STRATA[b[0]] for b in _blocks(s, 1, 2)]
    assert all(x != y for x, y in zip(types, types[1:])), types


def test_without_strata_the_curriculum_draws_as_before():
    labels = QuestionLabels({IDS[0]: {"seen": 1, "spread": True, "success": 0.5},
                             IDS[7]: {"seen": 2, "spread": False, "success": 1.0}})
    got = list(iter(CurriculumSampler(IDS, labels, questions=2, generations=2, repeat=2, seed=5)))
    # the pre-stratification loop, written out
    rng, want = random.Random(_seed("curriculum", 5, 0)), []
    for _ in range(len(IDS) // 2):
        idx, block = list(range(len(IDS))), []
        for _ in range(2):
            j = rng.choices(range(len(idx)), weights=[labels.weight(IDS[i]) for i in idx])[0]
            block.append(idx.pop(j))
        for _ in range(2):
            for i in block:
                want += [i] * 2
    assert got == want


def test_stratified_without_the_curriculum_is_not_weighted():
    labels = QuestionLabels({i: {"seen": 1, "spread": False, "success": 1.0} for i in IDS[:3]})  # weight 0.25 each
    s = CurriculumSampler(IDS, labels, questions=2, generations=1, repeat=1, seed=1, strata=STRATA, weighted=False)
    counts = {i: 0 for i in range(len(IDS))}
    for _ in range(300):
        for i in iter(s):
            counts[i] += 1
    a_counts = [counts[i] for i in range(6)]
    assert min(a_counts[:3]) > 0.6 * max(a_counts[3:])  # a weighted draw would give the first three ~1/4 as often
