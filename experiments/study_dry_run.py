"""A study profile's code paths at a small size, timed per stage: what a user runs before spending ~2 h on
`scripts/main.sh --profile cpu`, and where the cpu profile's time estimate comes from.

    .venv/bin/python experiments/study_dry_run.py --out outputs/dry-cpu --n 3           # cpu: ~30 min on 2 idle cores
    # cpu-long: + global, best-fixed, dev
    .venv/bin/python experiments/study_dry_run.py --profile cpu-long --out outputs/dry-long --n 2
    # the cpu profile's paths on the 135M
    .venv/bin/python experiments/study_dry_run.py --profile smoke --out outputs/dry-smoke --n 1 --dev \
        --set policy_server=true 'ablation_variants=["sft","global"]' \
        'eval_methods=["cot@large","best-fixed","lemon"]' fixed_dev_n=1

Same stages as the notebooks (lemon.study.stages: data, SFT warm start + CF-GRPO, the training variants evaluated, every
eval method, summary.md), with the profile's config shrunk: --n questions per benchmark for eval and ablation, --steps
CF-GRPO steps, --sft-questions SFT corpus questions. Prints one `[dry-run] <stage>: <s> s` line per stage and method,
the seconds per question of each eval method (what a full-size run multiplies by its question count), and writes
<out>/dry_run.json. Resumable like the study (rerun the same command; a finished stage costs seconds). Times depend on
what else runs on the machine: say so when quoting them.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path


from lemon.eval.runner import read_rows
from lemon.prompts import default_prompts
from lemon.study import plots, stages
from lemon.study import runner as study


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="cpu", choices=list(study.STUDY_PROFILES))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--n", type=int, default=3, help="eval (and ablation) questions per benchmark")
    ap.add_argument("--steps", type=int, default=1, help="CF-GRPO steps (and steps of each trained variant)")
    ap.add_argument("--sft-questions", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", nargs="*", default=[], metavar="FIELD=JSON",
                    help='further StudyConfig fields, e.g. policy_server=true \'eval_methods=["cot@large","lemon"]\'')
    ap.add_argument("--dev", action="store_true",
                    help="also run the dev-set learning curves (dev_n = --n) even where the "
                         "profile has none")
    a = ap.parse_args(argv)
    sets = {k: json.loads(v) for k, v in (x.split("=", 1) for x in a.set)}
    sets = {k: tuple(v) if isinstance(v, list) else v for k, v in sets.items()}  # StudyConfig's sequences are tuples
    c0 = study.study_preset(a.profile, seed=a.seed, **sets)
    cfg = replace(c0, eval_n=a.n, ablation_n=min(a.n, c0.ablation_n), edit_n=min(a.n, c0.edit_n),
                  ablation_steps=min(a.steps, c0.ablation_steps),
                  train=replace(c0.train, max_steps=a.steps, save_steps=min(c0.train.save_steps, a.steps)),
                  sft=replace(c0.sft, questions=a.sft_questions),
                  dev_n=a.n if a.dev else min(a.n, c0.dev_n), dev_every=min(a.steps, c0.train.save_steps))
    paths = study.StudyPaths(a.out)
    study.write_config(cfg, paths)
    if not (paths.root / "manifest.json").exists():
        (paths.root / "manifest.json").write_text(json.dumps(study.study_manifest(cfg), indent=1, default=str))
    prompts, rec = default_prompts(), {"profile": a.profile, "argv": sys.argv, "stages": {}, "per_question_s": {}}

    def timed(name, fn):
        t0 = time.perf_counter()
        out = fn()
        rec["stages"][name] = round(time.perf_counter() - t0, 1)
        print(f"[dry-run] {name}: {rec['stages'][name]:.0f} s", flush=True)
        (paths.root / "dry_run.json").write_text(json.dumps(rec, indent=1))
        return out

    print(f"[dry-run] profile {a.profile} shrunk to n={a.n}, {a.steps} step(s), {a.sft_questions} SFT questions -> "
          f"{paths.root}")
    timed("01 data", lambda: stages.prepare_data(cfg, paths))
    timed("02 sft + cf-grpo", lambda: stages.train_main(cfg, paths, prompts))
    pool = stages.eval_pool(cfg)
    try:
        if cfg.edit_n:
            timed("03 edit effects", lambda: stages.edit_effects(cfg, paths, prompts, pool))
        timed("03 variants", lambda: stages.run_ablation(cfg, paths, prompts, pool))
        if cfg.dev_n:
            timed("03 dev curves", lambda: stages.dev_curves(cfg, paths, prompts, pool))
        samples = study.load_samples(cfg, paths, "eval")
        for m in cfg.eval_methods:
            timed(f"04 {m}", lambda m=m: stages.evaluate_method(cfg, paths, m, samples, pool, prompts))
    finally:
        pool.close()
    # seconds per question from the rows themselves (latency_s: spec writing + execution of each question)
    folders = {m: [paths.eval_dir(m, b) for b in cfg.benchmarks] for m in cfg.eval_methods}
    folders.update({v: [paths.variant_eval_dir(v, b) for b in cfg.ablation_benchmarks] for v in cfg.ablation_variants})
    for m, fs in folders.items():
        rows = [r for f in fs for r in read_rows(f / "results.jsonl")]
        if rows:
            rec["per_question_s"][m] = round(sum(r.get("latency_s", 0.0) for r in rows) / len(rows), 1)
            print(f"[dry-run] {m}: {rec['per_question_s'][m]:.1f} s per question (n={len(rows)})")
    (paths.root / "dry_run.json").write_text(json.dumps(rec, indent=1))
    md = plots.write_summary(cfg, paths)
    print(f"summary: {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
