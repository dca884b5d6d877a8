"""Statistics of a testbed comparison (lemon.testbed.experiment), computed from scored samples (experiment.collect):
per-step curves, bootstrap bands and CIs over seeds, steps to a regret threshold, final regret, the paired-by-seed
comparison against global GRPO, and what the sampled specs look like. Pure functions of DataFrames: tested on
hand-written run folders."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

if TYPE_CHECKING:
    from lemon.testbed.experiment import ExperimentConfig


def step_curves(samples: pd.DataFrame) -> pd.DataFrame:
    """Per (arm, seed, step): mean expected reward and regret of the policy's samples, valid rate, n."""
    g = samples.groupby(["arm", "seed", "step"])
    return g.agg(expected_reward=("expected_reward", "mean"), regret=("regret", "mean"), valid=("valid", "mean"),
                 n=("regret", "size")).reset_index()


def bootstrap_ci(values, n_boot: int = 2000, seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap CI of the mean (resampling the values, e.g. one per seed). NaN for no values."""
    v = np.asarray([x for x in values if x is not None and np.isfinite(x)], dtype=float)
    if len(v) == 0:
        return float("nan"), float("nan")
    means = np.random.default_rng(seed).choice(v, size=(n_boot, len(v)), replace=True).mean(axis=1)
    a = (1 - level) / 2
    return float(np.quantile(means, a)), float(np.quantile(means, 1 - a))


def band(curves: pd.DataFrame, metric: str) -> pd.DataFrame:
    """Per (arm, step): mean over seeds of `metric` and its bootstrap band (seeds resampled), and the seed count."""
    out = []
    for (arm, step), g in curves.groupby(["arm", "step"]):
        lo, hi = bootstrap_ci(g[metric].tolist())
        out.append({"arm": arm, "step": step, "mean": g[metric].mean(), "lo": lo, "hi": hi, "seeds": len(g)})
    return pd.DataFrame(out, columns=["arm", "step", "mean", "lo", "hi", "seeds"])


def steps_to_threshold(curve: pd.DataFrame, threshold: float, smooth: int) -> int | None:
    """First step at which the running mean (window `smooth`, trailing) of one run's regret is <= threshold; None if
    never."""
    c = curve.sort_values("step")
    run = c["regret"].rolling(smooth, min_periods=smooth).mean()
    hit = c["step"][run <= threshold]
    return int(hit.iloc[0]) if len(hit) else None


def summary_table(curves: pd.DataFrame, exp: ExperimentConfig, heldout: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per arm: final regret (mean of the last final_window steps, per seed) and steps to threshold, each with a
    bootstrap CI over seeds; how many seeds reached the threshold; the last held-out greedy regret when evaluated."""
    rows = []
    for arm in [a for a in exp.arms if a in set(curves["arm"])]:
        finals = list(_final_regrets(curves, arm, exp).values())
        steps = [steps_to_threshold(c, exp.threshold, exp.smooth)
                 for _, c in curves[curves["arm"] == arm].groupby("seed")]
        reached = [s for s in steps if s is not None]
        row = {"arm": arm, "seeds": len(finals), "final_regret": float(np.mean(finals)),
               "final_regret_ci": bootstrap_ci(finals), "reached": f"{len(reached)}/{len(steps)}",
               "steps_to_threshold": float(np.mean(reached)) if reached else float("nan"),
               "steps_ci": bootstrap_ci(reached)}
        if heldout is not None and len(heldout) and arm in set(heldout["arm"]):
            h = step_curves(heldout[heldout["arm"] == arm])
            last = h[h["step"] == h["step"].max()]
            row["heldout_step"], row["heldout_regret"] = int(last["step"].iloc[0]), float(last["regret"].mean())
            row["heldout_ci"] = bootstrap_ci(last["regret"].tolist())
        rows.append(row)
    return pd.DataFrame(rows)


def _final_regrets(curves: pd.DataFrame, arm: str, exp: ExperimentConfig) -> dict:
    """{seed: mean regret of the arm's samples over its last exp.final_window steps}."""
    c = curves[curves["arm"] == arm]
    return {s: g.sort_values("step").tail(exp.final_window)["regret"].mean() for s, g in c.groupby("seed")}


def _per_seed(curves: pd.DataFrame, heldout: pd.DataFrame | None, arm: str, exp: ExperimentConfig) -> dict:
    """{metric: {seed: value}} of one arm: final regret of its samples, and held-out greedy regret and gain (expected
    reward at the last evaluated step minus step 0)."""
    out = {"final_regret": _final_regrets(curves, arm, exp), "heldout_regret": {}, "heldout_gain": {}}
    if heldout is not None and len(heldout):
        for s, g in heldout[heldout["arm"] == arm].groupby("seed"):
            last = g[g["step"] == g["step"].max()]
            out["heldout_regret"][s] = last["regret"].mean()
            if (g["step"] == 0).any() and g["step"].max() > 0:
                out["heldout_gain"][s] = last["expected_reward"].mean() - g[g["step"] == 0]["expected_reward"].mean()
    return out


def paired_table(curves: pd.DataFrame, heldout: pd.DataFrame | None, exp: ExperimentConfig,
                 base: str = "global") -> pd.DataFrame:
    """Each arm minus `base`, paired by seed (a seed fixes the questions, the first step's samples and the edit RNG, so
    the seeds are the units): mean difference, its bootstrap CI over seeds, and in how many seeds the arm did better
    (lower regret, higher gain). Only seeds both arms finished count; empty when `base` was not run."""
    cols = ["arm", "vs", "metric", "seeds", "diff", "diff_ci", "arm_better"]
    if base not in set(curves["arm"]):
        return pd.DataFrame(columns=cols)
    ref, rows = _per_seed(curves, heldout, base, exp), []
    for arm in [a for a in exp.arms if a != base and a in set(curves["arm"])]:
        mine = _per_seed(curves, heldout, arm, exp)
        for metric, higher_better in (("final_regret", False), ("heldout_regret", False), ("heldout_gain", True)):
            seeds = sorted(set(mine[metric]) & set(ref[metric]))
            if not seeds:
                continue
            d = [mine[metric][s] - ref[metric][s] for s in seeds]
            better = sum((x > 0) if higher_better else (x < 0) for x in d)
            rows.append({"arm": arm, "vs": base, "metric": metric, "seeds": len(seeds), "diff": float(np.mean(d)),
                         "diff_ci": bootstrap_ci(d), "arm_better": f"{better}/{len(d)}"})
    return pd.DataFrame(rows, columns=cols)


def composition(samples: pd.DataFrame, steps: int = 2) -> pd.DataFrame:
    """Per arm, the policy's samples of its first and of its last `steps` steps (pooled over seeds): mean agents per
    spec, share of large agents, share of specs whose final agent is a large solver, share of distinct spec shapes."""
    out = []
    for arm, g in samples.groupby("arm", sort=False):
        lo, hi = sorted(g["step"].unique())[:steps], sorted(g["step"].unique())[-steps:]
        for phase, part in (("first", g[g["step"].isin(lo)]), ("last", g[g["step"].isin(hi)])):
            v = part[part["valid"]]
            shapes = set(zip(v["agents"], v["final_role"], v["final_capacity"]))
            out.append({"arm": arm, "phase": f"{phase} {len(lo if phase == 'first' else hi)} steps", "n": len(part),
                        "agents": v["agents"].mean(), "large_share": v["large_share"].mean(),
                        "final_large_solver": ((v["final_role"] == "solver") & (v["final_capacity"] == "large")).mean(),
                        "distinct_shapes": len(shapes) / max(len(v), 1),
                        "expected_reward": part["expected_reward"].mean()})
    return pd.DataFrame(out)


# ---- paired tests across seeds (scipy is not a dependency, so the exact null distributions are computed here) --------
def sign_test(diffs) -> float:
    """Two-sided exact sign test of paired differences: p = P(|#pos - n/2| >= observed) under Binomial(n, 1/2), zero
    differences dropped (the usual convention). 1.0 when every difference is zero."""
    d = [x for x in diffs if x != 0]
    n, k = len(d), sum(x > 0 for x in d)
    if n == 0:
        return 1.0
    from math import comb
    tail = sum(comb(n, i) for i in range(0, min(k, n - k) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def wilcoxon_signed_rank(diffs, tol: float = 1e-12) -> tuple[float, float]:
    """Two-sided exact Wilcoxon signed-rank test: (W+, p). Zeros dropped (Wilcoxon's convention); tied |d| get mid-ranks
    and the null distribution is enumerated exactly over the 2^n sign assignments of THOSE ranks (a DP over doubled
    ranks, so ties stay exact). p = P(|W+ - E W+| >= |observed - E W+|). (nan, 1.0) when every difference is zero."""
    d = np.asarray([x for x in diffs if abs(x) > tol], dtype=float)
    n = len(d)
    if n == 0:
        return float("nan"), 1.0
    a = np.abs(d)
    order = np.argsort(a, kind="mergesort")
    ranks = np.empty(n)
    i = 0
    while i < n:  # mid-ranks for |d| tied within tol
        j = i
        while j + 1 < n and abs(a[order[j + 1]] - a[order[i]]) <= tol:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2 + 1
        i = j + 1
    r2 = (2 * ranks).round().astype(int)  # doubled ranks are integers
    w_plus2 = int(r2[d > 0].sum())
    dist = np.zeros(int(r2.sum()) + 1)
    dist[0] = 1.0
    for r in r2:  # null: each rank's sign is + or - with probability 1/2
        dist = dist / 2 + np.concatenate([np.zeros(r), dist[:-r]]) / 2 if r else dist
    mean2 = r2.sum() / 2
    support = np.arange(len(dist))
    p = float(dist[np.abs(support - mean2) >= abs(w_plus2 - mean2) - 1e-9].sum())
    return w_plus2 / 2, min(1.0, p)


def holm(pvalues) -> list[float]:
    """Holm-Bonferroni adjusted p-values (step-down, monotone), in the input order."""
    p = np.asarray(pvalues, dtype=float)
    m = len(p)
    out, running = np.empty(m), 0.0
    for rank, i in enumerate(np.argsort(p, kind="mergesort")):
        running = max(running, min(1.0, (m - rank) * p[i]))
        out[i] = running
    return out.tolist()


def paired_effect(diffs, lower_is_better: bool = True) -> dict:
    """Of paired differences (arm minus reference, one per seed): the mean with its bootstrap CI, Cohen's d_z (mean / sd
    of the differences; nan for < 2 values or sd 0), how many seeds favour the arm / the reference / tie, both tests'
    p."""
    d = np.asarray(list(diffs), dtype=float)
    sd = d.std(ddof=1) if len(d) > 1 else float("nan")
    w, p_w = wilcoxon_signed_rank(d)
    better, worse = (d < 0, d > 0) if lower_is_better else (d > 0, d < 0)
    return {"n": len(d), "diff": float(d.mean()) if len(d) else float("nan"), "diff_ci": bootstrap_ci(d),
            "dz": float(d.mean() / sd) if sd and sd == sd else float("nan"), "arm_better": int(better.sum()),
            "ref_better": int(worse.sum()), "ties": int((d == 0).sum()), "p_sign": sign_test(d), "W+": w,
            "p_wilcoxon": p_w}


# ---- equivalence (TOST): is a null a confident null? -----------------------------------------------------------------
def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularised incomplete beta (modified Lentz; Numerical Recipes 3rd ed. §6.4)."""
    tiny, c, d = 1e-300, 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-14:
            break
    return h


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with df degrees of freedom, through the regularised incomplete beta I_x(df/2, 1/2)."""
    from math import exp, lgamma, log
    if t != t:
        return float("nan")
    x = df / (df + t * t)
    a, b = df / 2.0, 0.5
    front = exp(lgamma(a + b) - lgamma(a) - lgamma(b) + a * log(x) + b * log(1.0 - x)) if 0 < x < 1 else 0.0
    ib = front * _betacf(a, b, x) / a if x < (a + 1) / (a + b + 2) else 1.0 - front * _betacf(b, a, 1.0 - x) / b
    ib = 1.0 if x >= 1 else ib
    tail = 0.5 * ib  # P(T > |t|)
    return 1.0 - tail if t > 0 else tail


def tost(diffs, margin: float) -> dict:
    """Paired two one-sided t-tests (Schuirmann 1987) of |mean difference| < margin: p = max of the two one-sided
    p-values (equivalence when p < alpha; the same as the 1 - 2 alpha t-interval lying inside +/- margin), with that 90%
    interval. nan for fewer than 2 differences; a zero spread gives p 0 or 1 by whether the mean is inside the
    margin."""
    d = np.asarray([x for x in diffs if x == x], dtype=float)
    n = len(d)
    if n < 2:
        return {"tost_margin": margin, "p_tost": float("nan"), "ci90": (float("nan"), float("nan"))}
    mean, se = float(d.mean()), float(d.std(ddof=1) / np.sqrt(n))
    if se == 0:
        return {"tost_margin": margin, "p_tost": 0.0 if abs(mean) < margin else 1.0, "ci90": (mean, mean)}
    df = n - 1
    p_low = 1.0 - t_cdf((mean + margin) / se, df)  # H0: mean <= -margin
    p_high = t_cdf((mean - margin) / se, df)  # H0: mean >= +margin
    lo, hi = 0.0, 50.0  # the 95% one-sided t quantile, by bisection on t_cdf
    for _ in range(80):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < 0.95 else (lo, mid)
    q = (lo + hi) / 2
    return {"tost_margin": margin, "p_tost": max(p_low, p_high), "ci90": (mean - q * se, mean + q * se)}
