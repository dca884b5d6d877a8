"""Executor figures (issue 3 §5), printed, not asserted. Real shipped models through llama.cpp; numbers are noisy on a
shared 2-core machine, so each figure says what it measured.

  .venv/bin/python bench/executor_bench.py [--questions 4] [--edits 100] [--max-tokens 48]

1. overhead: wall time of execute() minus the summed backend latency, for baseline specs run on ONE shared 135M handle
   (agents serialise on its lock, so wall = backend time + executor overhead).
2. concurrency: questions/minute for a 4-agent Tree spec (two leaves on different models can overlap) and a 4-agent Complete
   spec (a total order: nothing can overlap), run with the level's agents concurrently vs one at a time.
3. node cache: worker tokens to re-run random single-field edits of executed specs, with the cache vs without it (the
   cacheless cost is the edited spec's nominal tokens: every agent re-run).
"""
from __future__ import annotations

import argparse
import random
import time

from lemon import benchmarks as B
from lemon.baselines import baseline_spec
from lemon.edits import sample_edit
from lemon.executor import ExecutorCaps, NodeCache, execute
from lemon.prompts import default_prompts
from lemon.sft import mutated_baseline
from lemon.workers import LlamaCppBackend, WorkerPool


class Sequential:
    """Wraps a backend so the executor sees max_concurrency 1 (for the sequential arm of the concurrency figure)."""

    def __init__(self, b):
        self.b, self.model, self.max_concurrency, self.backend = b, b.model, 1, getattr(b, "backend", "llama_cpp")

    def chat(self, m, p):
        return self.b.chat(m, p)

    def close(self):
        pass


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("--edits", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=48)
    a = ap.parse_args()
    P = default_prompts()
    bench = B.get_benchmark("gsm8k")
    qs = B.load("gsm8k", "test", limit=a.questions, seed=0)
    caps = ExecutorCaps(max_tokens={c: a.max_tokens for c in ("small", "medium", "large")})

    # 1. overhead on one shared handle
    small = LlamaCppBackend.shipped("smollm2-135m")
    pool = WorkerPool({c: small for c in ("small", "medium", "large")})
    wall = backend = 0.0
    for name in ("chain", "tree", "complete", "random"):
        spec = baseline_spec(name, "math", n_agents=4)
        for ex in qs:
            tr = execute(spec, ex, bench, pool, prompts=P, caps=caps)
            wall += tr.wall_s
            backend += tr.worker_latency_s
    print(f"[overhead] {4 * len(qs)} executions (chain/tree/complete/random x {len(qs)} gsm8k test q, 135M, "
          f"max_tokens {a.max_tokens}): wall {wall:.1f}s, backend {backend:.1f}s, overhead {wall - backend:.2f}s = "
          f"{100 * (wall - backend) / wall:.2f}% (goal <= 3%)")

    # 2. concurrency: distinct models per capacity (each llama.cpp handle runs one sequence at a time)
    ladder = {c: LlamaCppBackend.shipped(m) for c, m in (("small", "smollm2-135m"), ("medium", "qwen2.5-coder-0.5b"))}
    ladder["large"] = ladder["medium"]
    for name in ("tree", "complete"):
        base = baseline_spec(name, "math", n_agents=4, capacity="small")
        # leaves alternate small / medium so two leaves can run on two different handles at once
        d = base.to_dict()
        for i, ag in enumerate(d["agents"][:-1]):
            ag["capacity"] = ("small", "medium")[i % 2]
        from lemon.spec import spec_from_dict
        spec = spec_from_dict(d)
        for label, backends in (("concurrent", ladder), ("sequential", {c: Sequential(b) for c, b in ladder.items()})):
            p = WorkerPool(dict(backends))
            t0 = time.perf_counter()
            for ex in qs:
                execute(spec, ex, bench, p, prompts=P, caps=caps, cache=None)
            dt = time.perf_counter() - t0
            print(f"[concurrency] {name} 4 agents, leaves on 135M/0.5B, {label}: {len(qs) / dt * 60:.2f} questions/min "
                  f"({dt:.1f}s for {len(qs)})")

    # 3. node cache: random single-field edits of executed specs
    rng = random.Random(0)
    cache = NodeCache()
    spent = nominal = n = 0
    specs = [(mutated_baseline("math", ex.question, P, rng, 4), ex) for ex in qs]
    for spec, ex in specs:
        execute(spec, ex, bench, pool, prompts=P, caps=caps, cache=cache)
    while n < a.edits:
        spec, ex = rng.choice(specs)
        e = sample_edit(spec, P, rng)
        if e is None:
            continue
        tr = execute(e.spec, ex, bench, pool, prompts=P, caps=caps, cache=cache)
        spent += tr.tokens
        nominal += tr.nominal_tokens
        n += 1
    print(f"[cache] {n} random single-field edits of {len(specs)} mutated-baseline specs (135M, max_tokens {a.max_tokens}): "
          f"worker tokens with cache {spent}, without {nominal} ({100 * spent / max(1, nominal):.1f}% of cacheless; "
          f"edits repeat across draws, so later repeats are free too)")
    small.close()
    for b in {id(b): b for b in ladder.values()}.values():
        b.close()


if __name__ == "__main__":
    main()
