"""lemon.study.walkthrough (notebook 02's one-step walk-through), fast: the real trainer parts (grammar sampling,
SpecScorer, edits, span map, rollout_advantages) on the random tiny policy with the real tokenizer, and a deterministic
fake worker pool (llama-servers would be too slow here; notebook 02 runs them in tests/test_notebooks.py)."""
import html
from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")

from lemon.prompts import CAPACITIES, default_prompts  # noqa: E402
from lemon.run.workers import FakeBackend, WorkerPool  # noqa: E402
from lemon.study import walkthrough as wt  # noqa: E402
from lemon.train.cf import forced_mask, rollout_advantages, span_mask, step_advantages  # noqa: E402
from lemon.train.config import train_preset  # noqa: E402
from lemon.train.pipeline import training_examples  # noqa: E402

P = default_prompts()


def _cfg():
    from lemon.policy.model import PolicyConfig, cached_random_policy
    base = train_preset("smoke")
    # the paper reward form: with every answer wrong it still separates specs (cost terms), so advantages are non-zero
    policy = PolicyConfig(model=str(cached_random_policy(0)), backend="transformers", lora_r=4, lora_alpha=8)
    return train_preset("smoke", policy=policy, num_generations=3, batch_size=3, role_chars=6, duty_chars=12,
                        reward=replace(base.reward, form="paper"))


def _pool(gold: str):
    """large answers right, small and medium wrong: a capacity edit of a large final agent changes the reward."""
    return WorkerPool({c: FakeBackend(f"Answer: {gold if c == 'large' else '0'}", model=f"fake-{c}")
                       for c in CAPACITIES})


@pytest.fixture(scope="module")
def walk():
    cfg = _cfg()
    pool = _pool(training_examples(cfg)[0].gold)
    w = wt.setup(cfg, P, pool, adapter=None)
    w.sample_table = wt.sample(w)
    w.reward_df = wt.score(w)
    w.cf_df = wt.counterfactuals(w)
    return w


def test_samples_and_scores_are_the_trainers_records(walk):
    G = walk.cfg.num_generations
    assert len(walk.samples) == len(walk.recs) == len(walk.traces) == G == len(walk.sample_table)
    assert walk.example.id in {e.id for e in training_examples(walk.cfg)}  # a TRAIN-pool question
    for s, r, tr in zip(walk.samples, walk.recs, walk.traces):
        assert s.finished and r.valid and r.text == s.text and r.ids == s.token_ids  # the grammar keeps specs valid
        assert r.forced_positions == tuple(t for t, f in enumerate(s.forced) if f) and r.forced_positions
        assert tr.cache_hits == sum(not a.skipped for a in tr.agents)  # read back through the node cache
        assert tr.nominal_tokens == r.reward.worker_tokens
    df = walk.reward_df
    assert list(df["reward"]) == [r.total for r in walk.recs]
    assert ((df["reward"] - df["recomputed"]).abs() < 1e-12).all()


def test_agent_io_shows_the_messages_the_executor_sent(walk):
    i = wt.pick(walk)
    page = html.unescape(wt.agent_io_html(walk, i, chars=10**6))
    sent = [c.messages for b in {id(b): b for b in walk.pool.backends.values()}.values() for c in b.calls]
    spec, tr = walk.spec(i), walk.traces[i]
    ran = [a for a, t in zip(spec.agents, tr.agents) if not t.skipped]
    assert ran and f"rollout {i}" in page
    for a in ran:  # each agent's rebuilt messages are ones a worker really received, and they are on the page
        user = next(m["content"] for msgs in sent for m in msgs if m["role"] == "user" and a.duty in m["content"])
        assert user in page


def test_counterfactuals_are_the_scorers_and_every_family_is_shown(walk):
    assert [e.family if e else None for e in walk.edits] == [r.family for r in walk.recs]
    assert list(walk.cf_df["status"]) == [r.cf_status for r in walk.recs]
    i = wt.pick(walk)
    r, drawn = walk.recs[i], walk.edits[i]
    fams = wt.family_edits(walk, i)
    assert [c.family for c in fams] == list(walk.cfg.cf_families)
    table = wt.family_table(walk, i, fams)
    assert len(table) == len(fams)
    for c in fams:
        if c.edit is None:
            continue
        assert c.positions and c.diff(r.text).count("\n+") >= 1
        if drawn is not None and c.family == drawn.family and r.cf_status == "ok":
            # the same edit at the same site, executed again: the trainer's delta and S_i
            assert c.edit.site == drawn.site and c.delta == pytest.approx(r.delta) and c.positions == r.span_positions
        assert c.trace.cache_hits >= 0 and c.trace.tokens <= c.trace.nominal_tokens


def test_advantages_are_rollout_advantages_on_the_real_records(walk):
    """The walk-through calls the trainer's function; and that function on these real records equals the assembly the
    trainer did by hand before it (step_advantages, then forced tokens zeroed)."""
    adv = wt.advantages(walk)
    recs, c = walk.recs, walk.cfg
    T = max(len(r.ids) for r in recs)
    cmask = torch.tensor([[1] * len(r.ids) + [0] * (T - len(r.ids)) for r in recs])  # (G, T)
    want, _, _ = rollout_advantages(recs, cmask, lam=c.cf_lambda, scale=c.scale_rewards, std_floor=c.std_floor,
                                    mask_forced=True, cf_baseline=c.cf_baseline)
    assert torch.equal(adv["total"], want)
    by_hand, _, _ = step_advantages([r.total for r in recs], [r.group for r in recs], [r.delta or 0.0 for r in recs],
                                    cmask, span_mask(recs, cmask), lam=c.cf_lambda, scale=c.scale_rewards,
                                    std_floor=c.std_floor)
    assert torch.allclose(adv["total"], by_hand * (1 - forced_mask(recs, cmask)))
    assert torch.allclose(adv["total"], adv["global"] + adv["cf"])
    assert (adv["total"][adv["forced"].bool()] == 0).all() and (adv["cf"][~adv["span"].bool()] == 0).all()
    assert adv["global"].abs().sum() > 0  # the paper form separates the specs
    for i, r in enumerate(recs):  # the CF part is lambda * delta_i on S_i
        if r.span_positions:
            free = [t for t in r.span_positions if t not in set(r.forced_positions)]
            assert torch.allclose(adv["cf"][i, free], torch.full((len(free),), c.cf_lambda * r.delta))
    table = wt.advantage_table(walk, adv)
    assert list(table["|S_i|"]) == [len(r.span_positions) for r in recs]
    assert wt.plot_advantages(adv).axes


def test_shared_prompt_logprobs_match_full_sequences(walk, monkeypatch):
    """completion_logprobs runs the prompt once for the G rollouts; a full forward per rollout (as TRL does) agrees,
    and so does its path for a cache that cannot be repeated (Unsloth's tuples)."""
    from transformers.cache_utils import Cache
    with torch.no_grad():
        lp = wt.completion_logprobs(walk)  # (G, T)
        monkeypatch.delattr(Cache, "batch_repeat_interleave")
        assert torch.allclose(wt.completion_logprobs(walk), lp, atol=1e-4)
        monkeypatch.undo()
        p = walk.tok.apply_chat_template(walk.messages, add_generation_prompt=True, tokenize=True,
                                         return_dict=True)["input_ids"]
        for i, r in enumerate(walk.recs):
            ids = list(r.ids)
            logits = walk.model(input_ids=torch.tensor([list(p) + ids])).logits[0, len(p) - 1:-1].float()
            ref = torch.log_softmax(logits / walk.cfg.temperature, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
            assert torch.allclose(lp[i, :len(ids)], ref, atol=1e-4)
            assert (lp[i, len(ids):] == 0).all()


def test_optimizer_step_moves_lora_only_with_advantage(walk):
    adv = wt.advantages(walk)
    lora = {n: p.detach().clone() for n, p in walk.model.named_parameters() if p.requires_grad}
    frozen = {n: p.detach().clone() for n, p in walk.model.named_parameters() if not p.requires_grad}
    zero = {**adv, "total": torch.zeros_like(adv["total"])}
    info = wt.optimizer_step(walk, zero)
    assert info["loss"] == 0 and info["grad_norm"] == 0
    assert all(torch.equal(p, lora[n]) for n, p in walk.model.named_parameters() if p.requires_grad)
    before = wt.span_logprobs(walk)
    info = wt.optimizer_step(walk, adv)
    assert info["before"] == pytest.approx(before, abs=1e-4, nan_ok=True) and info["grad_norm"] > 0
    assert info["tokens N"] == int(adv["completion"].sum())
    moved = [n for n, p in walk.model.named_parameters() if p.requires_grad and not torch.equal(p, lora[n])]
    assert moved and all(torch.equal(p, frozen[n]) for n, p in walk.model.named_parameters() if not p.requires_grad)
    after = wt.span_logprobs(walk)
    table = wt.span_table(walk, adv, info["before"], after)
    assert list(table.index) == [i for i, r in enumerate(walk.recs) if r.span_positions]
    assert (table["change"] != 0).any()


def test_tokens_html_marks_span_and_forced_and_escapes():
    class Tok:
        def decode(self, ids):
            return {0: "<a>", 1: " b", 2: "\n"}[ids[0]]
    page = wt.tokens_html(Tok(), [0, 1, 2], highlight=[1], forced=[0], title="x & y")
    assert "&lt;a&gt;" in page and "<a>" not in page and "x &amp; y" in page
    spans = page.split("<span ")[1:]
    assert "color:#aaaaaa" in spans[0] and "background:#E69F00" in spans[1] and "&nbsp;b" in spans[1]
    assert "⏎<br>" in spans[2] and "S_i = [1]" in page
