"""Worker-server figures (issue 12), printed, not asserted. Real shipped models, the llama-server built by
scripts/setup.sh.

  .venv/bin/python bench/server_bench.py [--only batched,threads,eval] [--questions 20] [--k 4] \
      [--out outputs/bench/servers]
  .venv/bin/python bench/server_bench.py --only step --run outputs/train-cpu-20261201/grpo_run --step 2

1. batched: aggregate tokens/s of K concurrent requests to one managed llama-server (prompt ~256 tokens, 64 generated,
   ignore_eos) vs llama.cpp's own `llama-batched-bench` S at batch K (npp 256, ntg 64), same build, same model, same -t.
   Goal: >= 0.75 of S at K = 4. llama-batched-bench is built in setup.sh's kept build folder the first time.
2. threads: the -t choice for servers sharing the cores: each server alone under K requests, then all of them at once,
   at -t 1, -t 2 and -t 2 with OMP_WAIT_POLICY=PASSIVE (issue 12: llama.cpp threads spin on barriers); wall tok/s and
   tokens per CPU-second (on a shared machine more threads also buy a bigger share of the cores).
3. eval: questions/min of `lemon eval` for CoT at large and Complete at medium on N GSM8K test questions (seeded sample,
   seed 0): the in-process llama-cpp-python backend (the default before issue 12, when the package is installed) vs the
   managed servers at --concurrency K. Goal >= 2x. Accuracy and tokens are printed too (greedy; they may differ
   slightly: continuous batching is not bit-for-bit batch-invariant).
4. step: the worker time of one recorded CF-GRPO step (--run a `lemon train` grpo_run folder, --step N): every spec that
   step sampled (kept and discarded groups) executed, then one counterfactual edit per valid rollout (edit RNG and
   family sampler as the trainer seeds them; a fresh sampler, so both arms get the same edits), through
   lemon.train.scoring with a fresh node cache: the in-process backend run sequentially (the executor before issue 12)
   vs the managed servers at the trainer's rollout concurrency.
Every figure depends on what else runs on the machine: say so when you quote one.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from lemon.run.backends import Completion, SamplingParams, usable_cores
from lemon.run.models import DEFAULT_LADDER, get_model
from lemon.run.servers import ServerConfig, ServerManager, build_info, find_binary

ROOT = Path(__file__).resolve().parents[1]
FILLER = ("The committee met on a cold morning to review the budget, the schedule, and the staffing plan for the new "
          "library branch; every member brought notes, questions, and a different idea of what mattered most. ")


class InProcess:
    """The default worker before issue 12 (lemon.run.backends.LlamaCppBackend at commit a2210de), kept here only to
    measure against: llama-cpp-python in-process, every usable core per decode, one CPU lock shared by the pool's
    handles."""

    backend, max_concurrency, supports_json_schema = "llama_cpp", 1, True

    def __init__(self, name: str, lock: threading.Lock, n_ctx: int = 4096):
        from llama_cpp import Llama
        self.model, self._lock = name, lock
        self._llm = Llama(model_path=str(get_model(name)), n_ctx=n_ctx, n_threads=usable_cores(), verbose=False)

    def chat(self, messages, params: SamplingParams) -> Completion:
        kw = {"response_format": {"type": "json_object", "schema": params.json_schema}} if params.json_schema else {}
        with self._lock:
            t0 = time.perf_counter()
            r = self._llm.create_chat_completion(messages=messages, max_tokens=params.max_tokens,
                                                 temperature=params.temperature, top_p=params.top_p, top_k=0, min_p=0.0,
                                                 seed=params.seed, stop=list(params.stop) or None, **kw)
            dt = time.perf_counter() - t0
        ch, u = r["choices"][0], r["usage"]
        return Completion(ch["message"]["content"] or "", int(u["prompt_tokens"]), int(u["completion_tokens"]), dt,
                          self.model, self.backend, ch.get("finish_reason") or "")

    def close(self):
        self._llm.close()


def batched_bench_binary() -> Path:
    """llama-batched-bench from setup.sh's build folder (same source, same flags as the server); built on first use."""
    server = find_binary()
    info = build_info(server)
    if "build_dir" not in info:
        sys.exit(f"{server} has no setup.sh build record ({server}.build); run bash scripts/setup.sh")
    build = Path(info["build_dir"])
    exe = build / "bin" / "llama-batched-bench"
    if not exe.exists():
        print(f"[batched] building llama-batched-bench in {build} ...", flush=True)
        subprocess.run(["cmake", "--build", str(build), "-j", str(os.cpu_count() or 2), "--target",
                        "llama-batched-bench"],
                       check=True, stdout=subprocess.DEVNULL)
    return exe


def batched_bench_s(model: Path, ks: list[int], threads: int, omp_wait_policy: str = "") -> dict[int, float]:
    env = {**os.environ, **({"OMP_WAIT_POLICY": omp_wait_policy} if omp_wait_policy else {})}
    out = subprocess.run([str(batched_bench_binary()), "-m", str(model), "-c", str(max(ks) * 320 + 64), "-b", "2048",
                          "-ub", "512", "-npp", "256", "-ntg", "64", "-npl", ",".join(map(str, ks)), "-t", str(threads),
                          "--output-format", "jsonl"], capture_output=True, text=True, check=True, env=env).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {int(r["pl"]): float(r["speed"]) for r in rows}


_WORDS_PER_TOKEN: dict[str, float] = {}
_IDS = itertools.count()


def prompt_of(backend, i: int, target: int = 256) -> list[dict]:
    """A user message whose chat-templated prompt is ~`target` tokens; `i` makes each prompt distinct from its first
    token (no prefix reuse across requests). The words-per-token ratio is measured once per model with a 1-token
    call."""
    words = (f"Request {i}. " + FILLER * 12).split()
    if backend.model not in _WORDS_PER_TOKEN:
        n = backend.chat([{"role": "user", "content": " ".join(words[:200])}],
                         SamplingParams(max_tokens=1)).prompt_tokens
        _WORDS_PER_TOKEN[backend.model] = 200 / n
    return [{"role": "user", "content": " ".join(words[:int(target * _WORDS_PER_TOKEN[backend.model])])}]


def load(backends_k: list[tuple[object, int]], ntg: int = 64, rounds: int = 1) -> dict:
    """Send K concurrent requests to each (backend, K) at once; aggregate (prompt + completion) tokens / wall per
    backend."""
    jobs = [(b, prompt_of(b, next(_IDS))) for b, k in backends_k for _ in range(k)]  # never a prompt seen before
    p = SamplingParams(max_tokens=ntg)
    res: dict[int, list] = {id(b): [] for b, _ in backends_k}
    with ThreadPoolExecutor(len(jobs)) as tp:
        t0 = time.perf_counter()
        futs = [(b, tp.submit(b.chat, m, p)) for _ in range(rounds) for b, m in jobs]
        for b, f in futs:
            c = f.result()
            res[id(b)].append((c, time.perf_counter() - t0))
    return {b.model: {"tok_s": sum(c.total_tokens for c, _ in res[id(b)]) / max(t for _, t in res[id(b)]),
                      "wall": max(t for _, t in res[id(b)]),
                      "prompt": sum(c.prompt_tokens for c, _ in res[id(b)]) / len(res[id(b)]),
                      "gen": sum(c.completion_tokens for c, _ in res[id(b)]) / len(res[id(b)])} for b, _ in backends_k}


def section_batched(a, log_dir: Path):
    """The server as lemon runs it (ServerConfig defaults but slots=K) vs llama-batched-bench with the same -t, run once
    with OpenMP's default (spinning) waits and once passive, as the server's default env sets."""
    model = DEFAULT_LADDER[a.capacity]
    ks = sorted({1, a.k})
    cfg = ServerConfig(threads=a.threads)
    t = cfg.threads or usable_cores()
    s_ref = {env: batched_bench_s(get_model(model), ks, t, env) for env in ("", "PASSIVE")}
    for k in ks:
        with ServerManager(log_dir / f"batched-k{k}") as m:
            m.add_shipped(model, dataclasses.replace(cfg, slots=k, ctx_per_slot=1024))
            m.start()
            b = m.backend(model, extra_body={"top_k": 0, "min_p": 0.0, "ignore_eos": True})
            load([(b, k)])  # warm-up: page in the weights, fill the slots once
            r = load([(b, k)])[model]
        ref = s_ref["PASSIVE" if dict(cfg.env).get("OMP_WAIT_POLICY") == "PASSIVE" else ""][k]
        print(f"[batched] {model} -t {t} {dict(cfg.env)}, K={k}: server {r['tok_s']:.1f} tok/s (prompt "
              f"{r['prompt']:.0f}, gen {r['gen']:.0f} per request); llama-batched-bench S {s_ref[''][k]:.1f} (OpenMP "
              f"default wait), {s_ref['PASSIVE'][k]:.1f} (OMP_WAIT_POLICY=PASSIVE) -> server / same-env S = "
              f"{r['tok_s'] / ref:.2f} (goal >= 0.75 at K=4); load avg {os.getloadavg()[0]:.1f}", flush=True)


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def section_threads(a, log_dir: Path):
    """Wall tok/s AND tokens per CPU-second: on a shared machine more threads also means a bigger share of the cores, so
    wall figures alone favour -t 2; CPU-seconds show what spinning threads waste."""
    models = [DEFAULT_LADDER[c] for c in ("small", "medium", "large")]
    # OMP_WAIT_POLICY=PASSIVE: this build's barriers are OpenMP's (`#pragma omp barrier` in ggml_barrier); passive
    # waiters sleep in a futex instead of spinning, which may rescue -t 2 when the cores are shared
    for t, env in ((1, ()), (2, ()), (2, (("OMP_WAIT_POLICY", "PASSIVE"),))):
        label = f"{t}{' OMP_WAIT_POLICY=PASSIVE' if env else ''}"
        with ServerManager(log_dir / f"threads-t{t}{'-passive' if env else ''}") as m:
            for name in models:
                m.add_shipped(name, ServerConfig(slots=a.k, ctx_per_slot=1024, threads=t, env=env))
            m.start()
            bs = {name: m.backend(name) for name in models}
            load([(bs[models[-1]], a.k)])  # warm-up
            for group in [(n,) for n in models] + [(models[1], models[2]), tuple(models)]:
                pids = {n: m.server(n).proc.pid for n in group}
                c0, l0 = {n: cpu_s(pid) for n, pid in pids.items()}, os.getloadavg()[0]
                r = load([(bs[n], a.k) for n in group])
                cpu = {n: cpu_s(pid) - c0[n] for n, pid in pids.items()}
                per = ", ".join(f"{n} {r[n]['tok_s']:.1f} tok/s ({r[n]['tok_s'] * r[n]['wall'] / cpu[n]:.1f}/cpu-s)"
                                for n in group)
                print(f"[threads] -t {label}, {' + '.join(group)}{' at once' if len(group) > 1 else ' alone'}, "
                      f"K={a.k} each: {per}; sum {sum(r[n]['tok_s'] for n in group):.1f} tok/s; load avg {l0:.1f}",
                      flush=True)


def section_eval(a, log_dir: Path):
    from lemon.eval.runner import EvalConfig, run_eval
    from lemon.prompts import default_prompts
    from lemon.run.workers import WorkerPool
    P = default_prompts()
    arms = [arm for arm in a.arms.split(",") if arm in ("in-process", "servers")]
    if "in-process" in arms:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            arms.remove("in-process")
            print("[eval] in-process arm skipped: llama-cpp-python is not installed (pip install "
                  "llama-cpp-python==0.3.36 to measure the pre-issue-12 default)", flush=True)
    cells = [tuple(c.split(":")) for c in a.cells.split(",")]
    for method, cap in cells:  # the two arms of a cell back to back: they see the same machine load, as far as possible
        for arm in arms:
            model = DEFAULT_LADDER[cap]
            if arm == "in-process":
                pool = WorkerPool({cap: InProcess(model, threading.Lock())})
                k = 1
            else:
                pool = WorkerPool.embedded_default({cap: model}, server=ServerConfig(slots=a.k, threads=a.threads),
                                                   log_dir=log_dir / f"eval-{method}-{cap}")
                k = a.k
            out = Path(tempfile.mkdtemp(prefix=f"bench-{arm}-{method}-", dir=log_dir))
            try:
                t0 = time.perf_counter()
                s = run_eval(EvalConfig(method=method, benchmark="gsm8k", split="test", limit=a.questions, seed=0,
                                        capacity=cap), pool, P, out, progress=False, concurrency=k)
                dt = time.perf_counter() - t0
            finally:
                pool.close()
            print(f"[eval] {arm:10s} {method} at {cap} ({model}), gsm8k test n={s['n']} seed 0, concurrency {k}: "
                  f"{s['n'] / dt * 60:.2f} questions/min ({dt:.0f}s), accuracy {s['accuracy']:.2f}, mean worker tokens "
                  f"{s['mean_worker_tokens']:.0f}, errors {s['errors']}", flush=True)


def section_step(a, log_dir: Path):
    from lemon import benchmarks as B
    from lemon.prompts import default_prompts
    from lemon.run.executor import ExecutorCaps, NodeCache
    from lemon.run.workers import WorkerPool
    from lemon.train.edits import FamilySampler
    from lemon.train.rewards import RewardConfig
    from lemon.train.scoring import SpecScorer
    if not a.run:
        raise SystemExit("--only step needs --run <a lemon train grpo_run folder> (and --step N)")
    run = Path(a.run)
    cfg = json.loads((run / "manifest.json").read_text())["config"]
    rows = [json.loads(x) for x in (run / "rollouts.jsonl").read_text().splitlines() if x.strip()]
    rows = [r for r in rows if r["step"] == a.step]
    if not rows:
        raise SystemExit(f"no rollouts of step {a.step} in {run}/rollouts.jsonl")
    P = default_prompts()
    max_tokens = dict(cfg["worker_max_tokens"])  # the run's per-capacity reply caps: executor caps and both pools
    examples = {e.id: e for b in cfg["benchmarks"] for e in B.pool(b, "train")}
    benches = {b: B.get_benchmark(b) for b in B.BENCHMARKS}
    caps = ExecutorCaps(max_agents=cfg["max_agents"], max_tokens=max_tokens,
                        task_token_budget=cfg["task_token_budget"])
    # character "tokens": the span mapping is exact and costs nothing; the worker work is what is timed
    items = [(r["example_id"], r["text"], [ord(c) for c in r["text"]], r["group"], r["attempt"]) for r in rows]
    print(f"[step] {run} step {a.step}: {len(items)} sampled specs ({sum(r['valid'] for r in rows)} valid), "
          f"one CF edit each (lambda {cfg['cf_lambda']}), caps {dict(caps.max_tokens)}", flush=True)
    arms = [arm for arm in a.arms.split(",") if arm in ("in-process", "servers")]
    for arm in arms:
        if arm == "in-process":
            lock = threading.Lock()  # one CPU lock shared by the pool's handles, as before issue 12
            loaded = {n: InProcess(n, lock) for n in dict.fromkeys(DEFAULT_LADDER.values())}
            pool = WorkerPool({c: loaded[n] for c, n in DEFAULT_LADDER.items()},
                              {c: SamplingParams(max_tokens=max_tokens[c]) for c in DEFAULT_LADDER})
            k = 1
        else:
            pool = WorkerPool.embedded_default(max_tokens=max_tokens, server=ServerConfig(slots=a.k, threads=a.threads),
                                               log_dir=log_dir / "step")
            k = cfg["rollout_concurrency"]
        scorer = SpecScorer(pool, P, examples, benches, reward=RewardConfig(**cfg["reward"]), caps=caps,
                            cache=NodeCache(), sampler=FamilySampler(floor=cfg["family_floor"]),
                            cf_lambda=cfg["cf_lambda"], families=tuple(cfg["cf_families"]),
                            max_agents=cfg["max_agents"], seed=cfg["seed"], concurrency=k,
                            worker_seed_per_step=cfg["worker_seed_per_step"])
        try:
            t0 = time.perf_counter()
            rolls = scorer.score(items, a.step)
            t1 = time.perf_counter()
            scorer.add_counterfactuals(rolls, a.step, lambda ids: "".join(map(chr, ids)))
            t2 = time.perf_counter()
        finally:
            pool.close()
        ok = sum(r.cf_status == "ok" for r in rolls)
        print(f"[step] {arm:10s} concurrency {k}: rollouts {t1 - t0:.0f} s + CF re-execution {t2 - t1:.0f} s = "
              f"{t2 - t0:.0f} s worker time; {sum(r.tokens_spent for r in rolls)} + "
              f"{sum(r.cf_tokens_spent for r in rolls)} tokens; success "
              f"{sum(r.reward.success for r in rolls if r.valid)}/{sum(r.valid for r in rolls)}, CF deltas {ok}, "
              f"errored {sum(r.errored for r in rolls)}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="batched,threads,eval", help="comma-separated sections to run")
    ap.add_argument("--questions", type=int, default=20)
    ap.add_argument("--k", type=int, default=4, help="concurrent requests / questions in flight / server slots")
    ap.add_argument("--threads", type=int, default=None,
                    help="-t of the servers in batched and eval (default: ServerConfig's)")
    ap.add_argument("--capacity", default="large", help="the model of the batched section")
    ap.add_argument("--cells", default="cot:large,complete:medium", help="method:capacity cells of the eval section")
    ap.add_argument("--arms", default="in-process,servers", help="arms of the eval section")
    ap.add_argument("--out", default=None, help="folder for server logs and eval rows (default: a temp dir)")
    ap.add_argument("--run", default=None,
                    help="step section: a `lemon train` grpo_run folder (manifest + rollouts.jsonl)")
    ap.add_argument("--step", type=int, default=2, help="step section: which recorded step to re-execute")
    a = ap.parse_args()
    log_dir = Path(a.out or tempfile.mkdtemp(prefix="lemon-server-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    binary = find_binary()
    print(f"llama-server {binary} build: {build_info(binary).get('key', '?')}\nlogs and rows: {log_dir}; cores "
          f"{usable_cores()}; load average {os.getloadavg()[0]:.2f} at start", flush=True)
    for name, fn in (("batched", section_batched), ("threads", section_threads), ("eval", section_eval),
                     ("step", section_step)):
        if name in a.only.split(","):
            fn(a, log_dir)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    if not a.out:
        shutil.rmtree(log_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
