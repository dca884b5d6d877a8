"""The eval runner and CLI: resumable after kill -9, one config per run folder, clear errors for bad names."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from lemon.eval.runner import EvalConfig, read_rows, run_eval, wilson_ci
from lemon.prompts import default_prompts
from lemon.run.workers import FakeBackend, WorkerPool

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


def fake_pool(reply="Reasoning... Answer: 18"):
    f = FakeBackend(reply)
    return WorkerPool({c: f for c in ("small", "medium", "large")})


def test_wilson_ci():
    lo, hi = wilson_ci(5, 10)
    assert lo < 0.5 < hi and 0 < lo and hi < 1
    assert wilson_ci(0, 0) == (0.0, 0.0)
    assert wilson_ci(10, 10)[1] == 1.0


def test_run_eval_rows_summary_resume_and_config_guard(tmp_path):
    P = default_prompts()
    cfg = EvalConfig(method="chain", benchmark="gsm8k", split="test", limit=3, seed=1, n_agents=2)
    s = run_eval(cfg, fake_pool(), P, tmp_path, progress=False)
    rows = read_rows(tmp_path / "results.jsonl")
    assert s["n"] == 3 == len(rows) and len({r["id"] for r in rows}) == 3
    assert all(r["tokens"] > 0 and r["agents"] == 2 and r["spec"] is None for r in rows)
    m = json.loads((tmp_path / "manifest.json").read_text())
    assert m["prompts_sha256"] == P.sha256 and m["config"]["eval"]["seed"] == 1 and m["data"]
    # rerun: nothing repeated, nothing lost
    s2 = run_eval(cfg, fake_pool(), P, tmp_path, progress=False)
    assert s2["n"] == 3 and len(read_rows(tmp_path / "results.jsonl")) == 3
    # a torn last line (killed mid-write) is cut off and that example is redone
    with open(tmp_path / "results.jsonl", "a") as f:
        f.write('{"id": "gsm8k/test/9", "corr')
    assert len(read_rows(tmp_path / "results.jsonl")) == 3
    # another config in the same folder is refused
    with pytest.raises(ValueError, match="different config"):
        run_eval(EvalConfig(method="cot", benchmark="gsm8k", limit=3, seed=1), fake_pool(), P, tmp_path, progress=False)


def test_spec_file_and_orchestrator_methods(tmp_path):
    P = default_prompts()
    spec = tmp_path / "s.yaml"
    spec.write_text("agents:\n  - {id: a, base_role: solver, role: S, duty: Solve it., capacity: small}\n")
    s = run_eval(EvalConfig(method=str(spec), benchmark="gsm8k", limit=2), fake_pool(), P, tmp_path / "f", progress=False)
    assert s["n"] == 2
    # the prompted orchestrator writing garbage: scored 0 with the spec error recorded, the loop goes on
    s = run_eval(EvalConfig(method="orchestrator", benchmark="gsm8k", limit=2), fake_pool("no spec here"), P,
                 tmp_path / "o", progress=False)
    rows = read_rows(tmp_path / "o" / "results.jsonl")
    assert s["invalid_specs"] == 2 and all(r["spec_error"].startswith("[no_yaml]") and not r["correct"] for r in rows)


def test_random_rows_keep_the_dag_each_question_ran(tmp_path):
    """Random draws one seeded DAG per question; the row keeps it (other baselines' specs are fixed by name)."""
    from lemon.eval.baselines import baseline_spec
    P = default_prompts()
    run_eval(EvalConfig(method="random", benchmark="gsm8k", limit=4, n_agents=4), fake_pool(), P, tmp_path, progress=False)
    rows = read_rows(tmp_path / "results.jsonl")
    assert len(rows) == 4 and all(r["spec"] for r in rows)
    for r in rows:
        want = baseline_spec("random", "math", n_agents=4, seed=0, prompts=P, draw=r["id"])
        assert r["spec"] == want.to_yaml() and r["agents"] == 4


def test_bad_names_are_clear_errors():
    from lemon.eval.baselines import UnknownMethodError
    from lemon.benchmarks import UnknownBenchmarkError
    with pytest.raises(UnknownMethodError, match="vanilla, cot"):
        EvalConfig(method="magic", benchmark="gsm8k")
    with pytest.raises(UnknownBenchmarkError, match="gsm8k"):
        EvalConfig(method="cot", benchmark="gsm9k")
    with pytest.raises(ValueError, match="tree needs n_agents >= 3"):
        EvalConfig(method="tree", benchmark="gsm8k", n_agents=2)


def _cli(*args, timeout=600, **kw):
    return subprocess.run([PY, "-m", "lemon", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, **kw)


@pytest.mark.parametrize("args,needle", [
    (["eval", "--method", "cot", "--benchmark", "nope", "--out", "/tmp/x"], "gsm8k"),
    (["eval", "--method", "nope", "--benchmark", "gsm8k", "--out", "/tmp/x"], "vanilla"),
    (["eval", "--method", "cot", "--benchmark", "gsm8k", "--capacity", "huge", "--out", "/tmp/x"], "small, medium, large"),
])
def test_cli_bad_input_exit_2(args, needle):
    r = _cli(*args)
    assert r.returncode == 2 and needle in r.stderr, r.stderr


def test_cli_kill_9_then_resume(tmp_path):
    """kill -9 in the middle of a run; the same command resumes: nothing lost, nothing repeated."""
    workers = tmp_path / "w.yaml"
    workers.write_text(yaml.safe_dump({c: {"backend": "fake", "model": "fake", "latency_s": 0.15}
                                       for c in ("small", "medium", "large")}))
    out = tmp_path / "run"
    cmd = [PY, "-m", "lemon", "eval", "--method", "cot", "--benchmark", "svamp", "--limit", "12", "--workers", str(workers),
           "--out", str(out), "--quiet"]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 120
    while time.time() < deadline and len(read_rows(out / "results.jsonl")) < 3:
        time.sleep(0.05)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    n_killed = len(read_rows(out / "results.jsonl"))
    assert 3 <= n_killed < 12
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rows = read_rows(out / "results.jsonl")
    assert len(rows) == 12 and len({x["id"] for x in rows}) == 12
    assert "n=12" in r.stdout


@pytest.mark.slow
def test_cli_real_model_eval_and_run(tmp_path):
    workers = tmp_path / "w.yaml"
    workers.write_text(yaml.safe_dump({**{c: {"backend": "llama_cpp", "model": "smollm2-135m"} for c in ("small", "medium", "large")},
                                       "max_tokens": {"small": 48, "medium": 48, "large": 48}}))
    r = _cli("eval", "--method", "cot", "--benchmark", "gsm8k", "--limit", "2", "--workers", str(workers),
             "--out", str(tmp_path / "e"), "--quiet")
    assert r.returncode == 0, r.stderr
    rows = read_rows(tmp_path / "e" / "results.jsonl")
    assert len(rows) == 2 and all(x["tokens"] > 0 and x["error"] is None for x in rows)
    m = json.loads((tmp_path / "e" / "manifest.json").read_text())
    assert m["workers"]["small"]["sha256"].startswith("b179c952")
    r = _cli("run", "--benchmark", "gsm8k", "--question", "Tom has 3 apples and buys 4 more. How many apples?",
             "--gold", "7", "--workers", str(workers))
    assert r.returncode == 0, r.stderr
    assert "--- spec:" in r.stdout and "=== answer:" in r.stdout and "tokens:" in r.stdout
