"""The study notebooks: their shape (fast), and the whole `test`-profile study through papermill, validated with nbval
(slow, in CI): plots, summary tables and result rows exist, and a rerun resumes instead of redoing."""
import ast
import json
import subprocess
import sys
import time

import nbformat
import pytest

from lemon import benchmarks as B
from lemon.study import runner as study
from lemon.eval.runner import read_rows

NB_DIR = study.ROOT / "notebooks"
PLOTS = ("data_pools", "training_curves", "edit_effects", "ablation", "accuracy", "pareto")


@pytest.mark.parametrize("name", study.NOTEBOOKS)
def test_notebook_shape(name):
    nb = nbformat.read(NB_DIR / f"{name}.ipynb", as_version=4)
    assert nb.metadata["kernelspec"]["name"] == "python3"
    code = [c for c in nb.cells if c.cell_type == "code"]
    title = nb.cells[0]  # the title first, then the parameters, then the setup
    assert title.cell_type == "markdown" and title.source.startswith(f"# {name[:2]} · "), title.source[:80]
    assert nb.cells[1] is code[0] and "parameters" in code[0].metadata.get("tags", [])
    names = set()
    for stmt in ast.parse(code[0].source).body:  # literals only, so papermill can override them
        assert isinstance(stmt, ast.Assign), ast.dump(stmt)
        ast.literal_eval(stmt.value)
        names |= {t.id for t in stmt.targets}
    assert names == {"profile", "out_dir", "seed", "sets", "workers"}
    assert nb.cells[2] is code[1] and "study.setup(profile, out_dir, seed, sets, workers)" in code[1].source
    assert "print(cfg.describe())" in code[1].source
    for c in code:  # committed without outputs
        assert not c.outputs and c.execution_count is None, c.source[:80]
    for c in code:  # logic lives in lemon/, not in the notebooks
        tree = ast.parse("\n".join(l for l in c.source.splitlines() if not l.lstrip().startswith(("%", "!"))))
        assert not [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))], c.source


def test_training_notebook_takes_one_step_apart_before_the_loop():
    """Notebook 02: the objective in the title cell, then on the real objects (warm-started policy, worker pool,
    trainer parts) one question through one CF-GRPO step, stage by stage, then the training loop."""
    nb = nbformat.read(NB_DIR / "02_train_grpo_lora.ipynb", as_version=4)
    assert all(x in nb.cells[0].source for x in ("A_{i,t}", r"\delta_i = r(y_i) - r(y_i')", r"\lambda", "S_i"))
    code = [c.source for c in nb.cells if c.cell_type == "code"]
    steps = ("stages.warm_start_main(", "wt.setup(", "wt.sample(", "wt.score(", "wt.agent_io_html(", "draw_spec(",
             "wt.counterfactuals(", "wt.family_edits(", "wt.tokens_html(", "wt.advantages(", "wt.plot_advantages(",
             "wt.optimizer_step(", "wt.span_table(", "stages.train_main(", "plots.training_curves(")
    at = [next((k for k, src in enumerate(code) if s in src), None) for s in steps]
    assert None not in at and at == sorted(at), dict(zip(steps, at))
    checks = [src for src in code if src.startswith("# NBVAL_CHECK_OUTPUT")]
    assert len(checks) >= 2 and all("walk.samples" not in src and ".text" not in src for src in checks)


def _png(path):
    data = path.read_bytes()
    return data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000


def _rows(out, cfg):
    return {(m, b): [r["id"] for r in read_rows(out / "eval" / m / b / "results.jsonl")]
            for m in cfg.eval_methods for b in cfg.benchmarks}


@pytest.mark.slow
@pytest.mark.study  # select alone with `pytest -m study`
@pytest.mark.timeout(900)  # the `test` profile study + a resume + nbval: 250 s measured on 2 idle cores (2026-12-04)
def test_study_end_to_end(tmp_path_factory):
    """The whole study on the `test` profile (lemon.study.config: real llama-server workers, the 135M policy, SFT + 1
    CF-GRPO step, 1 question per benchmark, the served policy), then a resume, then nbval. The full-size smoke study is
    `bash scripts/main.sh --profile smoke`."""
    out = tmp_path_factory.mktemp("study") / "study"
    cfg = study.study_preset("test")
    t0 = time.perf_counter()
    assert study.run_study("test", out, log_output=False) == out.resolve()
    first = time.perf_counter() - t0
    print(f"test study: {first:.0f} s; per notebook {json.loads((out / 'timings.json').read_text())}")

    executed = [out / f"{nb}.ipynb" for nb in study.NOTEBOOKS]
    for p in executed:
        nb = nbformat.read(p, as_version=4)
        assert not [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"], p
    for name in PLOTS:
        assert _png(out / "plots" / f"{name}.png"), name
    rows = _rows(out, cfg)
    for (m, b), ids in rows.items():
        assert len(ids) == len(set(ids)) == cfg.eval_n, (m, b)
    for m in cfg.eval_methods:  # every row from its benchmark's EVAL pool split
        for b in cfg.benchmarks:
            splits = {r["split"] for r in read_rows(out / "eval" / m / b / "results.jsonl")}
            assert splits == {B.POOL_SPLITS["eval"][b]}, (m, b)
    assert json.loads((out / "select" / "choice.json").read_text())["chosen"] in cfg.fixed_candidates
    md = (out / "summary.md").read_text()
    for needle in ("## Does training help?", "**Training vs its warm start: delta", "## Data pools", "## Training",
                   "## Main results", "| method | gsm8k (test, n=1) | mmlu (validation, n=1) |", "## Ablation",
                   "| variant |",
                   "## Edit effects", "smollm2-135m", f"seed {cfg.seed}", "n = 1"):
        assert needle in md, needle
    assert (out / "train" / "sft" / "sft.json").exists()
    assert (out / "train" / "sft" / "adapter_model.safetensors").exists()
    assert (out / "train" / "grpo" / "adapter" / "adapter_config.json").exists()
    assert len(read_rows(out / "train" / "grpo" / "metrics.jsonl")) >= cfg.train.max_steps
    for v in cfg.ablation_variants:
        for b in cfg.ablation_benchmarks:
            rows_v = read_rows(out / "ablations" / "variants" / v / "eval" / b / "results.jsonl")
            assert len(rows_v) == cfg.ablation_n, (v, b)
    man = json.loads((out / "manifest.json").read_text())
    assert man["git"] and man["data"] and man["policy"]["sha256"] and man["seeds"]["study"] == cfg.seed

    # a rerun of the evaluation notebooks resumes: no duplicate rows, no retraining, far less time
    for nb in ("03_ablations", "04_evaluate"):
        (out / ".done" / f"{nb}.json").unlink()
    before = json.loads((out / "timings.json").read_text())
    t0 = time.perf_counter()
    study.run_study("test", out, log_output=False)
    again = time.perf_counter() - t0
    assert _rows(out, cfg) == rows
    assert again < 0.5 * (before["03_ablations"][0] + before["04_evaluate"][0]), (again, before)

    # nbval (lax) re-executes the executed notebooks: every cell must run again without error (and resume, again)
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "pytest", "--nbval-lax", "-p", "no:cacheprovider", "-q",
                        *map(str, executed)], cwd=out, capture_output=True, text=True, timeout=600)
    print(f"resume (03 + 04): {again:.0f} s; nbval: {time.perf_counter() - t0:.0f} s")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert _rows(out, cfg) == rows
