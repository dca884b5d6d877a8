"""lemon.testbed.walkthrough (the method notebook's functions): the advantages are the trainer's, forced tokens carry
none, the CF part sits on S_i only, the re-drawn edit is the one the scorer applied, and one step moves only the LoRA
weights."""
from types import SimpleNamespace

import pytest
import torch

from lemon.testbed import walkthrough as wt
from lemon.train.spanmap import span_positions


@pytest.fixture(scope="module")
def step0():
    bench = wt.setup("duty", seed=0, group=4, cf_lambda=1.0, learning_rate=2e-2, questions=4)
    batch = wt.sample(bench, wt.step_questions(bench, 0), step=0)
    rewards = wt.score(bench, batch)
    cf = wt.counterfactuals(bench, batch)
    return bench, batch, rewards, cf


def test_scores_and_edits_are_the_scorers(step0):
    bench, batch, rewards, cf = step0
    assert len(batch.samples) == len(batch.recs) == len(rewards) == len(cf) == 4
    assert rewards["reward"].tolist() == [r.total for r in batch.recs]
    assert (rewards["regret"] >= -1e-9).all()
    tok = bench.measure.tok
    for r, e in zip(batch.recs, batch.edits):
        if e is None:
            assert r.cf_status != "ok"
            continue
        # the re-drawn edit maps onto exactly the tokens the scorer put the contrast on
        m = span_positions(list(r.ids), lambda ids: tok.decode(list(ids), skip_special_tokens=True), r.text, e.span)
        assert tuple(m.positions) == r.span_positions and e.family == r.family
    assert cf["reward(y')"].dropna().tolist() == pytest.approx([r.total - r.delta for r in batch.recs
                                                                if r.delta is not None])


def test_advantages_split_and_forced_zero(step0):
    bench, batch, _, _ = step0
    adv = wt.advantages(batch, cf_lambda=1.0)
    B, T = adv["total"].shape
    assert B == 4 and T == max(s.n_tokens for s in batch.samples)
    assert adv["forced"].sum() > 0 and float((adv["total"] * adv["forced"]).abs().max()) == 0.0
    assert float((adv["cf"] * (1 - adv["span"])).abs().max()) == 0.0  # the CF term lives on S_i only
    free = (adv["completion"] * (1 - adv["forced"])).bool()
    table = wt.advantage_table(batch, adv, 1.0)
    for i, r in enumerate(batch.recs):
        mean = sum(x.total for x in batch.recs) / len(batch.recs)
        assert torch.allclose(adv["global"][i][free[i]], torch.tensor(r.total - mean))  # one value on every free token
        live_span = adv["span"][i].bool() & free[i]
        assert torch.allclose(adv["cf"][i][live_span], torch.tensor(float(r.delta or 0.0)))
    assert table["max |A| on forced"].max() == 0.0
    assert wt.plot_advantages(adv).axes


def test_optimizer_step_moves_lora_only(step0):
    bench, batch, _, _ = step0
    adv = wt.advantages(batch, cf_lambda=1.0)
    lora = [p.detach().clone() for p in bench.measure.params]
    frozen = [p.detach().clone() for n, p in bench.measure.model.named_parameters() if "lora_" not in n][:3]
    before = wt.span_logprobs(bench, batch)
    info = wt.optimizer_step(bench, batch, adv)
    after = wt.span_logprobs(bench, batch)
    assert info["tokens"] == int(adv["completion"].sum()) and info["grad_norm"] > 0
    assert any(not torch.equal(a, p) for a, p in zip(lora, bench.measure.params))
    assert all(torch.equal(a, p) for a, p in zip(frozen, [p for n, p in bench.measure.model.named_parameters()
                                                         if "lora_" not in n][:3]))
    tab = wt.span_table(batch, adv, before, after)
    assert list(tab.index) == [i for i, r in enumerate(batch.recs) if r.span_positions]
    assert tab["change"].notna().all()


def test_train_step_row(step0):
    bench = step0[0]
    row = wt.train_step(bench, 1)
    assert set(row) >= {"step", "reward", "regret", "loss", "grad_norm", "deltas"} and row["step"] == 1
    fig = wt.curve([row, {**row, "step": 2}])
    assert len(fig.axes) == 2 and len(wt.curve([]).axes) == 2


def test_step_questions_cover_types_in_turn():
    bench = SimpleNamespace(tcfg=SimpleNamespace(batch_size=8, num_generations=4),
                            measure=SimpleNamespace(examples=list(range(6))))
    assert [wt.step_questions(bench, s) for s in range(4)] == [[0, 1], [2, 3], [4, 5], [0, 1]]


def test_tokens_html_marks_span_and_forced(step0):
    bench, batch, _, _ = step0
    i = wt.pick(batch)
    page = wt.tokens_html(bench, batch, i)
    assert page.count("background:#E69F00") == len(batch.recs[i].span_positions)
    assert page.count("color:#aaaaaa") == len(set(batch.recs[i].forced_positions) - set(batch.recs[i].span_positions))
