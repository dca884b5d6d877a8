"""Command line: `python -m lemon {eval,run,train,data,plan-gpu}`. Errors from bad input are printed as one clear line
(exit 2)."""
from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

from lemon import benchmarks as B
from lemon.benchmarks import Example
from lemon.eval.baselines import baseline_spec
from lemon.eval.orchestrator import propose_spec
from lemon.eval.runner import EvalConfig, run_eval
from lemon.prompts import CAPACITIES, load_prompts
from lemon.run import gpuplan
from lemon.run.backends import BackendUnavailableError
from lemon.run.executor import execute
from lemon.run.workers import WorkerPool, load_worker_config
from lemon.spec import parse_spec
from lemon.study.config import train_sft_preset
from lemon.study.profiles import parse_sets
from lemon.train import pipeline  # called as pipeline.train / pipeline.warm_start (tests patch them there)


def _pool(args, log_dir: Path | None = None):
    """--workers YAML, else the embedded default (one managed llama-server per shipped model, logs in `log_dir`)."""
    if args.workers:
        return WorkerPool.from_config(load_worker_config(args.workers), log_dir=log_dir)
    return WorkerPool.embedded_default(log_dir=log_dir)


def _sigterm_as_exit(signum, frame):
    """SIGTERM unwinds like Ctrl-C, so `finally: pool.close()` stops the servers in order (PR_SET_PDEATHSIG in
    lemon.run.servers still kills them if we die harder); exit status 143 = 128 + SIGTERM."""
    raise SystemExit(128 + signum)


def cmd_eval(args) -> int:
    cfg = EvalConfig(method=args.method, benchmark=args.benchmark, split=args.split, limit=args.limit, seed=args.seed,
                     capacity=args.capacity, n_agents=args.n_agents, k=args.k)
    prompts = load_prompts(args.prompts)
    pool = _pool(args, log_dir=Path(args.out) / "servers")
    try:
        s = run_eval(cfg, pool, prompts, Path(args.out), progress=not args.quiet, concurrency=args.concurrency)
    finally:
        pool.close()
    lo, hi = s["ci95"]
    print(f"{cfg.method} on {cfg.benchmark}/{cfg.split} (n={s['n']}, seed={cfg.seed}): accuracy {s['accuracy']:.3f} "
          f"[95% CI {lo:.3f}-{hi:.3f}], mean worker tokens {s['mean_worker_tokens']:.0f}, errors {s['errors']}; "
          f"rows in {Path(args.out) / 'results.jsonl'}")
    return 0


def cmd_run(args) -> int:
    bench = B.get_benchmark(args.benchmark)
    prompts = load_prompts(args.prompts)
    ex = Example(id="cli/0", benchmark=args.benchmark, split="cli", question=args.question, gold=args.gold or "",
                 meta={})
    pool = _pool(args)
    try:
        if args.spec:
            spec = parse_spec(Path(args.spec).read_text(), base_roles=prompts.roles_for(bench.domain))
        elif args.orchestrator:
            prop = propose_spec(pool, args.question, bench.domain, prompts, seed=args.seed)
            print("--- orchestrator wrote:\n" + prop.text)
            if prop.spec is None:
                print(f"invalid spec: {prop.error}", file=sys.stderr)
                return 1
            spec = prop.spec
        else:
            spec = baseline_spec("chain", bench.domain, capacity=args.capacity, n_agents=3, seed=args.seed)
        print("--- spec:\n" + spec.to_yaml())
        tr = execute(spec, ex, bench, pool, prompts=prompts, seed=args.seed)
    finally:
        pool.close()
    for a in tr.agents:
        print(f"--- {a.id} [{a.capacity} = {a.model}] {a.prompt_tokens}+{a.completion_tokens} tokens, "
              f"{a.latency_s:.1f}s{' (cache)' if a.cache_hit else ''}{' (skipped)' if a.skipped else ''}\n{a.output}")
    print(f"=== answer: {tr.answer!r}  tokens: {tr.tokens}" + (f"  score vs --gold: {tr.score}" if args.gold else "")
          + (f"  error: {tr.error}" if tr.error else ""))
    return 0


def cmd_train(args) -> int:
    # --set FIELD=VALUE is a TrainConfig field; sft.FIELD reaches the warm start (the same profiles and syntax as
    # main.sh)
    sets = {(k if k.startswith(("train.", "sft.")) else f"train.{k}"): v for k, v in parse_sets(args.set).items()}
    if args.cf_lambda is not None:
        sets["train.cf_lambda"] = args.cf_lambda
    if args.max_steps:
        sets["train.max_steps"] = args.max_steps
    cfg, sft_cfg = train_sft_preset(args.profile, seed=args.seed, sets=sets, workers=args.workers)
    prompts = load_prompts(args.prompts)
    out = Path(args.out)
    print(f"training config: {cfg}")
    init = None
    if not args.no_sft:
        rec = pipeline.warm_start(cfg, sft_cfg, out / "sft", prompts)
        print(f"SFT warm start: {rec['rows']} corpus rows, valid rate {rec['valid_before']['rate']:.2f} -> "
              f"{rec['valid_after']['rate']:.2f} on {rec['valid_after']['n']} train questions")
        init = rec["adapter"]
    res = pipeline.train(cfg, out / "grpo_run", prompts, init_adapter=init)
    logs = [h for h in res["history"] if "reward" in h]
    for h in logs:
        print(f"step {h['step']}: reward {h['reward']:.3f}  valid {h.get('spec/valid_rate', 0):.2f}  "
              f"cf edits {h.get('cf/edits', 0):.0f}  worker tokens {h.get('tokens/worker_spent', 0):.0f}")
    print(f"adapter: {res['adapter']}")
    return 0


def cmd_data(args) -> int:
    for name in B.BENCHMARKS:
        for split in B.available_splits(name):
            n = len(B.load(name, split))
            print(f"{name:11s} {split:11s} {n:6d}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m lemon", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    def common(sp):
        sp.add_argument("--workers", help="YAML/JSON worker-pool config, e.g. configs/workers-paper.yaml (default: the "
                        "embedded ladder, one managed llama-server per shipped model)")
        sp.add_argument("--prompts", help="prompts file (default: lemon/prompts.yaml)")
        sp.add_argument("--seed", type=int, default=0)
        sp.add_argument("--capacity", default="medium", help=f"baseline agents' capacity: {', '.join(CAPACITIES)}")

    e = sub.add_parser("eval", help="evaluate a method on a benchmark split (resumable)")
    e.add_argument("--method", required=True, help="a baseline, 'orchestrator', or a spec .yaml file")
    e.add_argument("--benchmark", required=True)
    e.add_argument("--split", default="test")
    e.add_argument("--limit", type=int)
    e.add_argument("--n-agents", type=int, default=4)
    e.add_argument("--k", type=int, default=5, help="SC-CoT samples")
    e.add_argument("--out", required=True)
    e.add_argument("--concurrency", type=int, default=1,
                   help="questions in flight (default 1); rows, tokens and seeds do not depend on it")
    e.add_argument("--quiet", action="store_true")
    common(e)
    e.set_defaults(fn=cmd_eval)

    r = sub.add_parser("run", help="run one question and print every agent's output")
    r.add_argument("--benchmark", required=True)
    r.add_argument("--question", required=True)
    r.add_argument("--gold", help="optional gold answer to score against")
    r.add_argument("--spec", help="spec YAML file (default: a 3-agent chain baseline)")
    r.add_argument("--orchestrator", action="store_true", help="let the prompted orchestrator write the spec")
    common(r)
    r.set_defaults(fn=cmd_run)

    t = sub.add_parser("train", help="SFT warm start + CF-GRPO for a profile (resumable)")
    t.add_argument("--profile", default="smoke", help="a profile of configs/profiles.yaml (smoke, test, cpu, cpu-long, "
                   "cpu-wide, paper): the same training as that profile's study")
    t.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a TrainConfig field (sft.FIELD: the warm start's), e.g. --set learning_rate=2e-5")
    t.add_argument("--out", required=True)
    t.add_argument("--cf-lambda", type=float, help="override the CF weight (0 = plain GRPO)")
    t.add_argument("--max-steps", type=int)
    t.add_argument("--no-sft", action="store_true", help="skip the SFT warm start")
    t.add_argument("--workers", help="YAML/JSON worker-pool config for training and the warm start, e.g. "
                   "configs/workers-paper.yaml (default: the profile's workers; paper: configs/workers-paper.yaml)")
    t.add_argument("--prompts")
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(fn=cmd_train)

    d = sub.add_parser("data", help="row counts of every benchmark split found")
    d.set_defaults(fn=cmd_data)

    g = sub.add_parser("plan-gpu", help="memory plan of the paper profile on one GPU (refuses a card too small)")
    gpuplan.add_arguments(g)
    g.set_defaults(fn=gpuplan.cmd_plan)

    args = p.parse_args(argv)
    if getattr(args, "concurrency", 1) < 1:
        p.error(f"--concurrency must be >= 1, got {args.concurrency}")
    if getattr(args, "capacity", "medium") not in CAPACITIES:
        p.error(f"unknown capacity {args.capacity!r}; valid: {', '.join(CAPACITIES)}")
    main_thread = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGTERM, _sigterm_as_exit) if main_thread else None
    try:
        return args.fn(args)
    except (ValueError, KeyError, FileNotFoundError) as e:  # bad input: one clear line, nothing half-written
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"error: {type(e).__name__}: {msg}", file=sys.stderr)
        return 2
    except BackendUnavailableError as e:  # no server binary / model, a dead server: the message names the fix
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 3
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, old)
