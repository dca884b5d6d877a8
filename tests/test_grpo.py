"""CF-GRPO: the rewarder's counterfactual bookkeeping (fake workers, real tokenizer), and a real smoke training run with the
shipped 135M policy and workers: SFT warm start, 2 CF-GRPO steps, LoRA weights change, metrics logged, resume continues."""
import json
from pathlib import Path

import pytest

from lemon import benchmarks as B
from lemon.train.config import sft_preset, train_preset
from lemon.train.edits import FamilySampler
from lemon.run.executor import ExecutorCaps, NodeCache
from lemon.prompts import default_prompts
from lemon.train.rewards import RewardConfig
from lemon.run.workers import FakeBackend, WorkerPool

torch = pytest.importorskip("torch")
pytest.importorskip("trl")
from lemon.train.grpo import SpecRewarder  # noqa: E402

P = default_prompts()
SPEC = """agents:
  - id: plan
    base_role: planner
    role: Planner
    duty: List the steps for the apples.
    capacity: medium
    depends_on: []
  - id: solve
    base_role: solver
    role: Solver
    duty: Compute how many apples are left.
    capacity: large
    depends_on: [plan]
final: solve
"""


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer
    from lemon.train.policy import converted_dir
    return AutoTokenizer.from_pretrained(converted_dir("smollm2-135m"))


def _rewarder(tok, lam=1.0, families=("edge", "role", "capacity")):
    # the large worker answers right, the others wrong: a capacity edit of the final agent changes success
    def reply(capacity):
        return lambda m, p: "Answer: 18" if capacity == "large" else "Answer: 3"
    pool = WorkerPool({c: FakeBackend(reply(c), model=f"fake-{c}") for c in ("small", "medium", "large")})
    ex = B.load("gsm8k", "test")[0]  # gold 18
    return SpecRewarder(pool, P, {ex.id: ex}, {"gsm8k": B.get_benchmark("gsm8k")}, tok, reward=RewardConfig(),
                        caps=ExecutorCaps(), cache=NodeCache(), sampler=FamilySampler(), cf_lambda=lam,
                        families=families, max_agents=4, seed=0), ex


def test_rewarder_terms_edits_and_token_positions(tokenizer):
    rw, ex = _rewarder(tokenizer, families=("capacity",))
    ids = tokenizer(SPEC, add_special_tokens=False)["input_ids"]
    comps = [[{"role": "assistant", "content": SPEC}], [{"role": "assistant", "content": "not a spec"}]]
    funcs, weights = rw.functions()
    kw = dict(example_id=[ex.id, ex.id], completion_ids=[ids, [1, 2, 3]])
    vals = [f(comps, **kw) for f in funcs]
    assert len(rw.batch) == 2
    ok, bad = rw.batch
    assert ok.valid and ok.reward.success == 1.0 and not bad.valid and bad.reward.total == -1.0
    total = [sum(w * v[i] for w, v in zip(weights, vals)) for i in range(2)]
    assert total[0] == pytest.approx(ok.reward.total) and total[1] == pytest.approx(-1.0)
    # capacity is the only family allowed; only `solve` (large) and `plan` (medium) are eligible
    assert ok.family == "capacity" and ok.span_positions and bad.family is None
    # span mapping equals re-decoding: the selected sampled tokens decode to the edited capacity value
    decoded = tokenizer.decode([ids[i] for i in ok.span_positions]).strip()
    assert decoded in ("medium", "large")
    if decoded == "large":  # downgrading the final agent loses the right answer: positive contrast
        assert ok.delta > 0.5
    # the four reward functions executed the batch once (cache: each agent computed once per distinct spec)
    assert rw.cache.stats()["misses"] <= 4


def test_rewarder_lambda_zero_makes_no_edits(tokenizer):
    rw, ex = _rewarder(tokenizer, lam=0.0)
    ids = tokenizer(SPEC, add_special_tokens=False)["input_ids"]
    funcs, _ = rw.functions()
    funcs[0]([[{"role": "assistant", "content": SPEC}]], example_id=[ex.id], completion_ids=[ids])
    assert rw.batch[0].family is None and rw.batch[0].delta == 0.0 and rw.batch[0].span_positions == ()


def _lora_state(path):
    from safetensors.torch import load_file
    return load_file(str(Path(path) / "adapter_model.safetensors"))


@pytest.mark.slow
@pytest.mark.timeout(2400)  # SFT warm start + 3 CF-GRPO steps on CPU (~10 min on 2 idle cores)
def test_real_smoke_training_run_and_resume(tmp_path):
    from lemon.train.pipeline import train, warm_start
    cfg = train_preset("smoke")
    sft = warm_start(cfg, sft_preset("smoke"), tmp_path / "sft", P, progress=False)
    assert sft["rows"] > 0 and sft["loss"][-1] < sft["loss"][0]
    res = train(cfg, tmp_path / "run", P, init_adapter=sft["adapter"], progress=False)
    assert res["steps"] == 2
    before, after = _lora_state(sft["adapter"]), _lora_state(res["adapter"])
    assert before.keys() == after.keys()
    changed = sum(not torch.equal(before[k], after[k]) for k in before)
    logs = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [l for l in logs if "reward" in l]
    assert [l["step"] for l in steps] == [1, 2]
    for key in ("reward", "rewards/success/mean", "rewards/token_efficiency/mean", "rewards/graph_cost/mean",
                "rewards/invalid/mean", "spec/valid_rate", "spec/agents", "tokens/worker_spent", "tokens/cf_spent",
                "cf/edits", "cf/active", "cf/prob_edge", "cf/prob_role", "cf/prob_capacity", "cache/hits", "time/step_s", "reward_std"):
        assert all(key in l for l in steps), key
    moved = any(l["reward_std"] > 0 or l["cf/active"] > 0 for l in steps)
    # the LoRA weights move exactly when some advantage was non-zero (a group reward spread or a CF contrast); the 135M
    # policy can write only invalid specs in both steps, and then GRPO has no signal (LOG.md, 2026-11-30)
    assert (changed > 0) == moved, (changed, steps)
    assert (tmp_path / "run" / "grpo" / "checkpoint-2" / "cf_state.json").exists()
    # resume: one more step continues from checkpoint-2 instead of starting over
    res3 = train(train_preset("smoke", max_steps=3), tmp_path / "run", P, init_adapter=sft["adapter"], progress=False)
    assert res3["steps"] == 3
    logs = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in logs if "reward" in l] == [1, 2, 3]
