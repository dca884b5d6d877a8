"""The step's (B, T) advantages (lemon.train.cf.step_advantages) against a slow per-token reference, and the properties
the issue asks for: global and CF terms in the same units, a CF weight per token that does not depend on the span's
length, errored rollouts excluded, lambda = 0 = plain GRPO."""
import random
import statistics

import pytest

torch = pytest.importorskip("torch")
from lemon.train.cf import (cf_advantages, group_advantages, note_forced, rollout_advantages,  # noqa: E402
                            step_advantages)


def _reference(rewards, groups, deltas, cmask, smask, lam, scale, floor):
    """Obvious loops: group means over scored rollouts, one divisor, per-token sums."""
    B, T = cmask.shape
    scored = [i for i in range(B) if rewards[i] is not None]
    if scale == "batch":
        vals = [rewards[i] for i in scored]
        s_all = max(statistics.pstdev(vals) if len(vals) >= 2 else 0.0, floor)
    out = torch.zeros(B, T)
    for i in scored:
        mates = [j for j in scored if groups[j] == groups[i]]
        if len(mates) < 2:
            continue
        mean = sum(rewards[j] for j in mates) / len(mates)
        s = {"batch": lambda: s_all, "none": lambda: 1.0,
             "group": lambda: max(statistics.pstdev([rewards[j] for j in mates]), floor)}[scale]()
        for t in range(T):
            if cmask[i, t]:
                out[i, t] = ((rewards[i] - mean) + (lam * deltas[i] if smask[i, t] else 0.0)) / s
    # a rollout alone in its group (its mates errored) still gets its CF term, scaled
    for i in scored:
        mates = [j for j in scored if groups[j] == groups[i]]
        if len(mates) < 2:
            s = {"batch": lambda: s_all, "none": lambda: 1.0, "group": lambda: 1.0}[scale]()
            for t in range(T):
                if cmask[i, t] and smask[i, t]:
                    out[i, t] = lam * deltas[i] / s
    return out


def test_step_advantages_match_per_token_loop():
    rng = random.Random(0)
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        G, Q, T = rng.randint(2, 4), rng.randint(1, 3), rng.randint(1, 9)
        B = G * Q
        rewards = [None if rng.random() < 0.15 else rng.choice([-1.0, 0.0, 0.0, 1.0, round(rng.random(), 3)])
                   for _ in range(B)]
        groups = [i // G for i in range(B)]
        deltas = [rng.choice([0.0, 0.0, 1.0, -1.0, 0.3]) for _ in range(B)]
        cmask = (torch.rand(B, T, generator=g) > 0.2).int()
        smask = (torch.rand(B, T, generator=g) > 0.6).int()
        lam, scale, floor = rng.choice([0.0, 0.5, 1.0]), rng.choice(["batch", "group", "none"]), 0.1
        adv, keep, _ = step_advantages(rewards, groups, deltas, cmask, smask, lam=lam, scale=scale, std_floor=floor)
        ref = _reference(rewards, groups, deltas, cmask, smask, lam, scale, floor)
        assert torch.allclose(adv, ref, atol=1e-5), (rewards, groups, deltas, scale)
        assert keep.tolist() == [r is not None for r in rewards]


def test_rollout_advantages_from_records_match_the_loop_with_forced_tokens_zeroed():
    """The trainer's one call (records -> (B, T) advantages): S_i from span_positions, forced positions from the samples
    via note_forced and zeroed, positions past T ignored; checked against the per-token loop, then masked by hand."""
    from types import SimpleNamespace as NS
    rng = random.Random(1)
    for _ in range(100):
        G, Q, T = rng.randint(2, 4), rng.randint(1, 3), rng.randint(2, 9)
        B = G * Q
        lens = [rng.randint(1, T) for _ in range(B)]
        cmask = torch.tensor([[1] * n + [0] * (T - n) for n in lens])  # (B, T)
        recs = [NS(total=None if rng.random() < 0.15 else round(rng.random(), 3), group=i // G,
                   delta=rng.choice([None, 0.0, 1.0, -0.5]),
                   span_positions=tuple(sorted(rng.sample(range(T + 2), rng.randint(0, 3)))), forced_positions=())
                for i in range(B)]
        samples = [NS(forced=[rng.random() < 0.4 for _ in range(n)]) for n in lens]
        note_forced(recs, samples)
        smask = torch.zeros(B, T, dtype=torch.int64)
        for i, r in enumerate(recs):
            for t in r.span_positions:
                if t < T:
                    smask[i, t] = 1
        lam, scale = rng.choice([0.0, 1.0]), rng.choice(["batch", "group", "none"])
        ref = _reference([r.total for r in recs], [r.group for r in recs], [r.delta or 0.0 for r in recs], cmask, smask,
                         lam, scale, 0.1)
        adv, keep, _ = rollout_advantages(recs, cmask, lam=lam, scale=scale, mask_forced=False)
        assert torch.allclose(adv, ref, atol=1e-5)
        masked, _, _ = rollout_advantages(recs, cmask, lam=lam, scale=scale, mask_forced=True)
        for i, s in enumerate(samples):
            for t in range(T):
                want = 0.0 if t < len(s.forced) and s.forced[t] else float(ref[i, t])
                assert abs(float(masked[i, t]) - want) < 1e-5


def test_same_units_the_cf_term_is_scaled_like_the_global_term():
    """Defect 5: with raw delta next to a std-normalised A_i (the old form), the ratio CF / global changes from group to
    group; with one divisor it does not: scaling every reward AND delta by c leaves all advantages unchanged."""
    groups = [0, 0, 0, 0, 1, 1, 1, 1]
    rewards = [1.0, 0.0, 0.0, 0.0, 0.2, 0.1, 0.1, 0.1]  # group 1 has a tiny spread
    deltas = [1.0, 0, 0, 0, 1.0, 0, 0, 0]
    cmask, smask = torch.ones(8, 3), torch.zeros(8, 3)
    smask[0, 1] = smask[4, 1] = 1
    a1, _, _ = step_advantages(rewards, groups, deltas, cmask, smask, lam=1.0, scale="batch")
    a3, _, _ = step_advantages([3 * r for r in rewards], groups, [3 * d for d in deltas], cmask, smask, lam=1.0,
                               scale="batch")
    assert torch.allclose(a1, a3, atol=1e-6)
    # the same contrast (delta 1) adds the same per-token amount in both groups
    assert (a1[0, 1] - a1[0, 0]).item() == pytest.approx((a1[4, 1] - a1[4, 0]).item())
    # in reward units: per unit of delta the CF term adds exactly what one unit of (r - mean) adds to A, in both groups
    for i, mean in ((0, 0.25), (4, 0.125)):
        per_reward = a1[i, 0].item() / (rewards[i] - mean)
        per_delta = (a1[i, 1] - a1[i, 0]).item() / deltas[i]
        assert per_delta == pytest.approx(per_reward)
    # the old form (group-std A_i next to a raw delta): one unit of delta is worth std_g units of reward, 0.5 in group 0
    # and 0.05 in group 1 — the same success flip counts 10x less, relative to A, where the group happens to be flat
    old = cf_advantages(group_advantages(torch.tensor(rewards), 4), cmask, smask, torch.tensor(deltas), 1.0)
    w = [((old[i, 1] - old[i, 0]) / (old[i, 0] / (rewards[i] - m))).item() for i, m in ((0, 0.25), (4, 0.125))]
    assert w[0] / w[1] == pytest.approx(10.0, rel=0.01)


def test_cf_weight_per_token_does_not_depend_on_span_length():
    """A 1-token capacity and a 20-token duty edit with the same contrast: each span token gets the same advantage, so
    under TRL's token-summed loss the span's gradient is delta/s times the gradient of the span's total log-prob."""
    T = 24
    cmask = torch.ones(4, T)
    smask = torch.zeros(4, T)
    smask[0, 3] = 1  # capacity: 1 token
    smask[1, 2:22] = 1  # duty: 20 tokens
    adv, _, s = step_advantages([0.5, 0.5, 0.5, 0.5], [0, 0, 0, 0], [1.0, 1.0, 0, 0], cmask, smask, lam=1.0,
                               scale="batch")
    assert adv[0, 3].item() == pytest.approx(adv[1, 10].item()) == pytest.approx(1.0 / s)
    logits = torch.randn(4, T, 5, requires_grad=True)
    ids = torch.randint(0, 5, (4, T))
    logp = torch.log_softmax(logits, -1).gather(-1, ids[..., None]).squeeze(-1)  # (B, T)
    loss = -(adv * logp).sum()  # TRL's dapo loss up to its constant token count
    loss.backward(retain_graph=True)
    span_sum = -(1.0 / s) * logp[1, 2:22].sum()  # REINFORCE on the duty as ONE action: delta/s * grad log p(span)
    g_ref, = torch.autograd.grad(span_sum, logits)
    assert torch.allclose(logits.grad[1], g_ref[1], atol=1e-6)


def test_errored_rollouts_are_excluded_and_lambda_zero_is_plain_grpo():
    rewards = [1.0, None, 0.0, 0.0]
    cmask, smask = torch.ones(4, 5), torch.ones(4, 5)
    adv, keep, _ = step_advantages(rewards, [0] * 4, [0.7, 0.9, 0.0, 0.0], cmask, smask, lam=1.0, scale="batch")
    assert keep.tolist() == [True, False, True, True] and torch.all(adv[1] == 0)
    mean = (1.0 + 0.0 + 0.0) / 3  # the errored rollout is not in the baseline
    s = statistics.pstdev([1.0, 0.0, 0.0])
    assert adv[0, 0].item() == pytest.approx((1.0 - mean + 0.7) / s)
    plain, _, _ = step_advantages(rewards, [0] * 4, [0.7, 0.9, 0.0, 0.0], cmask, smask, lam=0.0, scale="batch")
    nodelta, _, _ = step_advantages(rewards, [0] * 4, [0.0] * 4, cmask, smask, lam=1.0, scale="batch")
    assert torch.equal(plain, nodelta)
    flat, _, _ = step_advantages([0.0] * 4, [0] * 4, [1.0, 0, 0, 0], cmask, smask, lam=1.0, scale="batch",
                                 std_floor=0.1)
    assert flat[0, 0].item() == pytest.approx(10.0) and torch.all(flat[1:] == 0)  # floor: 1 / 0.1, not 1 / 1e-4
    with pytest.raises(ValueError, match="scale"):
        step_advantages(rewards, [0] * 4, [0] * 4, cmask, smask, lam=1.0, scale="bogus")


def test_cf_update_size_does_not_depend_on_the_other_question_in_the_batch():
    """Issue 30, defect 1: under "batch" scaling the divisor is the std of the whole step's rewards, so the SAME rollout
    with the SAME contrast got a 2.9x larger CF advantage when the other question of the batch happened to be all-solved
    (in the duel's last cf step one capacity token got 11.8 while every global advantage was <= 0.03). The default
    (raw reward units, "none") gives it the same size whatever else is in the batch; so does its global advantage."""
    cmask, smask = torch.ones(8, 3), torch.zeros(8, 3)
    smask[0, 1] = 1  # question A's rollout 0 carries the edit
    a_rewards, a_deltas = [1.0, 0.0, 1.0, 0.0], [0.5, 0.0, 0.0, 0.0]
    easy = [1.0, 1.0, 1.0, 1.0]  # the other question: all solved (no spread)
    hard = [1.0, 0.0, 0.0, 1.0]  # the other question: mixed
    groups = [0] * 4 + [1] * 4

    def adv(other, scale):
        a, _, _ = step_advantages(a_rewards + other, groups, a_deltas + [0.0] * 4, cmask, smask, lam=1.0, scale=scale)
        return a[0, 1].item(), a[0, 0].item()  # (span token, a token outside the span)

    (cf_e, g_e), (cf_h, g_h) = adv(easy, "none"), adv(hard, "none")
    assert cf_e == pytest.approx(cf_h) and g_e == pytest.approx(g_h)
    assert cf_e - g_e == pytest.approx(0.5)  # lambda * delta in reward units, on the span only
    (cf_e, g_e), (cf_h, g_h) = adv(easy, "batch"), adv(hard, "batch")
    assert (cf_e - g_e) / (cf_h - g_h) > 1.1  # the old default: the other question's difficulty changes the CF weight
    from lemon.train.config import train_preset
    assert all(train_preset(p).scale_rewards == "none" for p in ("smoke", "cpu", "paper"))  # the trainer's default
    default, _, _ = step_advantages(a_rewards + hard, groups, a_deltas + [0.0] * 4, cmask, smask, lam=1.0)
    assert default[0, 1].item() == pytest.approx(adv(hard, "none")[0])


def test_family_baselined_deltas_match_a_leave_one_out_loop():
    """cf_baseline='family' (an extension beyond the paper): delta_i minus the mean delta of the step's OTHER scored
    rollouts of the same family; errored rollouts carry none and serve as no baseline; 'none' is the raw delta."""
    from types import SimpleNamespace as NS

    from lemon.train.cf import baselined_deltas
    rng = random.Random(2)
    for _ in range(200):
        recs = [NS(total=None if rng.random() < 0.15 else rng.random(), delta=rng.choice([None, 0.0, 0.4, -0.2, 1.0]),
                   family=rng.choice([None, "edge", "role", "capacity"])) for _ in range(rng.randint(1, 9))]
        got = baselined_deltas(recs, "family")
        for i, r in enumerate(recs):
            if r.total is None:
                assert got[i] == 0.0
                continue
            d = r.delta or 0.0
            mates = [m.delta for j, m in enumerate(recs) if j != i and m.total is not None and m.delta is not None
                     and r.delta is not None and m.family and m.family == r.family]
            assert abs(got[i] - (d - sum(mates) / len(mates) if mates else d)) < 1e-12
        assert baselined_deltas(recs, "none") == [(r.delta or 0.0) if r.total is not None else 0.0 for r in recs]
    with pytest.raises(ValueError, match="cf_baseline"):
        baselined_deltas([], "mean")
