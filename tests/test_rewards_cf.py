"""Reward terms, and the counterfactual per-token advantages checked against slow, obvious references."""
import random

import pytest

from lemon.train.rewards import RewardConfig, compute_reward, graph_cost
from lemon.spec import parse_spec

torch = pytest.importorskip("torch")
from lemon.train.cf import cf_advantages, group_advantages  # noqa: E402
from lemon.train.spanmap import span_token_mask, token_char_offsets  # noqa: E402

ONE = "agents:\n  - {id: a, base_role: solver, role: A, duty: Do it., capacity: small}\n"
FOUR = ("agents:\n  - {id: a, base_role: planner, role: A, duty: x., capacity: small}\n"
        "  - {id: b, base_role: solver, role: B, duty: y., capacity: large, depends_on: [a]}\n"
        "  - {id: c, base_role: critic, role: C, duty: z., capacity: small, depends_on: [a]}\n"
        "  - {id: d, base_role: decider, role: D, duty: w., capacity: medium, depends_on: [a, b]}\n")


def test_reward_terms():
    cfg = RewardConfig(w_success=1, w_tokens=0.2, w_graph=0.1, token_budget=1000)
    one, four = parse_spec(ONE), parse_spec(FOUR)
    r = compute_reward(one, 1.0, 250, cfg)
    assert r.valid and r.success == 1.0 and r.token_efficiency == pytest.approx(0.75)
    assert r.total == pytest.approx(1 + 0.2 * 0.75 - 0.1 * r.graph_cost)
    assert compute_reward(one, 0.0, 5000, cfg).token_efficiency == 0.0  # clipped at 0
    assert graph_cost(four, cfg) > graph_cost(one, cfg) > 0  # c is unreachable: it costs extra
    assert four.unreachable() == ["c"]
    worst = compute_reward(four, 0.0, 10**6, cfg).total
    assert compute_reward(None, 0.0, 0, cfg).total == cfg.r_invalid < worst
    with pytest.raises(ValueError, match="r_invalid"):
        RewardConfig(r_invalid=0.0)
    with pytest.raises(ValueError, match="token_budget"):
        RewardConfig(token_budget=0)


def _naive(adv, cmask, smask, delta, lam):
    B, T = cmask.shape
    out = torch.zeros(B, T)
    for i in range(B):
        for t in range(T):
            if cmask[i, t]:
                out[i, t] = adv[i] + (lam * delta[i] if smask[i, t] else 0.0)
    return out


def test_cf_advantages_match_per_token_loop():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        B, T = random.randint(1, 6), random.randint(1, 12)
        adv, delta = torch.randn(B, generator=g), torch.randn(B, generator=g)
        cmask = (torch.rand(B, T, generator=g) > 0.2).int()
        smask = (torch.rand(B, T, generator=g) > 0.7).int()
        lam = random.choice([0.0, 0.5, 1.0, 2.0])
        assert torch.allclose(cf_advantages(adv, cmask, smask, delta, lam), _naive(adv, cmask, smask, delta, lam))
    with pytest.raises(ValueError, match="shape mismatch"):
        cf_advantages(torch.zeros(2), torch.ones(2, 3), torch.ones(3, 3), torch.zeros(2), 1.0)


def test_lambda_zero_is_plain_grpo():
    adv, cmask = torch.tensor([1.0, -1.0]), torch.ones(2, 4)
    out = cf_advantages(adv, cmask, torch.ones(2, 4), torch.tensor([5.0, -3.0]), 0.0)
    assert torch.equal(out, adv[:, None].expand(2, 4))


def test_gradient_only_on_edited_span_when_group_advantage_is_zero():
    """TRL's GRPO per-token loss is -exp(logp - logp.detach()) * A_{i,t}; with A_i = 0 and delta != 0 the gradient
    w.r.t. the logits must vanish everywhere except at the edited-span tokens."""
    B, T, V = 3, 7, 11
    logits = torch.randn(B, T, V, requires_grad=True)
    ids = torch.randint(0, V, (B, T))
    cmask = torch.ones(B, T)
    cmask[2, 5:] = 0  # padding
    smask = torch.zeros(B, T)
    smask[0, 2:4] = 1
    smask[1, 6] = 1
    rewards = torch.tensor([1.0, 1.0, 1.0])  # one group, all equal -> A_i = 0
    adv = group_advantages(rewards, group_size=3)
    assert torch.all(adv == 0)
    A = cf_advantages(adv, cmask, smask, torch.tensor([0.7, -0.4, 0.9]), lam=1.0)  # (B, T)
    logp = torch.log_softmax(logits, -1).gather(-1, ids[..., None]).squeeze(-1)  # (B, T)
    loss = (-(torch.exp(logp - logp.detach()) * A) * cmask).sum() / cmask.sum()
    loss.backward()
    nonzero = logits.grad.abs().sum(-1) > 0  # (B, T)
    assert torch.equal(nonzero, smask.bool() & cmask.bool())  # row 2 has delta != 0 but no span: no gradient


def test_group_advantages():
    a = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0]), group_size=4)
    assert a[:4].sum().abs() < 1e-6 and a[0] > 0 and torch.all(a[4:] == 0)
    with pytest.raises(ValueError, match="multiple"):
        group_advantages(torch.zeros(5), 4)


class _ByteTok:
    """A byte-level toy tokenizer: tokens are 1-3 UTF-8 bytes, so a multi-byte character can be split across tokens."""

    def __init__(self, text, rng):
        b = text.encode()
        self.pieces, i = [], 0
        while i < len(b):
            k = rng.randint(1, 3)
            self.pieces.append(b[i:i + k])
            i += k

    def decode(self, ids):
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


def test_span_mapping_equals_re_decoding():
    rng = random.Random(0)
    text = parse_spec(FOUR).text + "# ünïcödé – 数学\n"
    s = parse_spec(text)
    for trial in range(30):
        tok = _ByteTok(text, rng)
        ids = list(range(len(tok.pieces)))
        offs = token_char_offsets(ids, tok.decode)
        assert offs[-1][1] == len(text)
        for sp in s.spans:
            for span in (sp.role, sp.duty, sp.capacity, *sp.deps):
                mask = span_token_mask(offs, [span])
                sel = [i for i, m in enumerate(mask) if m]
                # the selected tokens are contiguous and, re-decoded, cover the span's text and little else
                assert sel == list(range(sel[0], sel[-1] + 1))
                covered = tok.decode(sel)
                assert text[span[0]:span[1]] in covered
                assert len(covered) <= (span[1] - span[0]) + 6
