"""The study runner and its tables, fast: presets, out-dir / resume logic, the papermill loop (faked), summary tables
and the Pareto front from hand-made rows, and resumable evaluation / edit effects on a fake worker pool."""
import ast
import dataclasses
import json
import inspect
import sys
from pathlib import Path

import pandas as pd
import pytest

from lemon import benchmarks as B
from lemon.study import plots, stages
from lemon.study import runner as study
from lemon.prompts import CAPACITIES, default_prompts
from lemon.run.workers import FakeBackend, WorkerPool

SPEC = """agents:
  - id: solve
    base_role: solver
    role: Careful solver
    duty: Solve the problem step by step and give the number.
    capacity: small
  - id: check
    base_role: verifier
    role: Checker
    duty: Re-derive the result and state the final answer.
    capacity: medium
    depends_on: [solve]
final: check
"""


def fake_pool(reply="The answer is 3.\nAnswer: 3"):
    def r(messages, params):
        return SPEC if "design" in messages[0]["content"].lower() else reply
    b = FakeBackend(r, model="fake")
    return WorkerPool({c: b for c in CAPACITIES})


# ---- config ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("profile", ["smoke", "cpu-wide", "paper"])
def test_broad_presets_build_and_reference_training_presets(profile):
    cfg = study.study_preset(profile, seed=3)
    assert cfg.profile == profile and cfg.train.profile == study.STUDY_PROFILES[profile]
    assert cfg.seed == cfg.train.seed == cfg.sft.seed == 3
    assert set(cfg.benchmarks) == set(B.BENCHMARKS)
    assert {"vanilla", "cot", "sc-cot", "chain", "tree", "complete", "random", "prompted",
            "lemon"} <= set(cfg.eval_methods)
    assert {"global", "full", "edge"} <= set(cfg.ablation_variants)
    if profile != "smoke":  # smoke keeps one single-family variant to fit CI
        assert {"role", "capacity"} <= set(cfg.ablation_variants)
    json.dumps(cfg.to_dict(), default=str)


@pytest.mark.parametrize("profile", ["cpu", "cpu-long"])
def test_cpu_asks_one_question_on_paired_math_questions(profile):
    """The embedded default pairs the trained policy with its own SFT warm start (cpu-long: and global GRPO at the same
    step count) and CoT@large (cpu-long: CoT at each capacity), on the same seeded math EVAL-pool questions (the
    ablation sample is the whole eval sample)."""
    cfg = study.study_preset(profile, seed=1)
    assert cfg.train.profile == "cpu" and cfg.benchmarks == study.MATH == cfg.ablation_benchmarks
    assert cfg.ablation_variants == (("sft",) if profile == "cpu" else ("sft", "global"))
    assert cfg.ablation_n == cfg.eval_n and cfg.policy_server
    # issue 31: >= 90 pairs, so a capacity shift (the duel: +0.33 at n=150) separates; trained vs CoT@large always
    assert cfg.eval_n * len(cfg.benchmarks) >= 90 and {"cot@large", "lemon"} <= set(cfg.eval_methods)
    if profile == "cpu-long":
        assert cfg.ablation_steps == cfg.train.max_steps >= 15 and cfg.eval_n * len(cfg.benchmarks) >= 150
    # trained on the math TRAIN pools, evaluated on their EVAL pools
    assert set(cfg.train.benchmarks) == set(study.MATH)
    assert study.split_method("cot@large") == ("cot", "large") and study.split_method("lemon") == ("lemon", None)


def test_smoke_is_sized_for_ci():
    cfg = study.study_preset("smoke")
    assert cfg.eval_n == 2 and "humaneval" in cfg.benchmarks
    assert cfg.train.policy.model == "smollm2-135m" and max(cfg.train.worker_max_tokens.values()) <= 32
    assert cfg.train.max_steps <= 2 and cfg.ablation_steps <= 2
    assert study.study_preset("paper").eval_n is None  # the whole eval pools


def test_every_field_has_a_docstring():
    src = inspect.getsource(study.StudyConfig)
    body = ast.parse(src).body[0].body
    fields = {f.name for f in dataclasses.fields(study.StudyConfig)}
    documented = {n.target.id for n, d in zip(body, body[1:]) if isinstance(n, ast.AnnAssign)
                  and isinstance(d, ast.Expr) and isinstance(d.value, ast.Constant)}
    assert fields == documented


@pytest.mark.parametrize("bad, match", [({"eval_methods": ("cot", "magic")}, "magic"),
                                        ({"ablation_variants": ("nope",)}, "nope"),
                                        ({"eval_n": 1, "edit_n": 2}, "edit_n"),
                                        ({"benchmarks": ("gsm9k",)}, "gsm9k"),
                                        ({"n_agents": 2}, "tree"),
                                        ({"baseline_capacity": "huge"}, "huge"),
                                        ({"eval_methods": ("cot@huge",)}, "cot@huge"),
                                        ({"eval_methods": ("lemon@large",)}, "lemon@large"),
                                        ({"eval_concurrency": 0}, "eval_concurrency")])
def test_bad_configs_are_refused_with_the_reason(bad, match):
    with pytest.raises(ValueError, match=match):
        study.study_preset("smoke", **bad)


# ---- out dir / resume ------------------------------------------------------------------------------------------------
def test_resolve_out_dir(tmp_path):
    new = study.resolve_out_dir("cpu", root=tmp_path)
    assert new.parent == tmp_path / "outputs" and new.name.startswith("cpu-")
    with pytest.raises(FileNotFoundError, match="no earlier cpu study"):
        study.resolve_out_dir("cpu", resume=True, root=tmp_path)
    for name in ("cpu-20260101-000000", "cpu-20261130-120000", "cpu-custom", "smoke-20270101-000000",
                 "cpu-wide-20270101-000000"):  # another profile's folder, though its name starts with cpu-
        (tmp_path / "outputs" / name).mkdir(parents=True)
    assert study.resolve_out_dir("cpu", resume=True, root=tmp_path).name == "cpu-20261130-120000"
    assert study.resolve_out_dir("cpu", tmp_path / "mine", resume=True, root=tmp_path) == (tmp_path / "mine").resolve()


def test_a_folder_keeps_its_config(tmp_path):
    paths = study.StudyPaths(tmp_path)
    study.write_config(study.study_preset("smoke"), paths)
    study.write_config(study.study_preset("smoke"), paths)  # same config: fine
    with pytest.raises(ValueError, match=r"different config \(seed: 0 -> 1"):
        study.write_config(study.study_preset("smoke", seed=1), paths)


def test_missing_inputs_name_the_notebook(tmp_path):
    cfg, paths = study.study_preset("smoke"), study.StudyPaths(tmp_path)
    with pytest.raises(FileNotFoundError, match="01_prepare_data"):
        study.load_samples(cfg, paths)
    with pytest.raises(FileNotFoundError, match="02_train_grpo_lora"):
        stages.train_variant(cfg, paths, "global", default_prompts(), pool=None)


def _fake_papermill(monkeypatch, fail_in=None, dead_in=None):
    import papermill
    from papermill.exceptions import PapermillExecutionError
    calls = []

    def fake(src, dst, parameters=None, kernel_name=None, **kw):
        calls.append(Path(src).stem)
        assert kernel_name == "python3" and set(parameters) == {"profile", "out_dir", "seed", "sets", "workers"}
        if Path(src).stem == fail_in:
            raise PapermillExecutionError(3, 4, "x = 1/0", "ZeroDivisionError", "division by zero", [])
        if Path(src).stem == dead_in:
            from nbclient.exceptions import DeadKernelError
            raise DeadKernelError("Kernel died")
        Path(dst).write_text("{}")
    monkeypatch.setattr(papermill, "execute_notebook", fake)
    return calls


def test_run_study_skips_finished_notebooks_and_names_a_failing_cell(tmp_path, monkeypatch, capsys):
    calls = _fake_papermill(monkeypatch, fail_in="03_ablations")
    with pytest.raises(SystemExit) as e:
        study.run_study("smoke", tmp_path / "s", log_output=False)
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert "03_ablations.ipynb, cell 3" in err and "ZeroDivisionError: division by zero" in err and "--out" in err
    assert calls == ["01_prepare_data", "02_train_grpo_lora", "03_ablations"]
    lost = json.loads((tmp_path / "s" / "timings.json").read_text())["03_ablations"]  # the failed execution is counted
    assert len(lost) == 1 and lost[0]["stopped"] == "failed in cell 3" and lost[0]["s"] >= 0
    calls2 = _fake_papermill(monkeypatch)
    out = study.run_study("smoke", tmp_path / "s", log_output=False)  # resume: 01 and 02 are done
    assert calls2 == ["03_ablations", "04_evaluate"]
    man = json.loads((out / "manifest.json").read_text())
    assert man["git"] and man["seeds"]["study"] == 0 and man["workers"]["small"]["sha256"]
    assert man["policy"]["sha256"] and any(k.endswith("gsm8k/test.jsonl") for k in man["data"])
    assert (out / "summary.md").exists() and (out / "timings.json").exists()
    tm = json.loads((out / "timings.json").read_text())["03_ablations"]
    assert isinstance(tm[0], dict) and isinstance(tm[1], float)  # stopped, then finished
    assert "(failed in cell 3) + " in (out / "summary.md").read_text() and "| all |" in (out / "summary.md").read_text()
    calls3 = _fake_papermill(monkeypatch)
    study.run_study("smoke", tmp_path / "s", log_output=False)
    assert calls3 == []
    assert len(json.loads((out / "manifest.json").read_text())["resumed"]) == 2
    # a notebook that runs again re-runs its successors (they resume)
    (out / ".done" / "02_train_grpo_lora.json").unlink()
    calls4 = _fake_papermill(monkeypatch)
    study.run_study("smoke", tmp_path / "s", log_output=False)
    assert calls4 == ["02_train_grpo_lora", "03_ablations", "04_evaluate"]


def test_an_interrupt_names_the_notebook_and_the_resume_command(tmp_path, monkeypatch, capsys):
    """Ctrl-C (or SIGTERM, which main() turns into the same KeyboardInterrupt) mid-notebook: exit 130, time recorded."""
    import papermill

    def interrupted(src, dst, **kw):
        if Path(src).stem == "02_train_grpo_lora":
            study._raise_interrupt(15, None)
        Path(dst).write_text("{}")
    monkeypatch.setattr(papermill, "execute_notebook", interrupted)
    with pytest.raises(SystemExit) as e:
        study.run_study("smoke", tmp_path / "s", log_output=False)
    err = capsys.readouterr().err
    assert e.value.code == 130 and "INTERRUPTED in notebook 02_train_grpo_lora.ipynb" in err and "--out" in err
    tm = json.loads((tmp_path / "s" / "timings.json").read_text())
    assert tm["02_train_grpo_lora"][0]["stopped"] == "interrupted" and "03_ablations" not in tm


def test_cli_main_rejects_conflicting_config(tmp_path, monkeypatch, capsys):
    _fake_papermill(monkeypatch)
    assert study.main(["--profile", "smoke", "--out", str(tmp_path), "--quiet"]) == 0
    assert study.main(["--profile", "smoke", "--out", str(tmp_path), "--seed", "5", "--quiet"]) == 2
    assert "different config" in capsys.readouterr().err


# ---- tables ----------------------------------------------------------------------------------------------------------
def test_pareto_front():
    assert plots.pareto_front([10, 20, 30, 15], [0.5, 0.7, 0.6, 0.5]) == [True, True, False, False]
    assert plots.pareto_front([1, 1], [0.2, 0.2]) == [True, True]  # ties dominate nobody
    assert plots.pareto_front([], []) == []


def _row(i, method, bench, correct, tokens):
    return {"id": f"{bench}/{i}", "method": method, "benchmark": bench, "split": B.POOL_SPLITS["eval"][bench],
            "correct": correct, "score": float(correct), "tokens": tokens, "nominal_tokens": tokens, "latency_s": 0.1,
            "orchestrator_tokens": 7, "spec": None, "spec_error": None, "error": None}


def _write(path, rows):
    path.mkdir(parents=True, exist_ok=True)
    (path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_tables_and_summary_from_results(tmp_path):
    cfg = study.study_preset("smoke")
    paths = study.StudyPaths(tmp_path)
    study.write_config(cfg, paths)
    for m, acc, tok in (("cot", [1, 0], 100), ("chain", [1, 1], 400), ("lemon", [1, 1], 150)):
        for b in ("gsm8k", "mmlu"):
            _write(paths.eval_dir(m, b), [_row(i, m, b, bool(c), tok) for i, c in enumerate(acc)])
    for v, acc in (("global", [0]), ("full", [1])):
        _write(paths.variant(v) / "eval" / "gsm8k", [_row(0, v, "gsm8k", bool(acc[0]), 90)])
    paths.edits.parent.mkdir(parents=True, exist_ok=True)
    paths.edits.write_text("".join(json.dumps({"family": f, "benchmark": "gsm8k", "d_score": d, "d_tokens": t}) + "\n"
                                   for f, d, t in (("edge", -1.0, -50), ("edge", 0.0, -30), ("capacity", 0.0, -80))))
    t = plots.eval_table(paths.root, cfg.eval_methods, cfg.benchmarks)
    assert len(t) == 6 and set(t.method) == {"cot", "chain", "lemon"}
    cot = t[(t.method == "cot") & (t.benchmark == "gsm8k")].iloc[0]
    assert cot.n == 2 and cot.accuracy == 0.5 and cot.ci_lo < 0.5 < cot.ci_hi and cot.split == "test"
    s = plots.method_summary(t).set_index("method")
    assert s.loc["lemon", "pareto"] and s.loc["cot", "pareto"] and not s.loc["chain", "pareto"]
    a = plots.ablation_table(paths.root, cfg.ablation_variants, cfg.ablation_benchmarks)
    assert list(a.variant) == ["global", "full"] and list(a["gsm8k acc"]) == [0.0, 1.0]
    e = plots.edit_table(stages.read_rows(paths.edits)).set_index("family")
    assert e.loc["edge", "edits"] == 2 and e.loc["edge", "d_accuracy"] == -0.5 and e.loc["capacity", "d_tokens"] == -80
    (paths.root / "dev").mkdir()
    (paths.root / "dev" / "curves.json").write_text(json.dumps([{"run": "lemon", "step": s, "n": 6, "accuracy": a,
                                                                  "tokens": 99.0} for s, a in ((0, 0.5), (2, 0.75))]))
    md = plots.write_summary(cfg, paths).read_text()
    assert "## Learning curves" in md and "| lemon | 2 | 6 | 0.750 | 99.000 |" in md
    for needle in ("## Main results", "| method | gsm8k (test, n=2) | mmlu (validation, n=2) |",
                   "| cot | 0.50 [0.09, 0.91] · 100 |", "## Ablation",
                   "| variant |", "## Edit effects", "seed 0", "baselines at capacity `medium`", "smollm2-135m",
                   "gsm8k test", "mmlu validation"):
        assert needle in md, needle
    # the paired answer comes first: lemon vs the 1-step global variant on the question both saw, and vs each baseline
    assert md.index("## Does training help?") < md.index("## Data pools")
    assert "The SFT warm start was not evaluated" in md and "| lemon | cot@medium | 4 |" in md
    for fig in (plots.dev_plot(pd.DataFrame(json.loads((paths.root / "dev" / "curves.json").read_text()))),
                plots.pareto_plot(s.reset_index()), plots.accuracy_heatmap(t), plots.ablation_plot(a),
                plots.edit_heatmap(plots.edit_table(stages.read_rows(paths.edits)))):
        p = plots.save(fig, tmp_path / "p.png")
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_read_metrics_keeps_the_last_of_repeated_steps(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in ({"step": 1, "reward": 0.1}, {"step": 2, "reward": 0.2},
                                                        {"step": 2, "reward": 0.3}, {"step": 2, "train_runtime": 9})))
    m = plots.read_metrics(p)
    assert list(m.step) == [1, 2] and list(m.reward) == [0.1, 0.3]
    plots.save(plots.training_curves(m, [1.0, 0.5]), tmp_path / "c.png")


def test_gallery_falls_back_to_yaml_without_widgets(monkeypatch):
    from lemon.spec import parse_spec
    monkeypatch.setitem(sys.modules, "lemon.study.widgets", None)  # import fails
    spec = parse_spec(SPEC)
    [(title, shown)] = plots.spec_gallery([("t", spec)])
    assert title == "t" and "agents:" in shown


# ---- data, evaluation and edit effects on a fake pool ----------------------------------------------------------------
@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    cfg = study.study_preset("smoke", eval_n=2, edit_n=1)
    paths = study.StudyPaths(tmp_path_factory.mktemp("study"))
    study.write_config(cfg, paths)
    return cfg, paths, stages.prepare_data(cfg, paths)


def test_prepare_data_writes_disjoint_pools_and_samples(prepared):
    cfg, paths, res = prepared
    tr, ev = (json.loads((paths.data / f).read_text()) for f in ("train_ids.json", "eval_ids.json"))
    for b in B.BENCHMARKS:
        assert tr[b] and ev[b] and not set(tr[b]) & set(ev[b])
        assert res["checks"][b]["text_overlap"] == 0
    s = json.loads(paths.samples.read_text())
    assert all(len(v) == 2 and set(v) <= set(ev[b]) for b, v in s["eval"].items())
    assert all(s["edit"][b] == s["eval"][b][:1] for b in s["edit"])  # prefixes: the same questions, fewer
    assert len(tr["humaneval"]) == 40 and len(ev["humaneval"]) == 124 and len(ev["mmlu"]) == 1531
    assert {r["pool"] for r in res["stats"]} == {"train", "eval"}


def test_evaluate_resumes_without_duplicate_rows(prepared):
    cfg, paths, _ = prepared
    pool, prompts = fake_pool(), default_prompts()
    ex = {b: v for b, v in study.load_samples(cfg, paths).items() if b in ("gsm8k", "multiarith")}
    for method in ("cot", "prompted"):
        s1 = stages.evaluate(cfg, paths, method, ex, pool, prompts, progress=False)
        s2 = stages.evaluate(cfg, paths, method, ex, pool, prompts, progress=False)
        assert [s["n"] for s in s1] == [s["n"] for s in s2] == [2, 2]
        for b in ex:
            assert len(stages.read_rows(paths.eval_dir(method, b) / "results.jsonl")) == 2
    rows = stages.read_rows(paths.eval_dir("prompted", "gsm8k") / "results.jsonl")
    assert all(r["spec"] and not r["spec_error"] for r in rows)
    gen = stages.generated_specs(cfg, paths, prompts)
    assert gen and gen[0]["spec"] is not None and gen[0]["method"] == "prompted"
    with pytest.raises(ValueError, match="adapter"):
        stages.evaluate(cfg, paths, "lemon", ex, pool, prompts)


def test_evaluate_runs_the_configured_questions_in_flight(prepared, tmp_path):
    # StudyConfig.eval_concurrency reaches every evaluation of the study (the cpu profile runs 4 in flight); an explicit
    # argument (experiments/duel passes its own) wins.
    cfg, paths, _ = prepared
    ex = {"multiarith": study.load_samples(cfg, paths)["multiarith"]}
    for conc, arg, want in ((3, None, 3), (3, 1, 1)):
        out = tmp_path / f"c{conc}-{arg}"
        s = stages.evaluate(dataclasses.replace(cfg, eval_concurrency=conc), paths, "cot", ex, fake_pool(),
                            default_prompts(), progress=False, concurrency=arg, out_of=lambda b, out=out: out / b)
        assert s[0]["concurrency"] == want and s[0]["n"] == 2


def test_edit_effects_rows_and_resume(prepared):
    cfg, paths, _ = prepared
    pool, prompts = fake_pool(), default_prompts()
    rows = stages.edit_effects(cfg, paths, prompts, pool, progress=False)
    assert rows and {r["family"] for r in rows} <= {"edge", "role", "capacity"}
    assert all(r["split"] == B.POOL_SPLITS["eval"][r["benchmark"]] for r in rows)
    assert all(r["d_score"] == r["score_edit"] - r["score_orig"] and r["spec"] != r["edited_spec"] for r in rows)
    again = stages.edit_effects(cfg, paths, prompts, pool, progress=False)
    assert len(again) == len(rows) == len(stages.read_rows(paths.edits))


def test_a_killed_kernel_is_named_and_the_study_resumes(tmp_path, monkeypatch, capsys):
    """An OOM-killed kernel leaves no traceback: the runner says so, names the notebook, and the rerun resumes there."""
    _fake_papermill(monkeypatch, dead_in="02_train_grpo_lora")
    with pytest.raises(SystemExit) as e:
        study.run_study("smoke", tmp_path / "s", log_output=False)
    err = capsys.readouterr().err
    assert e.value.code == 1 and "02_train_grpo_lora.ipynb: its kernel died" in err and "oom" in err and "--out" in err
    assert (json.loads((tmp_path / "s" / "timings.json").read_text())["02_train_grpo_lora"][0]["stopped"]
            == "kernel died")
    calls = _fake_papermill(monkeypatch)
    study.run_study("smoke", tmp_path / "s", log_output=False)
    assert calls == ["02_train_grpo_lora", "03_ablations", "04_evaluate"]


def test_best_fixed_chooses_on_train_questions_and_evaluates_its_choice(tmp_path):
    """'best-fixed': the candidates run on TRAIN-pool dev questions, the most accurate wins (ties: fewer tokens), and
    only the winner runs on the eval sample. Here only the large worker knows the answers, so cot@large and chain@large
    tie on accuracy and the cheaper single agent wins."""
    cfg = study.study_preset("smoke", benchmarks=("gsm8k",), ablation_benchmarks=("gsm8k",), eval_n=2, edit_n=1,
                             ablation_n=1, eval_methods=("best-fixed",), fixed_dev_n=3,
                             fixed_candidates=("cot@small", "cot@large", "chain@large"))
    paths = study.StudyPaths(tmp_path)
    study.write_config(cfg, paths)
    stages.prepare_data(cfg, paths)
    gold = {e.question: e.gold for e in B.train_pool(cfg.protocol)["gsm8k"] + B.eval_pool(cfg.protocol)["gsm8k"]}

    calls = []

    def knows(messages, params):
        calls.append(1)
        text = " ".join(m["content"] for m in messages)
        return next((f"Answer: {g}" for q, g in gold.items() if q in text), "Answer: -1")
    wrong, right = FakeBackend(lambda m, p: "Answer: -1", model="small"), FakeBackend(knows, model="large")
    pool = WorkerPool({"small": wrong, "medium": wrong, "large": right})
    stages.evaluate_all(cfg, paths, pool, default_prompts(), progress=False)
    choice = json.loads((paths.root / "select" / "choice.json").read_text())
    assert choice["chosen"] == "cot@large"
    acc = {c["method"]: c["accuracy"] for c in choice["candidates"]}
    assert acc == {"cot@small": 0.0, "cot@large": 1.0, "chain@large": 1.0}
    train_ids = {e.id for e in B.train_pool(cfg.protocol)["gsm8k"]}
    assert len(choice["dev_ids"]["gsm8k"]) == 3 and set(choice["dev_ids"]["gsm8k"]) <= train_ids
    dev_rows = stages.read_rows(paths.root / "select" / "cot@large" / "gsm8k" / "results.jsonl")
    assert {r["split"] for r in dev_rows} == {"train"}
    rows = stages.read_rows(paths.eval_dir("best-fixed", "gsm8k") / "results.jsonl")
    assert len(rows) == 2 and all(r["correct"] and r["method"] == "cot" and r["split"] == "test" for r in rows)
    before = len(calls)
    assert stages.select_fixed(cfg, paths, pool, default_prompts(), progress=False) == "cot@large"  # from choice.json
    assert len(calls) == before > 0
    with pytest.raises(ValueError, match="fixed_candidates: lemon"):
        study.study_preset("smoke", fixed_candidates=("lemon",))


def test_dev_curves_evaluate_each_runs_checkpoints_on_held_out_train_questions(tmp_path, monkeypatch):
    """dev_curves: step 0 (the SFT adapter), every dev_every steps, the final adapter, for the main run and each trained
    variant; the dev questions come from the train pools and are not the ones training uses. The policy is faked (a
    writer that records which adapter it was given); the rest is the real evaluation path on a fake worker pool."""
    from lemon.eval.orchestrator import SpecProposal
    from lemon.spec import parse_spec
    from lemon.train.pipeline import training_examples
    cfg = study.study_preset("smoke", ablation_variants=("sft", "global"), ablation_steps=2, dev_n=2, dev_every=2)
    paths = study.StudyPaths(tmp_path)
    study.write_config(cfg, paths)
    (paths.sft).mkdir(parents=True)
    (paths.sft / "sft.json").write_text(json.dumps({"adapter": str(paths.sft)}))
    for run, steps in ((paths.grpo, 4), (paths.variant("global"), 2)):
        for k in range(1, steps + 1):
            (run / "grpo" / f"checkpoint-{k}").mkdir(parents=True)
        (run / "adapter").mkdir()
        (run / "train.json").write_text(json.dumps({"steps": steps}))
    seen = []

    class Writer:
        def __init__(self, cfg, adapter, name):
            self.adapter, self.name = Path(adapter), name

        def propose(self, task, domain, prompts, seed=0):
            seen.append(self.adapter.relative_to(paths.root).as_posix())
            return SpecProposal(SPEC, parse_spec(SPEC, base_roles=prompts.roles_for(domain)), None, None, 10, 20)

        def close(self):
            pass
    monkeypatch.setattr(stages, "LazyPolicyWriter", Writer)
    rows = stages.dev_curves(cfg, paths, default_prompts(), fake_pool(), progress=False)
    assert [(r["run"], r["step"]) for r in rows] == [("lemon", 0), ("lemon", 2), ("lemon", 4), ("global", 0),
                                                     ("global", 2)]
    assert all(r["n"] == 2 * len(cfg.train.benchmarks) for r in rows)
    n_q = 2 * len(cfg.train.benchmarks)
    assert seen == (["train/sft"] * n_q + ["train/grpo/grpo/checkpoint-2"] * n_q + ["train/grpo/adapter"] * n_q +
                    ["train/sft"] * n_q + ["ablations/variants/global/adapter"] * n_q)
    trained = {e.id for e in training_examples(cfg.train)}
    dev = [e for v in stages.dev_examples(cfg).values() for e in v]
    assert len(dev) == n_q and not {e.id for e in dev} & trained
    assert all(e.id in {x.id for x in B.train_pool(cfg.protocol)[e.benchmark]} for e in dev)
    again = stages.dev_curves(cfg, paths, default_prompts(), fake_pool(), progress=False)  # resumed: no new spec
    assert again == rows and len(seen) == 5 * n_q
    assert json.loads((paths.root / "dev" / "curves.json").read_text()) == rows
    with pytest.raises(ValueError, match="multiple of train.save_steps"):
        study.study_preset("cpu", dev_n=1, dev_every=3)


def test_summary_captions_say_what_ran(tmp_path):
    """The cpu profile runs no SFT probes, only @capacity baselines and an sft-only ablation, and no edit effects: the
    summary must not caption what did not run (it once printed 'valid-spec rate 0.00 -> 0.00 (n=0)')."""
    cfg = study.study_preset("cpu")
    paths = study.StudyPaths(tmp_path)
    study.write_config(cfg, paths)
    for m in cfg.eval_methods:
        for b in cfg.benchmarks:
            _write(paths.eval_dir(m, b), [_row(0, m, b, True, 100)])
    for b in cfg.ablation_benchmarks:
        _write(paths.variant("sft") / "eval" / b, [_row(0, "sft", b, False, 300)])
    (paths.root / "train" / "sft").mkdir(parents=True)
    (paths.root / "train" / "sft" / "sft.json").write_text(json.dumps(
        {"rows": 5, "valid_before": {"rate": 0.0, "n": 0}, "valid_after": {"rate": 0.0, "n": 0}}))
    (paths.root / "train" / "grpo").mkdir(parents=True)
    (paths.root / "train" / "grpo" / "train.json").write_text("{}")
    (paths.root / "train" / "grpo" / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward": 0.5}) + "\n")
    md = plots.write_summary(cfg, paths).read_text()
    assert "valid-spec rate not probed" in md and "0.00 -> 0.00" not in md
    assert "baselines at capacity" not in md  # cot@large names its capacity
    assert "`sft` = notebook 02's SFT warm start (no CF-GRPO step)" in md and "CF-GRPO step(s) from" not in md
    fig = plots.edit_heatmap(plots.edit_table([]))
    assert [t.get_text() for ax in fig.axes for t in ax.texts] == ["no edits measured in this study"] * 2
