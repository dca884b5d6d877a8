"""CF-GRPO: scoring of rollouts and their counterfactuals (fake workers, real tokenizer), the trainer's guards, and a
real smoke training run with the shipped 135M policy and workers: SFT warm start, grammar-constrained CF-GRPO steps,
LoRA weights change, metrics and rollouts logged, resume continues."""
import json
import random
import sys
import time
import types
from pathlib import Path

import pytest

from lemon import benchmarks as B
from lemon.prompts import default_prompts
from lemon.run.executor import ExecutorCaps, NodeCache
from lemon.run.workers import FakeBackend, WorkerPool
from lemon.train.config import sft_preset, train_preset
from lemon.train.edits import EditError, FamilySampler
from lemon.train.rewards import RewardConfig

torch = pytest.importorskip("torch")
pytest.importorskip("trl")
from lemon.train.scoring import SpecScorer  # noqa: E402

P = default_prompts()
SPEC = """agents:
  - id: a1
    base_role: planner
    role: "Planner"
    duty: "List the steps for the apples."
    capacity: medium
    depends_on: []
  - id: a2
    base_role: solver
    role: "Solver"
    duty: "Compute how many apples are left."
    capacity: large
    depends_on: [a1]
final: a2
"""


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer
    from lemon.policy.model import converted_dir
    return AutoTokenizer.from_pretrained(converted_dir("smollm2-135m"))


def _scorer(lam=1.0, families=("edge", "role", "capacity"), reply=None, concurrency=1):
    # the large worker answers right, the others wrong: a capacity edit of the final agent changes success
    def default(capacity):
        return lambda m, p: "Answer: 18" if capacity == "large" else "Answer: 3"
    pool = WorkerPool({c: FakeBackend((reply or default)(c), model=f"fake-{c}", latency_s=0.0)
                       for c in ("small", "medium", "large")})
    ex = B.load("gsm8k", "test")[0]  # gold 18
    return SpecScorer(pool, P, {ex.id: ex}, {"gsm8k": B.get_benchmark("gsm8k")}, reward=RewardConfig(max_agents=4),
                      caps=ExecutorCaps(), cache=NodeCache(), sampler=FamilySampler(), cf_lambda=lam, families=families,
                      max_agents=4, seed=0, concurrency=concurrency), ex


def _decode(tok):
    return lambda ids: tok.decode(list(ids), skip_special_tokens=True)


def test_scorer_terms_edits_and_token_positions(tokenizer):
    ids = tuple(tokenizer(SPEC, add_special_tokens=False)["input_ids"])
    # decoded span -> delta, over steps until both capacity sites were edited (the edit RNG is seeded per step)
    seen = {}
    for step in range(40):
        sc, ex = _scorer(families=("capacity",))
        ok, bad = sc.score([(ex.id, SPEC, ids, 0, 0), (ex.id, "not a spec", (1, 2, 3), 0, 0)])
        assert ok.valid and ok.reward.success == 1.0 and not bad.valid and bad.total == -1.0 and bad.error == "no_yaml"
        sc.add_counterfactuals([ok, bad], step=step, decode=_decode(tokenizer))
        # capacity is the only family allowed; a2 (large) and a1 (medium) are eligible
        assert ok.family == "capacity" and ok.cf_status == "ok" and ok.span_positions and bad.cf_status == "invalid"
        decoded = tokenizer.decode([ids[i] for i in ok.span_positions]).strip()  # span mapping == re-decoding
        assert decoded in ("medium", "large")
        seen.setdefault(decoded, (ok.delta, ok.total))
        row = ok.to_row(1)
        assert (row["family"] == "capacity" and row["reward"] == ok.total
                and row["span_tokens"] == len(ok.span_positions))
        if len(seen) == 2:
            break
    assert seen.keys() == {"medium", "large"}, seen  # both branches below run
    # downgrading the final agent (large -> medium) loses the right answer: the edited spec scores 0 (gated reward), so
    # the contrast is the rollout's whole reward
    assert seen["large"][0] > 0.5 and seen["large"][0] == pytest.approx(seen["large"][1])
    # a1 medium -> small: the large final agent still answers right, same tokens: no contrast
    assert seen["medium"][0] == 0.0


def test_lambda_zero_makes_no_edits(tokenizer):
    sc, ex = _scorer(lam=0.0)
    (r,) = sc.score([(ex.id, SPEC, tuple(tokenizer(SPEC)["input_ids"]), 0, 0)])
    sc.add_counterfactuals([r], step=0, decode=_decode(tokenizer))
    assert r.family is None and r.delta is None and r.span_positions == () and r.cf_status == "off"


def _failing_at(failing: str, message: str):
    """A reply factory for _scorer: workers of capacity `failing` raise `message`, the others answer 3."""
    def reply(capacity):
        def f(m, p):
            if capacity == failing:
                raise RuntimeError(message)
            return "Answer: 3"
        return f
    return reply


def test_errored_execution_is_never_rewarded_nor_a_side_of_a_contrast(tokenizer):
    """Defect 4: a worker error used to leave the rollout valid with the tokens that did run, scoring ABOVE an honest
    wrong answer. Now it has no reward at all (excluded from its group and the loss), and no counterfactual is computed
    against an errored execution on either side."""
    sc, ex = _scorer(reply=_failing_at("large", "HTTP 404: model not found"), families=("capacity",))
    ids = tuple(tokenizer(SPEC)["input_ids"])
    wrong = SPEC.replace("capacity: large", "capacity: small")
    errored, honest = sc.score([(ex.id, SPEC, ids, 0, 0), (ex.id, wrong, tuple(tokenizer(wrong)["input_ids"]), 0, 0)])
    assert errored.errored and errored.total is None and errored.valid and "404" in errored.error
    assert honest.total == 0.0 and not honest.errored
    sc.add_counterfactuals([errored, honest], step=0, decode=_decode(tokenizer))
    assert errored.cf_status == "errored" and errored.delta is None
    # honest's only capacity edit lowers a1 medium -> small; now make the EDITED side error: medium ok, small raises
    sc2, _ = _scorer(reply=_failing_at("small", "context overflow"), families=("capacity",))
    (r,) = sc2.score([(ex.id, SPEC, ids, 0, 0)])
    sc2.add_counterfactuals([r], step=0, decode=_decode(tokenizer))
    assert r.cf_status == "cf_errored" and r.delta is None and r.span_positions == ()
    from lemon.train.cf import step_advantages
    cm = torch.ones(2, 4)
    adv, keep, _ = step_advantages([errored.total, honest.total], [0, 0], [0.0, 0.0], cm, torch.zeros(2, 4), lam=1.0)
    assert keep.tolist() == [False, True] and torch.all(adv == 0)


def test_scoring_is_deterministic_under_concurrency(tokenizer):
    """Same batch, 1 vs 8 executions in flight with jittered worker latency: identical records and sampler state."""
    def reply(capacity):
        def f(m, p):
            time.sleep(random.random() * 0.01)
            return "Answer: 18" if capacity == "large" else "Answer: 3"
        return f
    rng = random.Random(1)
    texts = []
    for _ in range(12):
        caps = [rng.choice(["small", "medium", "large"]) for _ in range(2)]
        texts.append(SPEC.replace("capacity: medium", f"capacity: {caps[0]}").replace("capacity: large",
                                                                                      f"capacity: {caps[1]}"))
    out = []
    for conc in (1, 8):
        sc, ex = _scorer(reply=reply, concurrency=conc)
        rs = sc.score([(ex.id, t, tuple(tokenizer(t)["input_ids"]), i // 4, 0) for i, t in enumerate(texts)])
        sc.add_counterfactuals(rs, step=3, decode=_decode(tokenizer))
        out.append(([(r.total, r.family, r.delta, r.span_positions, r.cf_status) for r in rs], sc.sampler.state_dict()))
    assert out[0] == out[1]


def test_an_edit_that_cannot_be_applied_is_counted_not_raised(tokenizer, monkeypatch):
    import lemon.train.scoring as S
    sc, ex = _scorer()
    (r,) = sc.score([(ex.id, SPEC, tuple(tokenizer(SPEC)["input_ids"]), 0, 0)])

    def boom(*a, **k):
        raise EditError("cannot locate the depends_on key")
    monkeypatch.setattr(S, "sample_edit", boom)
    sc.add_counterfactuals([r], step=0, decode=_decode(tokenizer))
    assert r.cf_status == "edit_error" and r.delta is None


def test_trl_version_guard():
    from lemon.train.grpo import check_trl
    with pytest.raises(ImportError, match="too old"):
        check_trl("0.25.1")
    check_trl("1.16.0")
    check_trl("1.15.0")  # Unsloth's cap (requirements-gpu.txt)


def test_unsloth_trainer_class_subclasses_the_patched_trl_class(monkeypatch):
    """Defect 3: the CUDA path must subclass the GRPOTrainer that trl exports AFTER unsloth is imported (a control-flow
    double stands in for unsloth, which the CPU stack never installs; tests/test_gpu.py runs the real one on CUDA)."""
    import trl
    from lemon.train.grpo import CFGRPOMixin, trainer_class
    real = trl.GRPOTrainer

    class UnslothGRPOTrainer(real):
        pass
    fake = types.ModuleType("unsloth")
    monkeypatch.setitem(sys.modules, "unsloth", fake)
    with pytest.raises(RuntimeError, match="not Unsloth's"):
        trainer_class("unsloth")  # imported, but trl was not patched: refuse rather than train unpatched
    monkeypatch.setattr(trl, "GRPOTrainer", UnslothGRPOTrainer)
    cls = trainer_class("unsloth")
    assert issubclass(cls, UnslothGRPOTrainer) and issubclass(cls, CFGRPOMixin)
    monkeypatch.setattr(trl, "GRPOTrainer", real)
    assert issubclass(trainer_class("transformers"), real)


def test_a_pool_the_trainer_started_is_closed_when_the_policy_fails_to_load(tmp_path, monkeypatch):
    """Defect 11: the worker pool leaked when policy loading raised."""
    import lemon.train.pipeline as PL
    closed = []

    class Pool(WorkerPool):
        def close(self):
            closed.append(True)
    pool = Pool({c: FakeBackend("Answer: 1") for c in ("small", "medium", "large")})
    monkeypatch.setattr(PL, "build_pool", lambda cfg: pool)

    def fail(*a, **k):
        raise OSError("no such model")
    monkeypatch.setattr(PL, "load_policy", fail)
    with pytest.raises(OSError, match="no such model"):
        PL.train(train_preset("smoke"), tmp_path / "run", P, progress=False)
    assert closed == [True]


def _lora_state(path):
    from safetensors.torch import load_file
    return load_file(str(Path(path) / "adapter_model.safetensors"))


def test_restart_drops_rows_of_steps_after_the_checkpoint(tmp_path):
    # a run killed before its first checkpoint restarts at step 1: its step-1 rows must not stay next to the new ones
    from lemon.train.pipeline import _truncate_rows
    path = tmp_path / "rollouts.jsonl"
    path.write_text("".join(json.dumps({"step": s, "i": i}) + "\n" for s in (1, 2, 3) for i in range(2)))
    _truncate_rows(path, 2)
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 1, 2, 2]
    _truncate_rows(path, 0)  # no checkpoint: everything is redone
    assert path.read_text() == ""
    _truncate_rows(tmp_path / "missing.jsonl", 0)  # nothing written yet: nothing to do
    assert not (tmp_path / "missing.jsonl").exists()


def _smoke_configs():
    """The smoke presets shrunk to what test_real_smoke_training_run_and_resume proves (issue 28; the smoke study keeps
    the presets as they are): an SFT corpus of ONE row trained twice (batch 1, 2 epochs: 2 steps on the same row, so its
    loss must drop), no valid-rate probe (a greedy decode of up to 286 tokens per probe question before and after SFT: 2
    of the 20 min the presets took under load), a 2-step run killed after its step-1 checkpoint then resumed, no dynamic
    resampling (a flat group would double the sampling), and the "paper" reward form: with the 135M workers every answer
    is wrong, so the gated form gives every rollout 0 (no spread, no contrast, LoRA weights that never move and a
    moved/changed check that passes vacuously); the paper form keeps the token-efficiency and graph-cost terms of wrong
    answers, so two different specs, or a spec and its edit, differ."""
    from dataclasses import replace
    base = train_preset("smoke")
    cfg = train_preset("smoke", max_steps=2, save_steps=1, resample=0, reward=replace(base.reward, form="paper"))
    sft = sft_preset("smoke", questions=1, candidates_per_question=1, keep_per_question=1, batch_size=1, epochs=2.0,
                     probe_questions=0)
    return cfg, sft


class _Killed(Exception):
    pass


@pytest.mark.slow
@pytest.mark.timeout(600)  # SFT warm start + 2 CF-GRPO steps, killed and resumed between them: <= 3 min on 2 idle cores
def test_real_smoke_training_run_and_resume(tmp_path, monkeypatch):
    from lemon.train.grpo import CFStateCallback
    from lemon.train.pipeline import build_pool, train, warm_start
    cfg, sft_cfg = _smoke_configs()
    sft = warm_start(cfg, sft_cfg, tmp_path / "sft", P, progress=False)  # the real stage 1: corpus, LoRA SFT, adapter
    assert sft["rows"] == 1 and sft["steps"] == 2 and sft["loss"][-1] < sft["loss"][0], sft["loss"]
    save = CFStateCallback.on_save

    def save_then_die(self, args, state, control, **kw):  # the process dies right after checkpoint-1 is written
        save(self, args, state, control, **kw)
        if state.global_step == 1:
            raise _Killed
    monkeypatch.setattr(CFStateCallback, "on_save", save_then_die)
    pool = build_pool(cfg)  # real llama-server workers (the 135M everywhere), shared by the run and its resume
    try:
        with pytest.raises(_Killed):
            train(cfg, tmp_path / "run", P, pool=pool, init_adapter=sft["adapter"], progress=False)
        ck1 = tmp_path / "run" / "grpo" / "checkpoint-1"
        assert (ck1 / "cf_state.json").exists() and not (tmp_path / "run" / "train.json").exists()
        before, after = _lora_state(sft["adapter"]), _lora_state(ck1)
        assert before.keys() == after.keys()
        changed = sum(not torch.equal(before[k], after[k]) for k in before)
        logs = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        steps = [l for l in logs if "reward" in l]
        assert [l["step"] for l in steps] == [1]
        for key in ("reward", "rewards/success/mean", "rewards/token_efficiency/mean", "rewards/graph_cost/mean",
                    "rewards/invalid/mean", "spec/valid_rate", "spec/agents", "tokens/worker_spent", "tokens/cf_spent",
                    "cf/edits", "cf/active", "cf/edit_errors", "cf/dropped", "rollouts/errored",
                    "step/zero_spread_groups", "cf/prob_edge", "cf/prob_role", "cf/prob_capacity", "cache/hits",
                    "cache/hit_rate", "time/step_s", "adv/scale"):
            assert all(key in l for l in steps), key
        # grammar-constrained rollouts: every spec parses
        assert all(l["spec/valid_rate"] == 1.0 for l in steps), [l["spec/valid_rate"] for l in steps]
        rows = [json.loads(l) for l in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
        assert {r["step"] for r in rows} == {1} and all(r["valid"] and not r["errored"] for r in rows)
        assert len(rows) == cfg.batch_size and all(r["kept"] for r in rows)  # resample=0: nothing discarded
        # the step had a non-zero advantage (a reward spread or a CF contrast: the paper form makes one, see
        # _smoke_configs), so the LoRA weights must have moved; with the advantages zeroed in the trainer they do not
        moved = any(l["reward_std"] > 0 or l["cf/active"] > 0 for l in steps)
        assert moved, steps
        assert changed > 0, (changed, steps)
        # resume: the same config again continues from checkpoint-1 instead of starting over
        monkeypatch.setattr(CFStateCallback, "on_save", save)
        res = train(cfg, tmp_path / "run", P, pool=pool, init_adapter=sft["adapter"], progress=False)
    finally:
        pool.close()
    assert res["steps"] == 2
    logs = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in logs if "reward" in l] == [1, 2]  # step 1 is not redone
    rows = [json.loads(l) for l in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in rows}) == [1, 2] and all(r["valid"] for r in rows)
    assert (tmp_path / "run" / "grpo" / "checkpoint-2" / "cf_state.json").exists()
    # step 2 starts from checkpoint-1's weights: they move exactly when step 2 had a non-zero advantage
    step2 = [l for l in logs if "reward" in l and l["step"] == 2]
    changed2 = sum(not torch.equal(after[k], v) for k, v in _lora_state(res["adapter"]).items())
    assert (changed2 > 0) == any(l["reward_std"] > 0 or l["cf/active"] > 0 for l in step2), (changed2, step2)
