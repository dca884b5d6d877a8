"""The seedless credit measurement (lemon.testbed.credit): per world and policy checkpoint, the reference gradient of
the expected reward (doubling its samples until two independent halves agree to cosine >= --agree, or --max-ref), then
the cosine of each estimator (grpo@G, cf@G, grpo@2G, the cf term alone) with it over --draws independent draws.

    .venv/bin/python experiments/grad_cosine.py --worlds duty tiny edge mixed --out outputs/credit/step0
    .venv/bin/python experiments/grad_cosine.py --worlds duty --adapter RUN/grpo/checkpoint-50 --label step50 --out ...

Writes OUT/credit.json (every cosine, the reference's size and half-agreement, the command), OUT/credit.md and
OUT/credit.png; prints one line per world. Resumable per world: a world already in credit.json is skipped.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import numpy as np

from lemon.policy.model import load_policy
from lemon.prompts import default_prompts
from lemon.testbed.credit import ESTIMATORS, CreditConfig, Measure, bootstrap_mean_ci, corrected_cosine, cosine
from lemon.testbed.experiment import ExperimentConfig, make_world, run_caps, split_examples, train_config

PILOT_SET = {"num_generations": 4, "batch_size": 8, "learning_rate": 2e-2, "resample": 0, "role_chars": 12,
             "duty_chars": 16, "curriculum": False, "stratify": True}


def measure_world(world_name, a, prompts) -> dict:
    world = make_world(world_name, prompts)
    exp = ExperimentConfig(world=world_name, base="random-tiny-bpe", profile="smoke", train_questions=32,
                           heldout_questions=16, train_overrides=PILOT_SET, seeds=(a.seed,), arms=("cf",))
    tcfg = train_config("cf", a.seed, exp, world)
    train_ex, _ = split_examples(world, exp.train_questions, exp.heldout_questions, exp.data_seed)
    model, tok = load_policy(tcfg.policy, adapter=a.adapter, seed=a.seed)
    m = Measure(model, tok, world, train_ex[:a.questions], prompts, tcfg, run_caps(tcfg),
                CreditConfig(group=a.group, draws=a.draws, reference_samples=a.ref, seed=a.seed))
    t0 = time.perf_counter()
    n, ref = a.ref, None
    saved = a.out / f"reference-{world_name}.npz"  # the halves, kept: more draws or estimators reuse them
    if saved.exists():
        z = np.load(saved)
        h1, h2, total = z["h1"], z["h2"], int(z["total"])
    while not saved.exists():
        m.cfg = CreditConfig(group=a.group, draws=a.draws, reference_samples=n, seed=a.seed)
        h1, h2, total = m.reference(seed=a.seed)
        agree = cosine(h1, h2)
        print(f"[credit] {world_name}: reference {total} samples/question, halves agree {agree:.3f}", flush=True)
        if agree >= a.agree or 2 * n > a.max_ref:
            np.savez(saved, h1=h1, h2=h2, total=total)
            break
        n *= 2
    agree, ref = cosine(h1, h2), (h1 + h2) / 2
    ref_s = time.perf_counter() - t0
    cos = {e: [] for e in ESTIMATORS}
    corr = {e: [] for e in ESTIMATORS}
    for d in range(a.draws):
        g = m.draw(d)
        for e in ESTIMATORS:
            cos[e].append(cosine(g[e], ref))
            corr[e].append(corrected_cosine(g[e], h1, h2))
    summary = {e: dict(zip(("mean", "lo", "hi"), bootstrap_mean_ci(v))) for e, v in cos.items()}
    summary_corr = {e: dict(zip(("mean", "lo", "hi"), bootstrap_mean_ci(v))) for e, v in corr.items()}
    diffs = {"cf@G - grpo@G (equal samples)": np.subtract(cos["cf@G"], cos["grpo@G"]).tolist(),
             "cf@G - grpo@2G (equal executions)": np.subtract(cos["cf@G"], cos["grpo@2G"]).tolist()}
    return {"world": world_name, "adapter": a.adapter, "questions": [e.id for e in train_ex[:a.questions]],
            "reference_samples_per_question": total, "reference_halves_cosine": agree, "reference_norm":
            float(np.linalg.norm(ref)), "cosines": cos, "summary": summary, "corrected_cosines": corr,
            "summary_corrected": summary_corr,
            "paired": {k: dict(zip(("mean", "lo", "hi"), bootstrap_mean_ci(v))) for k, v in diffs.items()},
            "seconds": {"reference": ref_s, "draws": time.perf_counter() - t0 - ref_s}}


def write_md(out: Path, rec: dict) -> Path:
    lines = [f"# Credit measurement: {rec['label']}", "", f"Command: `{rec['command']}`", "",
             "| world | ref samples/q | halves cos | " + " | ".join(ESTIMATORS) + " | cf-grpo@G | cf-grpo@2G |",
             "|---" * (5 + len(ESTIMATORS)) + "|"]
    for w in rec["worlds"].values():
        cells = [f"{w['summary'][e]['mean']:+.3f} [{w['summary'][e]['lo']:+.3f}, {w['summary'][e]['hi']:+.3f}]"
                 if e in w["summary"] else "-" for e in ESTIMATORS]
        pd = [f"{v['mean']:+.3f} [{v['lo']:+.3f}, {v['hi']:+.3f}]" for v in w["paired"].values()]
        lines.append(f"| {w['world']} | {w['reference_samples_per_question']} | {w['reference_halves_cosine']:.3f} | "
                     + " | ".join(cells + pd) + " |")
    lines += ["", "Disattenuated (lemon.testbed.credit.corrected_cosine: the reference's own noise taken "
              "out; the ratio is consistent, the paired differences above are of plain cosines, whose attenuation is "
              "common to both estimators of a pair):", "", "| world | " + " | ".join(ESTIMATORS) + " |",
              "|---" * (1 + len(ESTIMATORS)) + "|"]
    for w in rec["worlds"].values():
        c = w["summary_corrected"]
        lines.append(f"| {w['world']} | " + " | ".join(
            f"{c[e]['mean']:+.3f} [{c[e]['lo']:+.3f}, {c[e]['hi']:+.3f}]" if e in c else "-" for e in ESTIMATORS)
            + " |")
    p = out / "credit.md"
    p.write_text("\n".join(lines) + "\n")
    return p


def write_plot(out: Path, rec: dict) -> Path:
    """Per world, each estimator's disattenuated cosine with the reference (mean and 95% CI over draws)."""
    from lemon.report import save
    from lemon.testbed.plots import _plt
    plt = _plt()
    worlds = list(rec["worlds"].values())
    fig, ax = plt.subplots(figsize=(max(6, 2.2 * len(worlds) + 2), 3.6))
    width = 0.8 / len(ESTIMATORS)
    for k, e in enumerate(ESTIMATORS):
        xs, ms, err = [], [], [[], []]
        for i, w in enumerate(worlds):
            c = w["summary_corrected"].get(e)
            if c is None:
                continue
            xs.append(i + (k - (len(ESTIMATORS) - 1) / 2) * width)
            ms.append(c["mean"])
            err[0].append(c["mean"] - c["lo"])
            err[1].append(c["hi"] - c["mean"])
        ax.bar(xs, ms, width, yerr=err, capsize=2, label=e, color=f"C{k}")
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xticks(range(len(worlds)),
                  [f"{w['world']}\n(ref halves {w['reference_halves_cosine']:.2f})" for w in worlds])
    ax.set_ylabel("cosine with grad E[R] (disattenuated)")
    ax.set_title(f"Which estimator points where the expected reward rises? ({rec['label']})", fontsize=9)
    ax.legend(fontsize=7, ncol=3)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return save(fig, out / "credit.png")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", nargs="+", default=["duty", "tiny", "edge", "mixed"])
    ap.add_argument("--adapter", default=None, help="LoRA checkpoint to measure (default: the fresh policy, step 0)")
    ap.add_argument("--label", default="step0")
    ap.add_argument("--seed", type=int, default=0, help="the random-tiny-bpe draw (= the training seed)")
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--draws", type=int, default=32)
    ap.add_argument("--ref", type=int, default=256, help="first reference size per half and question (doubled)")
    ap.add_argument("--max-ref", type=int, default=2048)
    ap.add_argument("--agree", type=float, default=0.9)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--report", action="store_true", help="only rewrite credit.md / credit.png from OUT/credit.json")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / "credit.json"
    command = "python " + " ".join(shlex.quote(x) for x in [sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    rec = json.loads(path.read_text()) if path.exists() else {"label": a.label, "command": command, "worlds": {}}
    prompts = default_prompts()
    for w in ([] if a.report else a.worlds):
        if w in rec["worlds"] and set(rec["worlds"][w]["summary"]) >= set(ESTIMATORS):
            continue
        rec["worlds"][w] = measure_world(w, a, prompts)
        s = rec["worlds"][w]["summary"]
        print(f"[credit] {w}: " + "  ".join(f"{e} {s[e]['mean']:+.3f}" for e in ESTIMATORS), flush=True)
        path.write_text(json.dumps(rec, indent=1))
    print(f"[credit] {write_md(a.out, rec)}  {write_plot(a.out, rec)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
