"""Figures and summary.md of a testbed comparison (lemon.testbed.experiment): expected reward and regret of the policy's
samples against steps, one line per arm with a band over seeds; held-out greedy regret; final regret and steps to
threshold with bootstrap CIs. Everything is rebuilt from the experiment folder's files (no model needed)."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from lemon.report import md_table, save
from lemon.testbed.experiment import ExperimentConfig, collect
from lemon.testbed.stats import band, composition, paired_table, step_curves, summary_table
from lemon.testbed.world import SimWorld

METRICS = {"expected_reward": "expected reward of sampled specs", "regret": "regret to the optimum (sampled specs)"}


def _plt():
    import matplotlib
    if "inline" not in matplotlib.get_backend().lower():
        matplotlib.use("Agg")  # headless unless a notebook's inline backend is active
    import matplotlib.pyplot as plt
    return plt


def curves_figure(panels: list[tuple[str, pd.DataFrame]], arms: list[str], note: str = ""):
    """One panel per (title, band frame from experiment.band): mean over seeds per arm, shaded bootstrap band."""
    plt = _plt()
    fig, axes = plt.subplots(1, len(panels), figsize=(6.2 * len(panels), 4.2), squeeze=False)
    colors = {a: f"C{i}" for i, a in enumerate(arms)}
    for ax, (title, b) in zip(axes[0], panels):
        for arm in arms:
            g = b[b["arm"] == arm].sort_values("step")
            if g.empty:
                continue
            ax.plot(g["step"], g["mean"], color=colors[arm], label=f"{arm} ({int(g['seeds'].max())} seeds)", lw=1.8,
                    marker="o", ms=3)  # markers: a curve of one evaluation point is still visible
            ax.fill_between(g["step"], g["lo"], g["hi"], color=colors[arm], alpha=0.18, lw=0)
        ax.set(title=title, xlabel="training step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if note:
        fig.text(0.01, -0.02, note, fontsize=8, ha="left", va="top")
    fig.tight_layout()
    return fig


def summary_figure(table: pd.DataFrame, threshold: float):
    """Final regret and steps-to-threshold per arm with their bootstrap CIs (error bars)."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    x = range(len(table))
    for ax, (col, ci, title) in zip(axes, (("final_regret", "final_regret_ci", "final regret (lower is better)"),
                                           ("steps_to_threshold", "steps_ci", f"steps to regret <= {threshold:g}"))):
        mean = table[col].astype(float)
        lo = [m - c[0] if c[0] == c[0] else 0 for m, c in zip(mean, table[ci])]
        hi = [c[1] - m if c[1] == c[1] else 0 for m, c in zip(mean, table[ci])]
        ax.bar(x, mean, yerr=[lo, hi], capsize=4, color=[f"C{i}" for i in x])
        ax.set_xticks(list(x), [f"{a}\n({r} reached)" if col == "steps_to_threshold" else a
                                for a, r in zip(table["arm"], table["reached"])], fontsize=8)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


_TRAIN_REWARD = {"exact": "each rollout's and each edit's exact expected reward (lemon.testbed.exact, no "
                          "outcome noise)",
                 "sampled": "one simulated outcome per execution (the executor on the simulated pool)"}


def _fmt_ci(ci) -> str:
    if not isinstance(ci, (tuple, list)) or ci[0] != ci[0]:  # NaN or missing (e.g. no held-out evaluation for that arm)
        return "-"
    return f"[{ci[0]:.3f}, {ci[1]:.3f}]"


def write_report(root: Path, exp: ExperimentConfig, world: SimWorld) -> Path:
    """plots/*.png, summary.json and summary.md of the experiment folder; returns summary.md's path."""
    root = Path(root)
    rec = json.loads((root / "experiment.json").read_text()) if (root / "experiment.json").exists() else {}
    samples, heldout = collect(root, world, "rollouts"), collect(root, world, "heldout")
    if samples.empty:
        raise FileNotFoundError(f"no scored rollouts under {root}/<arm>/seed-*/ (run the arms first)")
    curves = step_curves(samples)
    arms = [a for a in exp.arms if a in set(curves["arm"])]
    note = (f"SIMULATED workers (lemon.testbed, world '{exp.world}'); bands = 95% bootstrap CI of the mean over seeds; "
            f"{exp.train_questions} training questions, seeds {list(exp.seeds)}")
    panels = [(t, band(curves, m)) for m, t in METRICS.items()]
    if not heldout.empty:
        panels.append(("held-out greedy regret", band(step_curves(heldout), "regret")))
    save(curves_figure(panels, arms, note), root / "plots" / "curves.png")
    table = summary_table(curves, exp, heldout if not heldout.empty else None)
    save(summary_figure(table, exp.threshold), root / "plots" / "summary.png")
    paired = paired_table(curves, heldout if not heldout.empty else None, exp)
    (root / "summary.json").write_text(json.dumps(table.to_dict(orient="records"), indent=1, default=str))
    (root / "paired.json").write_text(json.dumps(paired.to_dict(orient="records"), indent=1, default=str))
    shown, paired_shown = table.copy(), paired.copy()
    for frame in (shown, paired_shown):
        for c in [c for c in frame.columns if c.endswith("_ci")]:
            frame[c] = frame[c].map(_fmt_ci)
    opt = pd.DataFrame([{k: v for k, v in o.items() if k != "spec"} for o in rec.get("optimum", [])])
    md = [f"# Testbed comparison ({exp.world} world, SIMULATED workers)", "",
          f"Arms {', '.join(arms)}; seeds {list(exp.seeds)}; {exp.max_steps} steps each; profile `{exp.profile}`; "
          f"{exp.train_questions} training / {exp.heldout_questions} held-out train-pool questions (data seed "
          f"{exp.data_seed}). Training rewards: {_TRAIN_REWARD[exp.scoring]}. For the curves below every sampled spec "
          f"is re-scored by its EXACT expected reward under the simulated workers (lemon.testbed.world); regret = "
          f"optimum - expected reward. Final regret = mean over the last {exp.final_window} "
          f"steps; steps to threshold = first step whose {exp.smooth}-step running mean regret is <= "
          f"{exp.threshold:g}; CIs are 95% bootstrap over seeds (with 3 seeds, crude).", "",
          "Regenerate (one invocation per line, in this order; finished runs are skipped):", "",
          *[f"    {c}" for c in rec.get("commands", [rec.get("command", "experiments/testbed_run.py")])], "",
          "## Optimum per task type", "", md_table(opt), "",
          "## Results", "", md_table(shown), "",
          "## Paired by seed: each arm minus global GRPO", "",
          "diff < 0 favours the arm for regrets, diff > 0 for the held-out gain (greedy expected reward at the last "
          "evaluated step minus step 0); `arm_better` counts the seeds that favour it.", "",
          md_table(paired_shown) if len(paired_shown) else "(global GRPO not run: no paired comparison)", "",
          "## What the sampled specs look like, first vs last steps (pooled over seeds)", "",
          "`large_share` = share of agents at capacity large; `final_large_solver` = share of specs whose "
          "final agent is a large solver; `distinct_shapes` = distinct (agents, final role, final capacity) "
          "per valid spec.", "",
          md_table(composition(samples)), "",
          "![curves](plots/curves.png)", "", "![summary](plots/summary.png)", ""]
    p = root / "summary.md"
    p.write_text("\n".join(md) + "\n")
    return p
