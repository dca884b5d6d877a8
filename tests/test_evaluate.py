"""The eval runner and CLI: resumable after kill -9 (also with --concurrency), one config per run folder, clear errors
for bad names, rows / tokens / cache / seeds independent of concurrency, a dead backend never scored."""
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from lemon import benchmarks as LB
from lemon.eval.baselines import baseline_spec
from lemon.eval.runner import EvalConfig, read_rows, run_eval, wilson_ci
from lemon.prompts import default_prompts
from lemon.run.executor import execute
from lemon.run.workers import BackendUnavailableError, FakeBackend, TokenMeter, WorkerPool

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
    # rerun: nothing repeated, nothing lost, and the no-op call leaves the summary (wall time, servers) as it was
    before = (tmp_path / "summary.json").read_text()
    s2 = run_eval(cfg, fake_pool(), P, tmp_path, progress=False)
    assert s2["n"] == 3 and len(read_rows(tmp_path / "results.jsonl")) == 3
    assert (tmp_path / "summary.json").read_text() == before and s2["wall_s_total"] == s["wall_s_this_call"]
    # a call that adds rows (here: one dropped by hand) accumulates wall time over the calls
    lines = (tmp_path / "results.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "results.jsonl").write_text("".join(lines[:2]))
    s3 = run_eval(cfg, fake_pool(), P, tmp_path, progress=False)
    assert s3["n"] == 3 and s3["wall_s_total"] == pytest.approx(s["wall_s_this_call"] + s3["wall_s_this_call"])
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
    s = run_eval(EvalConfig(method=str(spec), benchmark="gsm8k", limit=2), fake_pool(), P, tmp_path / "f",
                 progress=False)
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
    run_eval(EvalConfig(method="random", benchmark="gsm8k", limit=4, n_agents=4), fake_pool(), P, tmp_path,
             progress=False)
    rows = read_rows(tmp_path / "results.jsonl")
    assert len(rows) == 4 and all(r["spec"] for r in rows)
    for r in rows:
        want = baseline_spec("random", "math", n_agents=4, seed=0, prompts=P, draw=r["id"])
        assert r["spec"] == want.to_yaml() and r["agents"] == 4


def _echo(messages, params):
    """Deterministic and prompt-dependent (so any upstream change shows), with a real answer for some questions."""
    h = hashlib.sha256((messages[-1]["content"] + str(params.seed)).encode()).hexdigest()
    return f"thinking {h[:6]} " * (1 + int(h[0], 16) % 4) + f"Answer: {int(h[:2], 16) % 3}"


def _rows_without_timing(path):
    return sorted(({k: v for k, v in r.items() if k != "latency_s"} for r in read_rows(path)), key=lambda r: r["id"])


@pytest.mark.parametrize("method", ["complete", "sc-cot", "random"])
def test_concurrency_gives_the_same_rows_tokens_and_cache(tmp_path, method):
    """K=1 and K=4 questions in flight: the same rows (but their order), the same token totals, the same node-cache
    entries. The fake sleeps so that questions really overlap."""
    P = default_prompts()
    cfg = EvalConfig(method=method, benchmark="svamp", split="test", limit=8, seed=3, n_agents=3, k=3)
    runs = {}
    for k in (1, 4):
        f = FakeBackend(_echo, latency_s=0.01)
        s = run_eval(cfg, WorkerPool({c: f for c in ("small", "medium", "large")}), P, tmp_path / f"k{k}",
                     progress=False, concurrency=k)
        cache = sorted((tmp_path / f"k{k}" / "node_cache.jsonl").read_text().splitlines())
        runs[k] = (_rows_without_timing(tmp_path / f"k{k}" / "results.jsonl"), s["mean_worker_tokens"], cache,
                   len(f.calls))
    assert runs[1] == runs[4] and len(runs[1][0]) == 8


def test_token_meter_is_exact_with_concurrent_executions():
    """Executions of several questions in threads add to one TokenMeter: the totals equal the traces' own sums."""
    P, bench, exs = default_prompts(), LB.get_benchmark("gsm8k"), LB.load("gsm8k", "test", limit=12, seed=0)
    f = FakeBackend(_echo, latency_s=0.005)
    pool, meter, spec = WorkerPool({c: f for c in ("small", "medium", "large")}), TokenMeter(), \
        baseline_spec("tree", "math", n_agents=4)
    with ThreadPoolExecutor(6) as tp:
        traces = list(tp.map(lambda e: execute(spec, e, bench, pool, prompts=P, meter=meter), exs))
    alone = [execute(spec, e, bench, pool, prompts=P) for e in exs]
    t = meter.totals()["total"]
    assert t["total_tokens"] == sum(x.tokens for x in traces) == sum(x.tokens for x in alone)
    assert t["calls"] == 4 * len(exs) and [x.output for x in traces] == [x.output for x in alone]


@pytest.mark.parametrize("k", [1, 3])
def test_dead_backend_stops_the_run_and_is_never_scored(tmp_path, k):
    """A BackendUnavailableError (dead server after retries) stops run_eval; no row is written for the questions it hit,
    and the resume (server back) finishes them: nothing is scored 0 because a server died."""
    P = default_prompts()
    cfg = EvalConfig(method="cot", benchmark="gsm8k", limit=6, seed=0)
    dead = {"on": True}
    target = LB.load("gsm8k", "test", limit=6, seed=0)[3].question  # the 4th question meets a dead server

    def reply(messages, params):
        if dead["on"] and target in messages[-1]["content"]:
            raise BackendUnavailableError("openai http://x/v1 (m): unavailable after 4 attempts")
        return "Answer: 1"
    pool = WorkerPool({c: FakeBackend(reply, latency_s=0.01) for c in ("small", "medium", "large")})
    with pytest.raises(BackendUnavailableError):
        run_eval(cfg, pool, P, tmp_path, progress=False, concurrency=k)
    rows = read_rows(tmp_path / "results.jsonl")
    assert len(rows) < 6 and all(r["error"] is None for r in rows)
    assert target not in {r.get("question") for r in rows} and len({r["id"] for r in rows}) == len(rows)
    dead["on"] = False
    s = run_eval(cfg, pool, P, tmp_path, progress=False, concurrency=k)
    rows = read_rows(tmp_path / "results.jsonl")
    assert s["n"] == 6 == len({r["id"] for r in rows}) == len(rows) and s["errors"] == 0


def test_concurrency_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="concurrency"):
        run_eval(EvalConfig(method="cot", benchmark="gsm8k", limit=1), fake_pool(), default_prompts(), tmp_path,
                 progress=False, concurrency=0)


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
    (["eval", "--method", "cot", "--benchmark", "gsm8k", "--capacity", "huge", "--out", "/tmp/x"],
     "small, medium, large"),
])
def test_cli_bad_input_exit_2(args, needle):
    r = _cli(*args)
    assert r.returncode == 2 and needle in r.stderr, r.stderr


@pytest.mark.parametrize("concurrency", ["1", "4"])
def test_cli_kill_9_then_resume(tmp_path, concurrency):
    """kill -9 in the middle of a run (with 1 or 4 questions in flight); the same command resumes: nothing lost, nothing
    repeated."""
    workers = tmp_path / "w.yaml"
    workers.write_text(yaml.safe_dump({c: {"backend": "fake", "model": "fake", "latency_s": 0.15}
                                       for c in ("small", "medium", "large")}))
    out = tmp_path / "run"
    cmd = [PY, "-m", "lemon", "eval", "--method", "cot", "--benchmark", "svamp", "--limit", "12", "--workers",
           str(workers), "--out", str(out), "--quiet", "--concurrency", concurrency]
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
def test_cli_sigterm_stops_servers(tmp_path):
    """SIGTERM to `lemon eval` on managed llama-servers: exit 143, the server gone, finished rows kept."""
    import re
    workers = tmp_path / "w.yaml"
    workers.write_text(yaml.safe_dump({**{c: {"backend": "llama_server", "model": "smollm2-135m", "slots": 2,
                                              "ctx_per_slot": 2048} for c in ("small", "medium", "large")},
                                       "max_tokens": {c: 48 for c in ("small", "medium", "large")}}))
    out = tmp_path / "run"
    cmd = [PY, "-m", "lemon", "eval", "--method", "chain", "--n-agents", "2", "--benchmark", "svamp", "--limit", "30",
           "--workers", str(workers), "--out", str(out), "--quiet", "--concurrency", "2"]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and len(read_rows(out / "results.jsonl")) < 2:
        time.sleep(0.2)
    log = (out / "servers" / "smollm2-135m.log").read_text()
    pid = int(re.findall(r"===== lemon: pid (\d+)", log)[-1])
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=120) == 143
    for _ in range(100):  # close() stopped it (SIGTERM, then SIGKILL after 10 s at worst)
        if not Path(f"/proc/{pid}").exists():
            break
        time.sleep(0.2)
    assert not Path(f"/proc/{pid}").exists(), "llama-server outlived `lemon eval`"
    rows = read_rows(out / "results.jsonl")
    # finished rows kept (resume: kill -9 test)
    assert 2 <= len(rows) < 30 and len({r["id"] for r in rows}) == len(rows)


@pytest.mark.slow
def test_cli_real_model_eval_and_run(tmp_path):
    workers = tmp_path / "w.yaml"
    workers.write_text(yaml.safe_dump({**{c: {"backend": "llama_cpp", "model": "smollm2-135m"}
                                          for c in ("small", "medium", "large")},
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
