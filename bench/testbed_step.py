"""What one testbed CF-GRPO step costs, by part, for each random base (prints figures; nothing is asserted).

    OMP_NUM_THREADS=1 .venv/bin/python bench/testbed_step.py [--steps 6] [--bases random-tiny random-tiny-bpe]

Each base trains --steps steps of the cf arm on the duty world (the settings of experiments/mechanisms.sh: 2 questions x
G=4, exact scoring, stratified) in a temporary folder; the first step (compiling the grammar, building the policy) is
reported apart. Per step: sampling, scoring, counterfactual edits and the rest (TRL's loss, backward and optimizer
step), median over the later steps. Quote the CPU and what else ran with the figures: the machine's two cores are often
shared.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from lemon.prompts import default_prompts
from lemon.testbed.experiment import ExperimentConfig, make_world, run_arm

SETTINGS = {"num_generations": 4, "batch_size": 8, "learning_rate": 2e-2, "resample": 0, "role_chars": 12,
            "duty_chars": 16, "curriculum": False, "stratify": True}


def cpu() -> str:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), [])
    return f"{name}; {'AVX-512' if 'avx512f' in flags else 'AVX2' if 'avx2' in flags else 'no AVX2'}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--bases", nargs="+", default=["random-tiny", "random-tiny-bpe"])
    a = ap.parse_args(argv)
    prompts = default_prompts()
    world = make_world("duty", prompts)
    print(f"CPU: {cpu()}")
    print(f"{'base':<18}{'first step s':>13}{'step s':>9}{'sample s':>10}{'score s':>9}{'cf s':>7}{'rest s':>8}")
    for base in a.bases:
        exp = ExperimentConfig(world="duty", base=base, profile="smoke", max_steps=a.steps, train_questions=16,
                               heldout_questions=4, eval_every=a.steps, train_overrides=SETTINGS, arms=("cf",),
                               seeds=(0,))
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            run_arm("cf", 0, Path(tmp) / "run", world, exp, prompts, progress=False)
            wall = time.perf_counter() - t0
            rows = [json.loads(x) for x in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
        rows = [r for r in rows if "time/step_s" in r and "step/sample_s" in r]
        later = rows[1:] or rows
        med = {k: statistics.median(r[k] for r in later) for k in ("time/step_s", "step/sample_s", "step/score_s",
                                                                    "step/cf_s")}
        rest = med["time/step_s"] - med["step/sample_s"] - med["step/score_s"] - med["step/cf_s"]
        print(f"{base:<18}{rows[0]['time/step_s']:>13.2f}{med['time/step_s']:>9.2f}{med['step/sample_s']:>10.2f}"
              f"{med['step/score_s']:>9.2f}{med['step/cf_s']:>7.2f}{rest:>8.2f}   ({len(later)} steps; run "
              f"{wall:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
