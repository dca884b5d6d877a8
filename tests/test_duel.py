"""The real-worker CF vs global comparison's chain of legs (experiments.duel.legs), fast, on fakes: which specs a policy
writes and where, resumption, replaying recorded specs through the eval runner (no adapter), the report of a partial
record (what is missing is listed with its command). The real legs are the measurement itself
(outputs/reference/duel-*)."""
import json
from pathlib import Path

import pytest

from lemon.eval.orchestrator import SpecProposal
from lemon.eval.runner import read_rows
from lemon.prompts import CAPACITIES, default_prompts
from lemon.run.workers import FakeBackend, WorkerPool
from lemon.spec import parse_spec
from experiments.duel import legs as duel
from experiments.duel.report import capacity_share, missing, report

SPEC = """agents:
  - id: a1
    base_role: solver
    role: "Solver"
    duty: "Solve the problem step by step and give the number."
    capacity: large
    depends_on: []
final: a1
"""


def tiny(tmp_path, **kw) -> duel.DuelConfig:
    return duel.DuelConfig(eval_n=2, dev_n=1, steps=4, dev_steps=(2,), work=str(tmp_path / "work"),
                           ref=str(tmp_path / "ref"), **kw)


def fake_adapters(d: duel.DuelConfig, arms=("sft", "cf")) -> None:
    for arm in arms:
        for _, adapter, _ in duel.spec_points(d, arm):
            Path(adapter).mkdir(parents=True, exist_ok=True)
            (Path(adapter) / "adapter_model.safetensors").write_bytes(f"{adapter}".encode())


class Writer:
    """Records which adapter wrote which question; every third spec is invalid text."""
    seen: list = []

    def __init__(self, cfg, adapter, name):
        self.adapter, self.name, self.k = Path(adapter), name, 0

    def propose(self, task, domain, prompts, seed=0):
        Writer.seen.append(self.adapter.name)
        self.k += 1
        if self.k % 3 == 0:
            return SpecProposal("agents: [", None, "yaml_syntax: bad", "yaml_syntax", 10, 3)
        return SpecProposal(SPEC, parse_spec(SPEC, base_roles=prompts.roles_for(domain)), None, None, 10, 40)

    def close(self):
        pass


def test_config_rejects_dev_steps_that_are_not_checkpoints():
    with pytest.raises(ValueError, match="even step"):
        duel.DuelConfig(steps=4, dev_steps=(3,))
    with pytest.raises(ValueError, match="below steps"):
        duel.DuelConfig(steps=4, dev_steps=(4,))
    cfg = duel.DuelConfig(steps=7).study()
    assert cfg.profile == "cpu-long" and cfg.train.max_steps == cfg.ablation_steps == 7 and cfg.policy_server


def test_specs_are_written_per_point_and_resume(tmp_path):
    d, prompts = tiny(tmp_path), default_prompts()
    with pytest.raises(FileNotFoundError, match="not trained"):
        duel.write_specs(d, "cf", prompts, writer_factory=Writer, progress=False)
    fake_adapters(d)
    Writer.seen = []
    n = duel.write_specs(d, "cf", prompts, writer_factory=Writer, progress=False)
    n_eval, n_dev = 2 * 3, 1 * 3  # 3 math benchmarks
    assert n == n_eval + n_dev + n_dev  # final: eval + dev; checkpoint-2: dev
    assert Writer.seen == ["adapter"] * (n_eval + n_dev) + ["checkpoint-2"] * n_dev
    rows = read_rows(duel.spec_file(d, "cf", 4, "eval"))
    assert len(rows) == n_eval and {r["benchmark"] for r in rows} == {"multiarith", "svamp", "gsm8k"}
    assert all(r["adapter_sha256"] == duel.adapter_sha(d.paths.grpo / "adapter") for r in rows)
    assert sum(not r["valid"] for r in rows) == 2
    dev_ids = {r["id"] for r in read_rows(duel.spec_file(d, "cf", 2, "dev"))}
    assert all("/train/" in i for i in dev_ids)  # dev = held-out TRAIN-pool questions
    assert duel.write_specs(d, "cf", prompts, writer_factory=Writer, progress=False) == 0  # resumed: nothing redone
    assert [json.loads(x)["leg"] for x in (d.refdir / "legs.jsonl").read_text().splitlines()] == ["specs", "specs"]


def test_replayed_specs_execute_without_an_adapter_and_report_lists_what_is_missing(tmp_path):
    d, prompts = tiny(tmp_path), default_prompts()
    fake_adapters(d)
    for arm in ("sft", "cf"):
        duel.write_specs(d, arm, prompts, writer_factory=Writer, progress=False)
    # a later session: no adapters in the work folder, only ref/
    import shutil
    shutil.rmtree(d.paths.root / "train")
    backend = FakeBackend("The answer is 3.\nAnswer: 3")
    pool = WorkerPool({c: backend for c in CAPACITIES})
    sums = duel.run_method(d, "cf", prompts, pool, progress=False)
    assert [(s["set"], s["step"]) for s in sums] == [("eval", 4)] * 3 + [("dev", 4)] * 3 + [("dev", 2)] * 3
    rows = [r for b in ("multiarith", "svamp", "gsm8k") for r in read_rows(duel.eval_dir(d, "cf", b) / "results.jsonl")]
    assert len(rows) == 6 and sum(bool(r["spec_error"]) for r in rows) == 2  # invalid specs are scored, not skipped
    assert all(r["spec"] for r in rows) and not list((d.refdir / "eval").rglob("node_cache.jsonl"))
    n_calls = len(backend.calls)
    duel.run_method(d, "cf", prompts, pool, progress=False)  # resumed: no worker call
    assert len(backend.calls) == n_calls
    duel.run_method(d, "sft", prompts, pool, progress=False)
    # 2 questions in flight: still one row per question
    duel.run_method(d, "cot@large", prompts, pool, progress=False, concurrency=2)
    assert len(read_rows(duel.eval_dir(d, "cot@large", "svamp") / "results.jsonl")) == 2
    # chosen on TRAIN-pool questions, kept in ref/select
    duel.run_method(d, "best-fixed", prompts, pool, progress=False)
    choice = json.loads((d.refdir / "select" / "choice.json").read_text())
    assert (choice["chosen"] in d.study().fixed_candidates
            and all("/train/" in i for v in choice["dev_ids"].values() for i in v))
    chosen = choice["chosen"]  # best-fixed's eval rows are the chosen method's own, executed once
    assert len(read_rows(duel.eval_dir(d, chosen, "gsm8k") / "results.jsonl")) == 2
    assert not (d.refdir / "eval" / "best-fixed").exists()
    assert not list(d.refdir.rglob("node_cache.jsonl"))
    miss = missing(d)
    assert (any(m.startswith("arm cf: not trained") for m in miss)
            and any("global step 4: 0/6 eval specs" in m for m in miss))
    assert any(m.startswith("global: 0/6 eval questions") for m in miss) and not any(m.startswith("cf: ") for m in miss)
    f = duel.spec_file(d, "sft", 0, "dev")
    rows = read_rows(f)
    f.write_text("".join(json.dumps({**r, "adapter_sha256": "f" * 64} if i == 0 else r) + "\n"
                         for i, r in enumerate(rows)))
    assert any("sft step 0 dev specs come from 2 different adapters" in m for m in missing(d))
    out = report(d, prompts)
    text = out.read_text()
    assert "| cf | sft |" in text and "| cf | cot@large |" in text and "## Not done yet" in text
    assert f"| cf | best-fixed (= {chosen}) |" in text and not any(m.startswith("best-fixed:") for m in miss)
    assert "(nothing recorded yet)" in text  # no training record in this fake chain
    assert (d.refdir / "plots" / "pareto.png").exists() and (d.refdir / "plots" / "dev_curves.png").exists()
    assert "differs from cf" not in text  # only one arm has specs yet
    fake_adapters(d, arms=("global",))
    duel.write_specs(d, "global", prompts, writer_factory=Writer, progress=False)
    comp = report(d, prompts).read_text().split("## What the policies' greedy eval specs look like")[1]
    global_row = next(line for line in comp.splitlines() if line.startswith("| global |"))
    assert "differs from cf" in comp and global_row.endswith("| 0/6 |")  # the same fake writer: the same structures


def test_replay_writer_refuses_unknown_questions(tmp_path):
    p = tmp_path / "s.jsonl"
    p.write_text(json.dumps({"question_sha256": duel.qkey("q1"), "text": SPEC, "prompt_tokens": 5,
                             "completion_tokens": 9}) + "\n")
    w = duel.ReplayWriter(p, "replay", max_agents=4)
    prop = w.propose("q1", "math", default_prompts())
    assert prop.spec is not None and prop.spec.agents[0].capacity == "large" and prop.completion_tokens == 9
    with pytest.raises(KeyError, match="no spec for this question"):
        w.propose("q2", "math", default_prompts())
    with pytest.raises(FileNotFoundError):
        duel.ReplayWriter(tmp_path / "none.jsonl", "x", 4)


def test_capacity_share_counts_agents():
    assert capacity_share([SPEC, SPEC.replace("large", "medium")]) == 0.5
    assert capacity_share([]) != capacity_share([])  # nan: nothing sampled


def test_warm_start_rebuilt_from_a_committed_corpus_is_the_same_adapter(tmp_path):
    """The chain's premise: the second arm's leg rebuilds the first leg's warm start from its corpus alone (no workers),
    bit for bit (seeded fresh LoRA, seeded SFT), on a tiny random Qwen2."""
    from dataclasses import replace
    from _tiny import tiny_model
    from lemon.train.config import sft_preset, train_preset
    from lemon.train.pipeline import warm_start
    from lemon.policy.model import PolicyConfig
    tiny_model(tmp_path / "tiny")
    cfg = train_preset("smoke", policy=PolicyConfig(model=str(tmp_path / "tiny"), backend="transformers", lora_r=4,
                                                    lora_alpha=8), max_completion_length=24, constrained=False)
    sft = replace(sft_preset("smoke"), probe_questions=1, epochs=1.0)
    corpus = [{"prompt": [{"role": "user", "content": f"question {i}"}],
               "completion": [{"role": "assistant", "content": SPEC}], "example_id": f"gsm8k/train/{i}"}
               for i in range(2)]
    shas = []
    for run in ("a", "b"):
        rec = warm_start(cfg, sft, tmp_path / run, default_prompts(), corpus=corpus, progress=False)
        assert rec["rows"] == 2 and rec["corpus"] == {"given": 2}
        shas.append(duel.adapter_sha(Path(rec["adapter"])))
    assert shas[0] == shas[1]


def test_a_record_folder_refuses_a_leg_with_another_config(tmp_path):
    d = tiny(tmp_path)
    duel.log_event(d, leg="probe")
    assert json.loads((Path(d.ref) / "config.json").read_text())["seed"] == 0
    duel.log_event(d, leg="probe")  # the same config: fine
    with pytest.raises(ValueError, match=r"different config \(seed: 0 -> 1\); give this one its own --work and --ref"):
        duel.log_event(tiny(tmp_path, seed=1), leg="probe")
    assert len(read_rows(Path(d.ref) / "legs.jsonl")) == 2  # the refused leg wrote nothing


def test_status_commands_carry_a_replicates_options(tmp_path):
    d = tiny(tmp_path, seed=1)
    assert duel.cli(duel.DuelConfig()) == "experiments/duel/"
    cmd = duel.cli(d)
    assert "--seed 1" in cmd and "--steps 4" in cmd and f"--ref {d.ref}" in cmd and "--dev-steps '2'" in cmd
    assert any(f"`{cmd} train --arm cf`" in m for m in missing(d))
