"""A CF-GRPO step's time split: policy sampling, worker execution, counterfactual re-execution, loss + backward (issue
11, "Policy speed on CPU"). Runs `--steps` real training steps of a preset into a fresh folder and prints, per step and
as the median, the seconds of each phase from metrics.jsonl (step/sample_s, step/score_s, step/cf_s; loss + backward +
optimizer = time/step_s minus those), per rollout too, since presets differ in batch size.

    .venv/bin/python bench/step_bench.py --profile cpu --steps 2            # this tree
    .venv/bin/python bench/step_bench.py --profile cpu --steps 2 --no-cf    # global GRPO (no re-execution)
    .venv/bin/python bench/step_bench.py --run outputs/train-cpu/grpo_run     # the split of a finished run, no training

The figure to compare against is the 2026-11-30 cpu study (LOG.md): 215-333 s per step of 4 rollouts (0.5B policy fp32,
unconstrained, in-process llama.cpp workers), i.e. 54-83 s per rollout. Timings on a shared 2-core machine are
pessimistic: run it alone.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path


from lemon.prompts import default_prompts
from lemon.train.config import train_preset
from lemon.train.pipeline import train


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="cpu", choices=("smoke", "cpu"))
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--no-cf", action="store_true", help="cf_lambda = 0 (global GRPO)")
    ap.add_argument("--train-dtype", default="auto", choices=("auto", "fp32", "bf16"))
    ap.add_argument("--out", default=None, help="run folder (default: a temporary one)")
    ap.add_argument("--run", default=None, help="print the split of an existing GRPO run folder (its metrics.jsonl)")
    a = ap.parse_args(argv)
    if a.run:
        out, wall = Path(a.run), None
        run = json.loads((out / "manifest.json").read_text())["config"]  # TrainConfig.to_dict() of that run
        auto = "see its train.json"
    else:
        cfg = train_preset(a.profile, max_steps=a.steps, save_steps=max(a.steps, 1), train_dtype=a.train_dtype,
                           **({"cf_lambda": 0.0} if a.no_cf else {}))
        out = Path(a.out or tempfile.mkdtemp(prefix="lemon-step-bench-"))
        t0 = time.perf_counter()
        auto = train(cfg, out, default_prompts(), progress=False)["train_bf16_autocast"]
        wall = time.perf_counter() - t0
        run = cfg.to_dict()
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward" in r]
    print(f"profile {run['profile']}: policy {run['policy']['model']}, batch {run['batch_size']} "
          f"(G={run['num_generations']}), constrained={run['constrained']}, cf_lambda={run['cf_lambda']}, "
          f"sample_dtype={run['sample_dtype']}, bf16 autocast for the loss: {auto}")
    # per kept rollout = total / batch size; dynamic sampling also samples (and executes) G specs per resampled group
    print(f"{'step':>4} {'total':>8} {'sample':>8} {'workers':>8} {'cf':>8} {'loss+bwd':>9} {'per rollout':>12} "
          f"{'sampled':>8} {'per sampled':>12}")
    splits = []
    for r in rows:
        s, w, c, t = r.get("step/sample_s", 0), r.get("step/score_s", 0), r.get("step/cf_s", 0), r["time/step_s"]
        n = run["batch_size"] + run["num_generations"] * int(r.get("step/resampled_groups", 0))
        splits.append((t, s, w, c, t - s - w - c, n))
        print(f"{r['step']:>4} {t:8.1f} {s:8.1f} {w:8.1f} {c:8.1f} {t - s - w - c:9.1f} {t / run['batch_size']:12.1f} "
              f"{n:8d} {t / n:12.1f}")
    if splits:
        med = [statistics.median(x) for x in zip(*splits)]
        print(f"{'med':>4} {med[0]:8.1f} {med[1]:8.1f} {med[2]:8.1f} {med[3]:8.1f} {med[4]:9.1f} "
              f"{med[0] / run['batch_size']:12.1f} {med[5]:8.0f} "
              f"{statistics.median(x[0] / x[5] for x in splits):12.1f}")
    if wall is not None:
        print(f"wall {wall:.0f} s including model load; folder {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
