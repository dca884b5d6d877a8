"""The testbed comparison (issue 13, deliverable 1): CF-GRPO vs global GRPO (lambda = 0) vs each single edit family,
several seeds, the same budget, on SIMULATED workers with a known optimum (lemon.testbed). Resumable: a finished run is
skipped, an interrupted one continues from its checkpoint, held-out points already evaluated are kept.

    .venv/bin/python experiments/testbed_run.py --world two --seeds 0 1 2 --steps 30 --out outputs/testbed/two
    .venv/bin/python experiments/testbed_run.py --world tiny --profile smoke --sft ...   # format SFT into <out>/sft
    .venv/bin/python experiments/testbed_run.py --world tiny --plan      # optimum per type, run plan; no training
    .venv/bin/python experiments/testbed_run.py --out outputs/testbed/two --report   # rebuild summary.md and plots only

Prints one line per run (wall time) and, at the end, the summary table (final regret and steps to threshold with
bootstrap CIs over seeds) and the path of summary.md. Timings on the 2-core machine depend on what else runs: say so
when quoting them.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path


from lemon.prompts import default_prompts
from lemon.testbed.experiment import (ARMS, BASES, SCORINGS, WORLDS, ExperimentConfig, evaluate_heldout,
                                      make_world, run_arm, run_caps, train_config, world_of_record,
                                      write_experiment)
from lemon.testbed.plots import write_report
from lemon.testbed.warm import warm_start_adapter


def _value(v: str):
    try:
        return json.loads(v)
    except json.JSONDecodeError:
        return v


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", choices=WORLDS, default="two")
    ap.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--profile", default="cpu", help="trainer preset (lemon.train.config.train_preset)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--train-questions", type=int, default=64)
    ap.add_argument("--heldout", type=int, default=16, help="held-out questions of the greedy evaluation")
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--threshold", type=float, default=0.25, help="regret threshold for steps-to-threshold")
    ap.add_argument("--init-adapter", default=None, help="LoRA every run starts from (e.g. an SFT warm start)")
    ap.add_argument("--sft", action="store_true",
                    help="build the testbed's format SFT warm start (lemon.testbed.warm) into <out>/sft, start "
                         "every run from it")
    ap.add_argument("--set", nargs="*", default=[], metavar="FIELD=JSON",
                    help="extra TrainConfig fields, e.g. num_generations=8")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--scoring", choices=SCORINGS, default="exact",
                    help="exact: each rollout rewarded with its exact expected reward; sampled: one simulated outcome")
    ap.add_argument("--base", choices=BASES, default="preset",
                    help="preset: the profile's policy; random-tiny: a random 2-layer Qwen2 per training seed (fast)")
    ap.add_argument("--no-eval", action="store_true", help="skip the held-out greedy evaluation (training curves only)")
    ap.add_argument("--prune-checkpoints", action="store_true",
                    help="after a run's held-out evaluation, delete its checkpoints but the latest (disk)")
    ap.add_argument("--plan", action="store_true", help="print the optimum per type and the runs, train nothing")
    ap.add_argument("--report", action="store_true", help="only rebuild summary.md and the plots from the folder")
    a = ap.parse_args(argv)
    overrides = {k: _value(v) for k, v in (s.split("=", 1) for s in a.set)}
    root = a.out or Path("outputs") / "testbed" / a.world
    if a.sft and a.init_adapter:
        ap.error("--sft builds the warm start itself: give --sft or --init-adapter, not both")
    init_adapter = str(root / "sft") if a.sft else a.init_adapter
    exp = ExperimentConfig(world=a.world, arms=tuple(a.arms), seeds=tuple(a.seeds), profile=a.profile,
                           max_steps=a.steps, train_questions=a.train_questions, heldout_questions=a.heldout,
                           eval_every=a.eval_every, threshold=a.threshold, init_adapter=init_adapter,
                           train_overrides=overrides, scoring=a.scoring, base=a.base)
    prompts, world = default_prompts(), make_world(a.world, default_prompts())
    if a.report and (root / "experiment.json").exists():  # re-score as the runs were scored (an older sim, too)
        world = world_of_record(json.loads((root / "experiment.json").read_text()), prompts)
    cfg0 = train_config(exp.arms[0], exp.seeds[0], exp, world)
    command = "python " + " ".join(shlex.quote(x) for x in [sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    if not a.report:
        rec = write_experiment(root, exp, world, cfg0.reward, cfg0.max_agents, run_caps(cfg0), command)
        print(f"[testbed] world {a.world}: {world.describe()['by_type']} examples; SIMULATED workers, {a.scoring} "
              f"scoring; reward {cfg0.reward.form if hasattr(cfg0.reward, 'form') else ''} token_budget "
              f"{cfg0.reward.token_budget}")
        for o in rec["optimum"]:
            print(f"[testbed] optimum for '{o['type']}': expected reward {o['expected_reward']:.4f}, P(success) "
                  f"{o['p_success']:.3f}, {o['tokens']} tokens, {o['agents']} agents ({o['searched']} "
                  "structures searched)")
        print(f"[testbed] {len(exp.arms)} arms x {len(exp.seeds)} seeds x {exp.max_steps} steps, policy "
              f"{cfg0.policy.model}, G={cfg0.num_generations}, batch {cfg0.batch_size} -> {root}")
        if a.plan:
            print(rec["optimum"][-1]["spec"])
            return 0
        if a.sft:
            t0 = time.perf_counter()
            warm_start_adapter(exp, world, prompts, root / "sft")
            print(f"[testbed] format SFT warm start: {root / 'sft'} ({time.perf_counter() - t0:.0f} s; reused if "
                  "it was there)")
        for arm in exp.arms:
            for seed in exp.seeds:
                run_dir, t0 = root / arm / f"seed-{seed}", time.perf_counter()
                res = run_arm(arm, seed, run_dir, world, exp, prompts)
                cfg = train_config(arm, seed, exp, world)
                n_eval = 0 if a.no_eval else evaluate_heldout(run_dir, world, exp, prompts, cfg,
                                                              prune=a.prune_checkpoints)
                print(f"[testbed] {arm} seed {seed}: {res['steps']} steps, {n_eval} held-out rows, "
                      f"{time.perf_counter() - t0:.0f} s", flush=True)
    md = write_report(root, exp, world)
    print(Path(root / "summary.json").read_text())
    print(f"summary: {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
