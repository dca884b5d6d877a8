"""The credit-assignment study across worlds: one folder per world, each a testbed experiment
(lemon.testbed.experiment) with arms cf and global at >= 10 seeds and, on the mixed world, the single edit families.

    python -m lemon.testbed.study ROOT [--out DIR]      # ROOT = the folder experiments/cf_seeds.sh filled

Per world: the oracle (the optimum of every question, regret 0 by definition), the best ONE fixed spec and its regret
(what a policy that ignores the question can reach), the policy at step 0, and per arm the final regret of its training
samples, the greedy held-out regret at the last evaluation, steps to the regret threshold and the share of INVALID
specs, reported apart from regret (an invalid spec is also inside regret, at reward r_invalid; `*_valid` columns average
valid specs only). Each arm is compared with global GRPO paired by seed (a seed fixes the random-tiny policy, the
questions and the first samples): mean difference with a bootstrap CI, d_z, seeds in favour, an exact sign test and an
exact Wilcoxon signed-rank test, both Holm-corrected over every comparison of the study. Writes study.md, study.json and
plots/ under --out (ROOT by default). Reads files only: no model is loaded.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from lemon.prompts import Prompts, default_prompts
from lemon.report import md_table, save
from lemon.testbed.experiment import ExperimentConfig, collect, read_run_info, read_text, run_dirs, world_of_record
from lemon.testbed.plots import _plt
from lemon.testbed.stats import band, bootstrap_ci, holm, paired_effect, step_curves, steps_to_threshold, tost
from lemon.testbed.world import best_fixed

# metric -> (what it is, lower is better, TOST margin: equivalence of the paired mean difference within +/- margin)
METRICS = {"final_regret": ("regret of the training samples, mean of the last final_window steps", True, 0.05),
           "heldout_regret": ("greedy held-out regret at the last evaluation", True, 0.05),
           "mean_reward": ("exact expected reward of the training samples, mean over every step (area under the curve)",
                           False, 0.05),
           "steps_to_threshold": ("first step whose running-mean sample regret <= threshold; max_steps + 1 when never "
                                  "(censored)", True, None)}
ALPHA = 0.05


def load(root: Path, prompts: Prompts):
    """(ExperimentConfig, SimWorld, experiment.json record) of one world's folder."""
    rec = json.loads((Path(root) / "experiment.json").read_text())
    c = rec["config"]
    exp = ExperimentConfig(**{**c, "arms": tuple(c["arms"]), "seeds": tuple(c["seeds"])})
    return exp, world_of_record(rec, prompts), rec


def per_run(samples: pd.DataFrame, heldout: pd.DataFrame, exp: ExperimentConfig) -> pd.DataFrame:
    """One row per (arm, seed): final regret (all / valid only), invalid share (last window), steps to threshold,
    held-out regret (all / valid only) and invalid share at the first and last evaluation."""
    rows = []
    for (arm, seed), g in samples.groupby(["arm", "seed"]):
        last = g[g["step"] > g["step"].max() - exp.final_window]
        row = {"arm": arm, "seed": seed, "final_regret": last["regret"].mean(),
               "final_regret_valid": last.loc[last["valid"], "regret"].mean(),
               "final_invalid": 1 - last["valid"].mean(),
               "steps_to_threshold": steps_to_threshold(step_curves(g), exp.threshold, exp.smooth),
               "mean_reward": g["expected_reward"].mean()}
        h = heldout[(heldout["arm"] == arm) & (heldout["seed"] == seed)] if len(heldout) else heldout
        if len(h):
            h0, h1 = h[h["step"] == h["step"].min()], h[h["step"] == h["step"].max()]
            row.update(heldout_step=int(h1["step"].iloc[0]), heldout_regret=h1["regret"].mean(),
                       heldout_regret_valid=h1.loc[h1["valid"], "regret"].mean(),
                       heldout_invalid=1 - h1["valid"].mean(), start_regret=h0["regret"].mean(),
                       start_invalid=1 - h0["valid"].mean())
        rows.append(row)
    return pd.DataFrame(rows)


def reference(world, run_dir: Path) -> dict:
    """Oracle and best fixed spec of a world under the reward of its runs (read from one run's run.json)."""
    _, reward, max_agents, caps = read_run_info(run_dir)
    spec, per_type, regret = best_fixed(world, reward, max_agents, caps)
    ex = {t: next(e for e in world.examples() if world.type_of(e) == t) for t in world.config.types}
    opt = {t: world.optimum(ex[t], reward, max_agents, caps).expected_reward for t in ex}
    return {"oracle_reward": float(np.mean(list(opt.values()))),
            "best_fixed_reward": float(np.mean(list(per_type.values()))), "best_fixed_regret": float(regret),
            "best_fixed_spec": spec.to_yaml(), "types": list(ex)}


def arm_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Per arm: seeds, each metric's mean with a bootstrap CI over seeds, seeds reaching the threshold."""
    out = []
    for arm, g in runs.groupby("arm", sort=False):
        row = {"arm": arm, "seeds": len(g)}
        for m in ("start_regret", "final_regret", "final_regret_valid", "final_invalid", "heldout_regret",
                  "heldout_regret_valid", "heldout_invalid"):
            if m in g:
                row[m] = float(g[m].mean())
        for m in ("final_regret", "heldout_regret"):
            if m in g:
                row[f"{m}_ci"] = bootstrap_ci(g[m].tolist())
        reached = g["steps_to_threshold"].dropna()
        row["reached"] = f"{len(reached)}/{len(g)}"
        row["steps_to_threshold"] = float(reached.mean()) if len(reached) else float("nan")
        out.append(row)
    return pd.DataFrame(out)


def comparisons(runs_by_world: dict[str, pd.DataFrame], base: str = "global",
                max_steps: dict[str, int] | None = None) -> pd.DataFrame:
    """Every (world, arm != base, metric) paired by seed against `base`: effect, sign and Wilcoxon tests and a TOST,
    each Holm-adjusted over ALL rows, and a verdict per row. max_steps (per world) censors steps_to_threshold."""
    max_steps = max_steps or {}
    rows = []
    for world, runs in runs_by_world.items():
        if base not in set(runs["arm"]):
            continue
        ref = runs[runs["arm"] == base].set_index("seed")
        for arm in [a for a in runs["arm"].unique() if a != base]:
            mine = runs[runs["arm"] == arm].set_index("seed")
            for m, (_, lower, margin) in METRICS.items():
                if m not in mine or m not in ref:
                    continue
                a, r = mine[m], ref[m]
                if m == "steps_to_threshold":  # censored: a run that never reached the threshold ranks after all others
                    cap = max_steps.get(world, 0) + 1
                    a, r = a.fillna(cap), r.fillna(cap)
                # seeds both arms finished (a run still in progress, or not evaluated, has NaN there): the pairs
                both = sorted(a.dropna().index.intersection(r.dropna().index))
                d = (a.loc[both] - r.loc[both]).to_numpy()
                eq = tost(d, margin) if margin else {"tost_margin": float("nan"), "p_tost": float("nan"),
                                                       "ci90": (float("nan"), float("nan"))}
                rows.append({"world": world, "arm": arm, "vs": base, "metric": m, **paired_effect(d, lower), **eq})
    df = pd.DataFrame(rows)
    if len(df):
        df["p_sign_holm"], df["p_wilcoxon_holm"] = holm(df["p_sign"]), holm(df["p_wilcoxon"])
        t = df["p_tost"].notna()
        df["p_tost_holm"] = float("nan")
        if t.any():
            df.loc[t, "p_tost_holm"] = holm(df.loc[t, "p_tost"])
        df["verdict"] = [verdict(r) for r in df.to_dict(orient="records")]
    return df


def verdict(row: dict) -> str:
    """'separated' (Wilcoxon, Holm), else 'equivalent' (TOST at the metric's margin, Holm), else 'inconclusive'
    (neither: the seeds cannot tell a difference of the margin's size from none)."""
    if row["p_wilcoxon_holm"] < ALPHA:
        return "separated: " + ("arm better" if row["arm_better"] > row["ref_better"] else "reference better")
    if row.get("p_tost_holm") == row.get("p_tost_holm") and row["p_tost_holm"] < ALPHA:
        return f"equivalent (+/-{row['tost_margin']:g})"
    return "inconclusive"


def curves_grid(data: dict, refs: dict, note: str):
    """Rows = worlds; columns = expected reward of samples, regret of samples, held-out greedy regret; mean over seeds
    per arm with a 95% bootstrap band; dashed = the best fixed spec (regret panels) / the oracle (reward panel)."""
    plt = _plt()
    worlds = list(data)
    arms = list(dict.fromkeys(a for w in worlds for a in data[w][0]["arm"].unique()))
    colors = {a: f"C{i}" for i, a in enumerate(arms)}
    fig, axes = plt.subplots(len(worlds), 3, figsize=(16, 3.3 * len(worlds)), squeeze=False)
    for r, w in enumerate(worlds):
        curves, hcurves = data[w]
        panels = [("expected reward (samples)", band(curves, "expected_reward"), refs[w]["oracle_reward"], "oracle"),
                  ("regret (samples)", band(curves, "regret"), refs[w]["best_fixed_regret"], "best fixed spec"),
                  ("held-out greedy regret", band(hcurves, "regret") if len(hcurves) else None,
                   refs[w]["best_fixed_regret"], "best fixed spec")]
        for ax, (title, b, line, label) in zip(axes[r], panels):
            if b is not None:
                for arm in arms:
                    g = b[b["arm"] == arm].sort_values("step")
                    if len(g):
                        ax.plot(g["step"], g["mean"], color=colors[arm], marker="o", ms=3, lw=1.6,
                                label=f"{arm} ({int(g['seeds'].max())})")
                        ax.fill_between(g["step"], g["lo"], g["hi"], color=colors[arm], alpha=0.15, lw=0)
            ax.axhline(line, color="k", ls="--", lw=1, label=label)
            ax.set(title=f"{w}: {title}", xlabel="training step")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.text(0.01, -0.01, note, fontsize=8, ha="left", va="top")
    fig.tight_layout()
    return fig


def _fmt(frame: pd.DataFrame) -> pd.DataFrame:
    f = frame.copy()
    for c in [c for c in f.columns if c.endswith("_ci") or c == "ci90"]:
        f[c] = f[c].map(lambda ci: "-" if ci[0] != ci[0] else f"[{ci[0]:+.3f}, {ci[1]:+.3f}]")
    return f


def study(root: Path, out: Path | None = None, prompts: Prompts | None = None) -> Path:
    """Read every world folder under root, write study.json, study.md and plots/curves.png under out; returns
    study.md."""
    root, prompts = Path(root), prompts or default_prompts()
    out = Path(out or root)
    folders = sorted(p.parent for p in root.glob("*/experiment.json"))
    if not folders:
        raise FileNotFoundError(f"no <world>/experiment.json under {root} (run experiments/cf_seeds.sh first)")
    runs, tables, refs, data, exps, times = {}, {}, {}, {}, {}, {}
    for folder in folders:
        exp, world, rec = load(folder, prompts)
        # finished runs only (train.json written): a run still in progress would enter with its first steps as "final"
        done = {(read_run_info(d)[0]["arm"], read_run_info(d)[0]["seed"]) for d in run_dirs(folder)
                if read_text(d / "train.json") is not None}
        keep = lambda df: df[[(a, s) in done for a, s in zip(df["arm"], df["seed"])]] if len(df) else df  # noqa: E731
        samples, heldout = keep(collect(folder, world, "rollouts")), keep(collect(folder, world, "heldout"))
        if samples.empty:
            raise FileNotFoundError(f"{folder}: no scored rollouts (the runs have not finished)")
        name = exp.world
        runs[name], exps[name] = per_run(samples, heldout, exp), exp
        tables[name], refs[name] = arm_table(runs[name]), reference(world, run_dirs(folder)[0])
        data[name] = (step_curves(samples), step_curves(heldout) if len(heldout) else heldout)
        secs = [sum(h.get("step_time", 0) for h in json.loads(t)["history"])
                for t in (read_text(d / "train.json") for d in run_dirs(folder)) if t]
        times[name] = float(np.mean(secs)) if secs else float("nan")
    comp = comparisons(runs, max_steps={w: e.max_steps for w, e in exps.items()})
    note = ("SIMULATED workers (lemon.testbed); bands = 95% bootstrap CI of the mean over seeds; legend = seeds; "
            f"regenerate: python -m lemon.testbed.study {root}")
    save(curves_grid(data, refs, note), out / "plots" / "curves.png")
    (out / "study.json").write_text(json.dumps({
        "worlds": {w: {"reference": refs[w], "arms": tables[w].to_dict(orient="records"),
                       "runs": runs[w].to_dict(orient="records"), "train_s_per_run": times[w],
                       "config": {k: v
                                  for k, v in json.loads((root / w / "experiment.json").read_text())["config"].items()}}
                   for w in runs},
        "comparisons": comp.to_dict(orient="records")}, indent=1, default=str))
    md = ["# CF-GRPO vs global GRPO across worlds (SIMULATED workers, issue 30)", "",
          f"Regenerate: `python -m lemon.testbed.study {root}` (runs: `bash experiments/cf_seeds.sh {root}`).", "",
          "Regret = oracle expected reward - the spec's exact expected reward (0 = optimal). `start_regret` = "
          "greedy held-out regret of the policy before training (step 0). Invalid specs are inside regret at "
          "reward r_invalid; `*_valid` averages valid specs only and `*_invalid` is their share. CIs: 95% "
          "bootstrap over seeds.", "",
          "## Reference per world", "",
          md_table(pd.DataFrame([{"world": w, "types": ", ".join(r["types"]), "oracle reward": r["oracle_reward"],
                                  "best fixed reward": r["best_fixed_reward"],
                                  "best fixed regret": r["best_fixed_regret"], "train s / run": times[w]}
                                  for w, r in refs.items()])), ""]
    for w in runs:
        e = exps[w]
        md += [f"## {w}", "", f"{e.max_steps} steps, {e.train_questions} training / {e.heldout_questions} held-out "
               f"questions, base `{e.base}`, overrides {dict(e.train_overrides)}; threshold {e.threshold:g} "
               f"({e.smooth}-step running mean).", "", md_table(_fmt(tables[w])), ""]
    cols = ["world", "arm", "vs", "metric", "n", "diff", "diff_ci", "dz", "arm_better", "ref_better", "ties",
            "p_sign_holm", "p_wilcoxon", "p_wilcoxon_holm", "ci90", "p_tost_holm", "verdict"]
    md += ["## Paired by seed: each arm minus global GRPO", "",
           "diff < 0 favours the arm for regrets and steps, diff > 0 for mean reward. Holm over all rows of "
           "this table, separately for each test. `ci90` and `p_tost`: two one-sided paired t-tests of |diff| < 0.05 "
           "(equivalence; steps to threshold has no margin). Verdict: separated (Wilcoxon), else equivalent (TOST), "
           "else inconclusive.",
           "", "Metrics: " + "; ".join(f"`{m}` = {d}" for m, (d, _, _) in METRICS.items()) + ".", "",
           md_table(_fmt(comp[cols])) if len(comp) else "(no global arm: nothing to pair)", "",
           "![curves](plots/curves.png)", ""]
    p = out / "study.md"
    p.write_text("\n".join(md) + "\n")
    return p


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root", type=Path, help="folder with one <world>/experiment.json per world")
    ap.add_argument("--out", type=Path, default=None, help="where study.md / study.json / plots go (default: root)")
    a = ap.parse_args(argv)
    try:
        p = study(a.root, a.out)
    except (FileNotFoundError, ValueError) as e:
        print(f"study: {e}", file=sys.stderr)
        return 2
    print(p.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
