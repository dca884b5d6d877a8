"""Paired comparisons of two evaluated methods on the same questions: the study's answer to "does training help?".

Two methods evaluated on the same EVAL-pool questions (same ids, same seed) are compared question by question: the
difference in accuracy, a percentile bootstrap CI over questions (resampled within each benchmark, so every resample
keeps the benchmark mix), the discordant counts (A right and B wrong, and the reverse) and the exact two-sided McNemar
p-value (a binomial test on the discordant pairs). A comparison whose CI includes 0 says so in words: at that n it
cannot tell the methods apart, which is different from "no effect". Also what the compared policies' specs look like
(spec_composition: a policy collapsed to one spec is a finding). Pure functions of results.jsonl rows; summary.md leads
with lemon.study.plots.headline_md.
"""
from __future__ import annotations

import json
from math import comb
from pathlib import Path

import numpy as np
import pandas as pd

from lemon import benchmarks as B
from lemon.eval.runner import read_rows
from lemon.spec import SpecError, parse_spec
from lemon.study.paths import StudyPaths


def paired(rows_a: dict[str, list[dict]], rows_b: dict[str, list[dict]], *, n_boot: int = 2000, seed: int = 0,
           level: float = 0.95) -> dict | None:
    """Compare A with B on the questions both answered. rows_*: {benchmark: results.jsonl rows}. Returns n, both
    accuracies, delta = acc(A) - acc(B), its bootstrap CI, wins (A right, B wrong), losses (the reverse), the McNemar
    p-value and the benchmarks used; None when no question was answered by both."""
    strata, used = [], []  # one (n_b,) array of (correct_A - correct_B) per benchmark with common questions
    acc_a = acc_b = n = 0
    for b in sorted(set(rows_a) & set(rows_b)):
        ca = {r["id"]: bool(r["correct"]) for r in rows_a[b]}
        cb = {r["id"]: bool(r["correct"]) for r in rows_b[b]}
        ids = sorted(set(ca) & set(cb))
        if not ids:
            continue
        a, bb = np.array([ca[i] for i in ids], float), np.array([cb[i] for i in ids], float)
        strata.append(a - bb)
        used.append(b)
        acc_a, acc_b, n = acc_a + a.sum(), acc_b + bb.sum(), n + len(ids)
    if not n:
        return None
    d = np.concatenate(strata)
    wins, losses = int((d > 0).sum()), int((d < 0).sum())
    rng = np.random.default_rng(seed)
    # stratified bootstrap: each benchmark's questions resampled within it, (n_boot, n_b) draws summed per resample,
    # added over benchmarks and divided by n -> (n_boot,) deltas
    boot = sum(rng.choice(s, size=(n_boot, len(s)), replace=True).sum(axis=1) for s in strata) / n
    lo, hi = np.quantile(boot, [(1 - level) / 2, 1 - (1 - level) / 2])
    return {"n": n, "acc_a": acc_a / n, "acc_b": acc_b / n, "delta": float(d.mean()), "ci": (float(lo), float(hi)),
            "wins": wins, "losses": losses, "p_mcnemar": mcnemar_p(wins, losses),
            "benchmarks": used}


def mcnemar_p(wins: int, losses: int) -> float:
    """Exact two-sided McNemar test: P(a split at least this uneven) of wins + losses fair coin flips (1.0 for none)."""
    k, m = min(wins, losses), wins + losses
    if m == 0:
        return 1.0
    return float(min(1.0, 2 * sum(comb(m, i) for i in range(k + 1)) / 2 ** m))


def verdict(res: dict, a: str, b: str) -> str:
    """One sentence: which method the CI favours, or that this n cannot tell them apart."""
    lo, hi = res["ci"]
    if lo > 0:
        return f"{a} better"
    if hi < 0:
        return f"{b} better"
    return f"not separated at n={res['n']} (CI includes 0)"


def load_rows(folders: dict[str, Path]) -> dict[str, list[dict]]:
    """{benchmark: results.jsonl rows} from {benchmark: eval folder}; benchmarks with no rows yet are left out."""
    rows = {b: read_rows(Path(f) / "results.jsonl") for b, f in folders.items()}
    return {b: r for b, r in rows.items() if r}


def comparisons(pairs: list[tuple[str, str, dict, dict]]) -> pd.DataFrame:
    """A table of paired(A, B) for each (name A, name B, rows A, rows B); pairs with no common question are left out."""
    out = []
    for a, b, ra, rb in pairs:
        res = paired(ra, rb)
        if res is None:
            continue
        out.append({"A": a, "B": b, "n": res["n"], "acc A": res["acc_a"], "acc B": res["acc_b"], "delta": res["delta"],
                    "95% CI": f"[{res['ci'][0]:+.3f}, {res['ci'][1]:+.3f}]",
                    "A only / B only": f"{res['wins']} / {res['losses']}", "McNemar p": res["p_mcnemar"],
                    "verdict": verdict(res, a, b)})
    return pd.DataFrame(out)


def study_comparisons(cfg, root: Path) -> pd.DataFrame:
    """The study's paired table: the trained policy ('lemon', notebook 04) against each training variant of notebook 03
    (evaluated on the ablation sample, a prefix of the eval sample: paired on the questions both saw) and against every
    other method of notebook 04. 'full' at the main run's step count is the main adapter itself and is left out."""
    paths = StudyPaths(root)
    lemon = load_rows({b: paths.eval_dir("lemon", b) for b in cfg.benchmarks})
    pairs = []
    for v in cfg.ablation_variants:
        if cfg.is_main_run(v):
            continue
        name = "sft (warm start, no RL)" if v == "sft" else f"{v} ({cfg.ablation_steps} steps)"
        pairs.append(("lemon", name, lemon,
                      load_rows({b: paths.variant_eval_dir(v, b) for b in cfg.ablation_benchmarks})))
    for m in cfg.eval_methods:
        if m != "lemon":
            label = m if m == "prompted" or "@" in m else f"{m}@{cfg.baseline_capacity}"
            if m == "best-fixed":
                choice = paths.root / "select" / "choice.json"
                label = f"best-fixed (= {json.loads(choice.read_text())['chosen']})" if choice.exists() else m
            pairs.append(("lemon", label, lemon, load_rows({b: paths.eval_dir(m, b) for b in cfg.benchmarks})))
    return comparisons(pairs)


def policy_specs(cfg, root: Path, prompts) -> dict[str, dict]:
    """{method: {(benchmark, id): Spec or None}} of the trained policy ('lemon') and each evaluated variant, parsed from
    their results (None: the text did not parse)."""
    paths = StudyPaths(root)
    where = {"lemon": (cfg.benchmarks, lambda b: paths.eval_dir("lemon", b))}
    for v in cfg.ablation_variants:
        where[v] = (cfg.ablation_benchmarks, lambda b, v=v: paths.variant_eval_dir(v, b))
    out = {}
    for m, (benches, folder) in where.items():
        specs = {}
        for b in benches:
            roles = prompts.roles_for(B.get_benchmark(b).domain)
            for r in read_rows(folder(b) / "results.jsonl"):
                try:
                    specs[(b, r["id"])] = parse_spec(r.get("spec") or "", base_roles=roles)
                except SpecError:
                    specs[(b, r["id"])] = None
        if specs:
            out[m] = specs
    return out


def _shape(s):
    """A spec's structure: base roles, capacities, edges and final (duties and role names ignored)."""
    return (tuple((a.base_role, a.capacity, a.depends_on) for a in s.agents), s.final) if s is not None else None


def spec_composition(specs: dict[str, dict], reference: str | tuple[str, ...] | None = "sft") -> pd.DataFrame:
    """What each policy's evaluation specs look like: {method: {question: Spec or None (invalid)}} -> per method n,
    valid share, distinct structures (_shape) over the questions, mean agents and edges, the share of agents at each
    capacity, and (for each `reference` method that is there: one name or several) on how many shared questions its
    structure differs from the reference's: 0 = training did not move the greedy spec anywhere. One structure for every
    question = a collapsed policy."""
    refs = (reference,) if isinstance(reference, str) else tuple(reference or ())
    out = []
    for m, by_q in specs.items():
        ss = list(by_q.values())
        valid = [s for s in ss if s is not None]
        agents = [a for s in valid for a in s.agents]
        row = {"method": m, "n": len(ss), "valid": len(valid) / len(ss) if ss else float("nan"),
               "distinct": len({_shape(s) for s in valid}),
               "agents": float(np.mean([len(s.agents) for s in valid])) if valid else float("nan"),
               "edges": (float(np.mean([sum(len(a.depends_on) for a in s.agents) for s in valid])) if valid
                         else float("nan"))}
        for c in ("small", "medium", "large"):
            row[f"{c} share"] = sum(a.capacity == c for a in agents) / len(agents) if agents else float("nan")
        row["final large"] = (float(np.mean([s.agent(s.final).capacity == "large" for s in valid])) if valid
                              else float("nan"))
        for ref in (r for r in refs if r in specs):  # the reference's own row names it instead of leaving a nan
            shared = sorted(set(by_q) & set(specs[ref]))
            row[f"differs from {ref}"] = "(reference)" if m == ref else \
                f"{sum(_shape(by_q[q]) != _shape(specs[ref][q]) for q in shared)}/{len(shared)}"
        out.append(row)
    return pd.DataFrame(out)
