"""The real-worker CF-GRPO vs global-GRPO comparison (issue 13, deliverable 2) as a chain of session-sized legs.

One run of the comparison is ~10 h of 2 cores; a session here has 3 h and keeps nothing but git. So the work is cut
where what crosses a session boundary is small text: the SFT corpus (both arms rebuild the same warm start from it, and
the adapter's sha256 is checked against the first leg's), each arm's training record (metrics, rollouts) and each
trained policy's greedy specs for the evaluation and dev questions (a spec is ~150 tokens of YAML). Executing specs on
the workers, the baselines and the comparison need no adapter and run in any later leg, resumably. The logic lives in
experiments.duel.legs; this script is its command line.

    .venv/bin/python -m experiments.duel train --arm cf       # leg 1: SFT corpus + warm start, 10 steps, specs
    .venv/bin/python -m experiments.duel train --arm global   # leg 2: the committed corpus's warm start, lambda 0
    .venv/bin/python -m experiments.duel status               # what is done, what is missing, and the command for each
    # a training-curve replicate in its own folders (global options go before the command):
    .venv/bin/python -m experiments.duel --seed 1 --steps 6 --dev-steps '' --work outputs/duel-cpu-seed1 \
        --ref outputs/reference/duel-cpu-seed1-20261204 train --arm cf --no-specs
"""
from __future__ import annotations

import argparse
import sys
import time


from experiments.duel.legs import (ARMS, POLICIES, DuelConfig, adapter_sha, log_event, run_method,
                              train_arm, write_specs)


def main(argv=None) -> int:
    from lemon.prompts import default_prompts
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="SFT warm start + one arm's steps, then (unless --no-specs) its greedy specs")
    t.add_argument("--arm", required=True, choices=ARMS)
    t.add_argument("--no-specs", action="store_true")
    s = sub.add_parser("specs", help="greedy specs of a trained policy (its adapter must be in the work folder)")
    s.add_argument("--arm", required=True, choices=POLICIES)
    e = sub.add_parser("exec", help="execute a policy's recorded specs, or run a baseline, on the eval sample")
    e.add_argument("methods", nargs="+", help="sft | cf | global | a study eval method (cot@large, sc-cot@medium, ...)")
    e.add_argument("--concurrency", type=int, default=1,
                   help="questions in flight: the servers batch them, ~1.1-1.3x on 2 cores (LOG.md "
                        "2026-12-01). Seeds do not depend on it, but batched float sums can flip a greedy token now "
                        "and then; legs.jsonl records each leg's value (the policies' rows ran at 1)")
    sub.add_parser("report", help="paired comparisons, learning curves, spec composition, plots -> ref/summary.md")
    sub.add_parser("status", help="what is missing, with the command for each")
    # A replicate (another seed, fewer steps) needs its own folders; ref/config.json refuses a mix.
    dflt = DuelConfig()
    ap.add_argument("--seed", type=int, default=dflt.seed,
                    help="seeds data samples, SFT corpus, training, worker calls")
    ap.add_argument("--steps", type=int, default=dflt.steps, help="training steps per arm")
    ap.add_argument("--dev-steps", default=",".join(map(str, dflt.dev_steps)),
                    help="comma-separated even checkpoints whose greedy dev specs are written ('' for none)")
    ap.add_argument("--work", default=dflt.work, help="work folder (gitignored)")
    ap.add_argument("--ref", default=dflt.ref, help="record folder kept in git")
    a = ap.parse_args(argv)
    d = DuelConfig(steps=a.steps, seed=a.seed, work=a.work, ref=a.ref,
                   dev_steps=tuple(int(x) for x in a.dev_steps.split(",") if x.strip()))
    prompts = default_prompts()
    print(f"[duel] {d}")
    if a.cmd == "train":
        adapter = train_arm(d, a.arm, prompts)
        print(f"[duel] arm {a.arm}: adapter {adapter} (sha256 {adapter_sha(adapter)[:12]})")
        if not a.no_specs:
            print(f"[duel] {write_specs(d, a.arm, prompts)} specs written")
    elif a.cmd == "specs":
        print(f"[duel] {write_specs(d, a.arm, prompts)} specs written")
    elif a.cmd == "exec":
        from lemon.study.stages import eval_pool
        pool = eval_pool(d.study())
        try:
            for m in a.methods:
                t0 = time.time()
                sums = run_method(d, m, prompts, pool, concurrency=a.concurrency)
                log_event(d, leg="exec", method=m, seconds=round(time.time() - t0), concurrency=a.concurrency,
                          n={f"{s.get('set', 'eval')}/{s['benchmark']}": s["n"] for s in sums})
        finally:
            pool.close()
    elif a.cmd == "status":
        from experiments.duel.report import missing
        for m in missing(d) or ["nothing missing: run `experiments/duel/ report`"]:
            print(f"[duel] {m}")
    elif a.cmd == "report":
        from experiments.duel.report import report
        print(f"[duel] summary: {report(d, prompts)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
