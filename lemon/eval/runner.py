"""The eval runner: one method (a baseline, a spec file, or the orchestrator) on one benchmark split, resumable.

Rows are appended to `results.jsonl` and fsync'ed one by one, so a run killed at any moment (kill -9 included) loses at
most the example in flight; the same command resumes, skipping finished ids and repairing a torn last line. A run folder
belongs to one config: resuming with a different config is refused rather than mixing two experiments in one file.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass
from pathlib import Path

from lemon.progress import bar as tqdm

from lemon import benchmarks as B
from lemon.eval.baselines import BASELINES, UnknownMethodError, example_spec, run_baseline
from lemon.run.executor import ExecutorCaps, NodeCache, Trace, execute
from lemon.manifest import build_manifest, write_json
from lemon.report import portable
from lemon.eval.orchestrator import OrchestratorConfig, PoolSpecWriter
from lemon.prompts import Prompts
from lemon.spec import parse_spec

METHODS_HELP = f"one of {', '.join(BASELINES)}, 'orchestrator', or a path to a spec .yaml file"


@dataclass(frozen=True)
class EvalConfig:
    """One evaluation run (`python -m lemon eval`)."""

    method: str
    """A baseline name, 'orchestrator' (prompted, untrained) or a path to a spec YAML file."""
    benchmark: str
    """One of the six benchmark names."""
    split: str = "test"
    """Data split (see lemon.benchmarks.SPLITS)."""
    limit: int | None = None
    """Evaluate a seeded subsample of this many examples (None = the whole split)."""
    seed: int = 0
    """Seeds the subsample and every worker call."""
    capacity: str = "medium"
    """Capacity of the baseline agents."""
    n_agents: int = 4
    """Agents in the multi-agent baselines (chain / tree / complete / random)."""
    k: int = 5
    """Samples for SC-CoT."""

    def __post_init__(self):
        if (self.method not in BASELINES and self.method != "orchestrator"
                and not self.method.endswith((".yaml", ".yml"))):
            raise UnknownMethodError(f"unknown method {self.method!r}; use {METHODS_HELP}")
        B.get_benchmark(self.benchmark)  # raises UnknownBenchmarkError listing the valid names
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit={self.limit} must be >= 1 (or None for the whole split)")
        if self.k < 1 or self.n_agents < 1:
            raise ValueError("k and n_agents must be >= 1")
        lo = {"chain": 2, "complete": 2, "random": 2, "tree": 3}.get(self.method, 1)
        if self.n_agents < lo:
            raise ValueError(f"{self.method} needs n_agents >= {lo} (the final agent included), got {self.n_agents}")


def wilson_ci(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval for a proportion (better than the normal interval at small n or p near 0/1)."""
    if n == 0:
        return (0.0, 0.0)
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (max(0.0, c - h), min(1.0, c + h))


def read_rows(path: Path) -> list[dict]:
    """Rows of a results.jsonl; a torn last line (the process was killed mid-write) is cut off the file."""
    if not path.exists():
        return []
    rows, good = [], 0
    with open(path, "rb") as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                break
            good += len(line)
    if good != path.stat().st_size:
        with open(path, "r+b") as f:
            f.truncate(good)
    return rows


def _append(path: Path, row: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())


def summarize(rows: list[dict]) -> dict:
    n = len(rows)
    k = sum(1 for r in rows if r["correct"])
    lo, hi = wilson_ci(k, n)
    mean = lambda key: (sum(r[key] for r in rows) / n) if n else 0.0  # noqa: E731
    return {"n": n, "correct": k, "accuracy": k / n if n else 0.0, "ci95": [lo, hi],
            "mean_worker_tokens": mean("tokens"), "mean_nominal_tokens": mean("nominal_tokens"),
            "mean_latency_s": mean("latency_s"), "errors": sum(1 for r in rows if r.get("error")),
            "invalid_specs": sum(1 for r in rows if r.get("spec_error"))}


def run_eval(cfg: EvalConfig, pool, prompts: Prompts, out: Path, *, caps: ExecutorCaps | None = None,
             orch: OrchestratorConfig | None = None, writer=None, examples=None, progress: bool = True,
             concurrency: int = 1) -> dict:
    """Evaluate, appending to out/results.jsonl; returns the summary (also written to out/summary.json).
    method 'orchestrator' uses `writer` (an object with .propose(task, domain, prompts, seed) -> SpecProposal, e.g.
    lemon.eval.orchestrator.PolicySpecWriter for the trained LEMON policy); without one, the prompted PoolSpecWriter.
    `examples` overrides the loaded split (e.g. an eval pool); otherwise load(benchmark, split, limit, seed).

    `concurrency` = questions in flight (threads). Rows are appended as questions finish (file order = completion order;
    one row per id either way), so a kill loses at most the `concurrency` questions in flight, and a resume redoes
    exactly those. Every question's seeds and cache keys depend on the question alone, never on timing, so rows and
    token totals do not depend on `concurrency` for a deterministic pool. The spec writer is called under a lock (a
    transformers policy seeds torch globally per call); worker calls overlap, bounded per backend by its
    max_concurrency."""
    if not isinstance(concurrency, int) or concurrency < 1:
        raise ValueError(f"concurrency={concurrency!r} must be a positive int (questions in flight)")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    caps = caps or ExecutorCaps()
    bench = B.get_benchmark(cfg.benchmark)
    if examples is None:
        examples = B.load(cfg.benchmark, cfg.split, limit=cfg.limit, seed=cfg.seed)
    elif cfg.limit is not None:
        examples = examples[:cfg.limit]
    if cfg.method == "orchestrator":  # only then: a baseline's pool need not hold the orchestrator's capacity
        writer = writer or PoolSpecWriter(pool, orch or OrchestratorConfig())
    fixed_spec = None
    if cfg.method.endswith((".yaml", ".yml")):
        fixed_spec = parse_spec(Path(cfg.method).read_text(), base_roles=prompts.roles_for(bench.domain))
    config = {"eval": asdict(cfg), "caps": asdict(caps), "orchestrator": asdict(orch or OrchestratorConfig()),
              "writer": writer.name if cfg.method == "orchestrator" else None,
              "example_ids_sha256": hashlib.sha256("\n".join(e.id for e in examples).encode()).hexdigest()}
    mpath = out / "manifest.json"
    if mpath.exists():
        old = json.loads(mpath.read_text())
        if json.loads(json.dumps(old.get("config"), default=str)) != json.loads(json.dumps(config, default=str)):
            raise ValueError(f"{out} holds a run with a different config; resume only with the same one or pick "
                             f"another --out\n  old: {old.get('config')}\n  new: {config}")
    else:
        data_dir = B.resolve_data_dir()
        write_json(mpath, build_manifest(config, prompts_sha256=prompts.sha256, workers=pool.describe(),
                                         data_files=([Path(data_dir) / cfg.benchmark / f"{cfg.split}.jsonl"]
                                                     if data_dir else []),
                                         seeds={"eval": cfg.seed}, extra={"concurrency": concurrency}))
    rpath = out / "results.jsonl"
    rows = read_rows(rpath)
    done = {r["id"] for r in rows}
    cache = NodeCache(path=out / "node_cache.jsonl")
    todo = [e for e in examples if e.id not in done]
    t0 = time.perf_counter()
    bar = tqdm(total=len(examples), initial=len(done), desc=f"{cfg.method} {cfg.benchmark}/{cfg.split}",
               disable=not progress)
    locked_writer = _LockedWriter(writer) if writer is not None else None

    def finish(row: dict) -> None:  # main thread only: one writer of results.jsonl
        _append(rpath, row)
        rows.append(row)
        s = summarize(rows)
        bar.update(1)
        bar.set_postfix(acc=f"{s['accuracy']:.3f}", tok=f"{s['mean_worker_tokens']:.0f}")

    one = lambda ex: _evaluate_one(cfg, ex, bench, pool, prompts, caps, locked_writer, cache, fixed_spec)  # noqa: E731
    try:
        if concurrency == 1:
            for ex in todo:
                finish(one(ex))
        else:
            tp, pending, it = (ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="lemon-eval"), set(),
                               iter(todo))
            try:
                for ex in itertools.islice(it, concurrency):  # keep exactly `concurrency` questions in flight
                    pending.add(tp.submit(one, ex))
                while pending:
                    finished, pending = wait(pending, return_when=FIRST_COMPLETED)
                    for f in finished:
                        finish(f.result())  # an exception (e.g. BackendUnavailableError) stops the run here
                    for ex in itertools.islice(it, len(finished)):
                        pending.add(tp.submit(one, ex))
            finally:  # on an error or Ctrl-C: start nothing more and do not wait; questions in flight are dropped
                tp.shutdown(wait=not pending, cancel_futures=True)
    finally:
        bar.close()
    spath = out / "summary.json"
    old_summary = json.loads(spath.read_text()) if spath.exists() else {}
    if not todo and old_summary.get("n") == len(rows):
        # A resume with nothing left to do keeps the summary of the calls that produced the rows: rewriting it would
        # replace their wall time and server description with this no-op call's (~0 s, fresh ports). The statistics are
        # recomputed from the rows, so a summary written by an older version still returns every current key.
        return {**old_summary, **summarize(rows)}
    wall = time.perf_counter() - t0
    summary = {**summarize(rows), "method": cfg.method, "benchmark": cfg.benchmark, "split": cfg.split,
               "seed": cfg.seed, "concurrency": concurrency, "wall_s_this_call": wall,
               "wall_s_total": old_summary.get("wall_s_total", old_summary.get("wall_s_this_call", 0.0)) + wall,
               "workers": portable(pool.describe()), "prompts_sha256": prompts.sha256}
    write_json(spath, summary)
    return summary


class _LockedWriter:
    """A spec writer called one question at a time (see run_eval)."""

    def __init__(self, writer):
        self.writer, self.name, self._lock = writer, writer.name, threading.Lock()

    def propose(self, *a, **kw):
        with self._lock:
            return self.writer.propose(*a, **kw)


def _evaluate_one(cfg, ex, bench, pool, prompts, caps, writer, cache, fixed_spec) -> dict:
    t0 = time.perf_counter()
    spec_text, spec_error, orch_tokens = None, None, 0
    if cfg.method in BASELINES:
        trace = run_baseline(cfg.method, ex, bench, pool, prompts=prompts, capacity=cfg.capacity, n_agents=cfg.n_agents,
                             k=cfg.k, seed=cfg.seed, cache=cache, caps=caps)
        if cfg.method == "random":  # the DAG differs per question: keep the one that ran
            spec_text = example_spec("random", ex, bench.domain, prompts=prompts, capacity=cfg.capacity,
                                     n_agents=cfg.n_agents, seed=cfg.seed).to_yaml()
    else:
        spec = fixed_spec
        if spec is None:  # the prompted orchestrator writes one spec per task
            prop = writer.propose(ex.question, bench.domain, prompts, seed=cfg.seed)
            spec_text, spec, spec_error = prop.text, prop.spec, prop.error
            orch_tokens = prop.prompt_tokens + prop.completion_tokens
        trace = execute(spec, ex, bench, pool, prompts=prompts, cache=cache, caps=caps, seed=cfg.seed) if spec else None
        spec_text = spec_text or (spec.to_yaml() if spec else None)
    if trace is None:
        trace = Trace.empty(error=f"invalid spec: {spec_error}")
    return {"id": ex.id, "method": cfg.method, "benchmark": ex.benchmark, "split": ex.split, "spec": spec_text,
            "spec_error": spec_error, "answer": trace.answer, "gold": ex.gold if ex.benchmark != "humaneval" else None,
            "correct": bool(trace.score >= 1.0), "score": trace.score, "tokens": trace.tokens,
            "nominal_tokens": trace.nominal_tokens, "orchestrator_tokens": orch_tokens,
            "cache_hits": sum(1 for a in trace.agents if a.cache_hit), "agents": len(trace.agents),
            "latency_s": time.perf_counter() - t0, "error": trace.error, "output": trace.output}
