"""Executor figures (issue 3 §5), printed, not asserted. Real shipped models through llama.cpp; numbers are noisy on a
shared 2-core machine, so each figure says what it measured.

  .venv/bin/python bench/executor_bench.py [--questions 4] [--edits 100] [--max-tokens 48] \
      [--only overhead,concurrency,cache]

1. overhead: wall time of execute() minus the summed backend latency, for baseline specs run on ONE managed 135M
   llama-server with one slot (agents queue for it, so wall = backend time + executor overhead).
2. concurrency: questions/minute for a 4-agent Tree spec (leaves on two different models can overlap) and a 4-agent
   Complete spec (a total order: nothing can overlap) on managed llama-servers (135M and 0.5B), with 4 slots per server
   (a level's agents decode together) vs 1 slot (one at a time per server). The in-process designs this section compared
   before issue 12 are gone with the in-process backend (LOG.md, session 2, has their figures).
3. node cache: worker tokens to re-run random single-field edits of executed specs, with the cache vs without it (the
   cacheless cost is the edited spec's nominal tokens: every agent re-run).
"""
from __future__ import annotations

import argparse
import random
import time

from lemon import benchmarks as B
from lemon.eval.baselines import baseline_spec
from lemon.train.edits import sample_edit
from lemon.run.executor import ExecutorCaps, NodeCache, execute
from lemon.prompts import default_prompts
from lemon.train.sft import mutated_baseline
from lemon.run.servers import ServerConfig
from lemon.run.workers import WorkerPool


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("--edits", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--only", default="overhead,concurrency,cache", help="comma-separated sections to run")
    a = ap.parse_args()
    only = set(a.only.split(","))
    P = default_prompts()
    bench = B.get_benchmark("gsm8k")
    qs = B.load("gsm8k", "test", limit=a.questions, seed=0)
    caps = ExecutorCaps(max_tokens={c: a.max_tokens for c in ("small", "medium", "large")})

    # 1. overhead on one shared one-slot server
    pool = WorkerPool.embedded_default({c: "smollm2-135m" for c in ("small", "medium", "large")},
                                       server=ServerConfig(slots=1, ctx_per_slot=4096))
    wall = backend = 0.0
    for name in ("chain", "tree", "complete", "random") if "overhead" in only else ():
        spec = baseline_spec(name, "math", n_agents=4)
        for ex in qs:
            tr = execute(spec, ex, bench, pool, prompts=P, caps=caps)
            wall += tr.wall_s
            backend += tr.worker_latency_s
    if "overhead" in only:
        print(f"[overhead] {4 * len(qs)} executions (chain/tree/complete/random x {len(qs)} gsm8k test q, 135M, "
              f"max_tokens {a.max_tokens}): wall {wall:.1f}s, backend {backend:.1f}s, overhead {wall - backend:.2f}s = "
              f"{100 * (wall - backend) / wall:.2f}% (goal <= 3%)", flush=True)

    # 2. concurrency: distinct models per capacity, several slots per server vs one
    if "concurrency" in only:
        from lemon.spec import spec_from_dict
        ladder = {"small": "smollm2-135m", "medium": "qwen2.5-coder-0.5b", "large": "qwen2.5-coder-0.5b"}
        for name in ("tree", "complete"):
            d = baseline_spec(name, "math", n_agents=4, capacity="small").to_dict()
            for i, ag in enumerate(d["agents"][:-1]):  # leaves alternate small / medium: two servers can overlap
                ag["capacity"] = ("small", "medium")[i % 2]
            spec = spec_from_dict(d)
            for slots in (4, 1):
                with WorkerPool.embedded_default(ladder, server=ServerConfig(slots=slots, ctx_per_slot=4096)) as p:
                    t0 = time.perf_counter()
                    for ex in qs:
                        execute(spec, ex, bench, p, prompts=P, caps=caps, cache=None)
                    dt = time.perf_counter() - t0
                print(f"[concurrency] {name} 4 agents, leaves on 135M/0.5B, {slots} slot(s) per server: "
                      f"{len(qs) / dt * 60:.2f} questions/min ({dt:.1f}s for {len(qs)})", flush=True)

    # 3. node cache: random single-field edits of executed specs
    if "cache" not in only:
        pool.close()
        return
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
    print(f"[cache] {n} random single-field edits of {len(specs)} mutated-baseline specs (135M, max_tokens "
          f"{a.max_tokens}): worker tokens with cache {spent}, without {nominal} ({100 * spent / max(1, nominal):.1f}% "
          f"of cacheless; edits repeat across draws, so later repeats are free too)")
    pool.close()


if __name__ == "__main__":
    main()
