"""summary.md and plots of the real-worker CF vs global comparison (experiments.duel.legs), from ref/ alone: whatever
legs have run, it reports what exists and lists what is missing (nothing is filled in or skipped silently).

Sections, most decisive first: the paired comparisons on the EVAL-pool sample (CF vs global, each vs the warm start, vs
each baseline; bootstrap CI within benchmarks, McNemar, lemon.study.compare), the dev-set learning curves, training
curves (reward per step of both arms), spec composition of each policy's greedy specs (available before execution: a
collapsed policy shows), per-benchmark accuracy and tokens with a Pareto plot, and the legs that ran.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd

from lemon.study.compare import comparisons, load_rows, spec_composition
from lemon.study.plots import md_table
from lemon.eval.runner import read_rows
from experiments.duel.legs import ARMS, POLICIES, DuelConfig, cli, eval_dir, question_sets, spec_file, spec_points

BASELINE_ORDER = ("cot@small", "cot@medium", "cot@large", "sc-cot@medium", "complete@medium", "prompted", "best-fixed")


def evaluated(d: DuelConfig) -> dict[str, dict[str, list[dict]]]:
    """{method: {benchmark: rows}} of every method with results on the eval sample, policies first."""
    root = d.refdir / "eval"
    found = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.exists() else []
    order = ([m for m in (*POLICIES, *BASELINE_ORDER) if m in found]
             + [m for m in found if m not in (*POLICIES, *BASELINE_ORDER)])
    out = {m: load_rows({b: eval_dir(d, m, b) for b in d.study().benchmarks}) for m in order}
    chosen = fixed_choice(d)
    if chosen and out.get(chosen):  # best-fixed's rows are the chosen method's (duel.run_method), named as such
        out[f"best-fixed (= {chosen})"] = out[chosen]
    return {m: r for m, r in out.items() if r}


def fixed_choice(d: DuelConfig) -> str | None:
    """The method 'best-fixed' chose on TRAIN-pool questions (ref/select/choice.json), or None before that leg ran."""
    f = d.refdir / "select" / "choice.json"
    return json.loads(f.read_text())["chosen"] if f.exists() else None


def paired_table(d: DuelConfig, ev: dict) -> pd.DataFrame:
    """cf vs global first (the question), then each arm vs the warm start, then each arm vs every baseline."""
    pairs = []
    if "cf" in ev and "global" in ev:
        pairs.append(("cf", "global", ev["cf"], ev["global"]))
    for arm in ARMS:
        if arm in ev and "sft" in ev:
            pairs.append((arm, "sft", ev[arm], ev["sft"]))
    for arm in ARMS:
        for m in ev:
            if m not in POLICIES and arm in ev:
                pairs.append((arm, m, ev[arm], ev[m]))
    return comparisons(pairs)


def per_benchmark(ev: dict) -> pd.DataFrame:
    """Per method: accuracy and n on each benchmark (in one column order for all, '-' where none ran yet), overall
    accuracy, mean worker and orchestrator tokens per question."""
    rows, benches = [], list(dict.fromkeys(b for by_b in ev.values() for b in by_b))
    for m, by_b in ev.items():
        allr = [r for rs in by_b.values() for r in rs]
        row = {"method": m}
        for b in benches:
            rs = by_b.get(b, [])
            row[f"{b} acc"] = sum(r["correct"] for r in rs) / len(rs) if rs else "-"
            row[f"{b} n"] = len(rs)
        row.update({"accuracy": sum(r["correct"] for r in allr) / len(allr), "n": len(allr),
                    "worker tokens": sum(r["tokens"] for r in allr) / len(allr),
                    "orchestrator tokens": sum(r.get("orchestrator_tokens", 0) for r in allr) / len(allr)})
        rows.append(row)
    return pd.DataFrame(rows)


def dev_curves(d: DuelConfig) -> pd.DataFrame:
    """Dev-set accuracy of each policy at each recorded step (step 0 = the warm start, shared by both arms)."""
    rows, benches = [], d.study().train.benchmarks
    for arm in POLICIES:
        for step, _, which in sorted(spec_points(d, arm), key=lambda x: x[0]):  # the curve in step order
            if "dev" not in which:
                continue
            rs = [r for b in benches for r in read_rows(eval_dir(d, arm, b, "dev", step) / "results.jsonl")]
            if rs:
                rows.append({"policy": arm, "step": step, "n": len(rs),
                             "accuracy": sum(r["correct"] for r in rs) / len(rs),
                             "worker tokens": sum(r["tokens"] for r in rs) / len(rs)})
    return pd.DataFrame(rows)


def capacity_share(texts: list[str], capacity: str = "large") -> float:
    """Share of agents at `capacity` in grammar-constrained spec texts (each agent has one `capacity: <level>` line)."""
    caps = [m for t in texts for m in re.findall(r"capacity: *(small|medium|large)", t)]
    return sum(c == capacity for c in caps) / len(caps) if caps else float("nan")


def training_curves(d: DuelConfig) -> pd.DataFrame:
    """Per arm and step: mean reward and success of the kept rollouts, the share of large agents they sampled, CF terms
    that reached the loss, the step's sampling + scoring + CF seconds (loss and backward not included)."""
    rows = []
    for arm in ARMS:
        roll = read_rows(d.refdir / arm / "rollouts.jsonl")
        for m in read_rows(d.refdir / arm / "metrics.jsonl"):
            if "reward" in m:
                texts = [r["text"] for r in roll if r["step"] == m["step"] and r.get("kept", True)]
                rows.append({"arm": arm, "step": m["step"], "reward": m["reward"], "success": m.get("rollouts/success"),
                             "large share": capacity_share(texts), "cf active": m.get("cf/active"),
                             "sample+score+cf s": sum(m.get(k, 0) or 0
                                                      for k in ("step/sample_s", "step/score_s", "step/cf_s"))})
    return pd.DataFrame(rows)


def recorded_specs(d: DuelConfig, prompts, which: str = "eval") -> dict[str, dict]:
    """{policy: {(benchmark, id): Spec or None}} of each policy's final greedy specs (from the spec files)."""
    from lemon import benchmarks as B
    from lemon.spec import SpecError, parse_spec
    out, max_agents = {}, d.study().train.max_agents
    for arm in POLICIES:
        step = 0 if arm == "sft" else d.steps
        specs = {}
        for r in read_rows(spec_file(d, arm, step, which)):
            try:
                specs[(r["benchmark"], r["id"])] = parse_spec(r["text"], base_roles=prompts.roles_for(
                    B.get_benchmark(r["benchmark"]).domain), max_agents=max_agents)
            except SpecError:
                specs[(r["benchmark"], r["id"])] = None
        if specs:
            out[arm] = specs
    return out


def missing(d: DuelConfig) -> list[str]:
    """What the comparison still lacks, each with the command that makes it."""
    sets = question_sets(d)
    need = {"eval": sum(len(v) for v in sets["eval"].values()), "dev": sum(len(v) for v in sets["dev"].values())}
    out = []
    for arm in ARMS:
        if not (d.refdir / arm / "train.json").exists():
            out.append(f"arm {arm}: not trained (`{cli(d)} train --arm {arm}`)")
    for arm in POLICIES:
        for step, _, which in spec_points(d, arm):
            for w in which:
                rows = read_rows(spec_file(d, arm, step, w))
                n, shas = len(rows), sorted({r["adapter_sha256"][:12] for r in rows})
                if len(shas) > 1:  # e.g. a warm start rebuilt on another CPU finished the file: not one policy's specs
                    out.append(f"{arm} step {step} {w} specs come from {len(shas)} different adapters "
                               f"({', '.join(shas)}): rewrite them with one (delete the file, rerun `{cli(d)} specs`)")
                if n < need[w]:
                    out.append(f"{arm} step {step}: {n}/{need[w]} {w} specs (`{cli(d)} specs --arm {arm}`, needs the "
                               f"adapter: same machine as its training)")
    ev, chosen = evaluated(d), fixed_choice(d)
    for m in (*POLICIES, *BASELINE_ORDER):
        n = sum(len(v) for v in ev.get(chosen if m == "best-fixed" else m, {}).values())  # its rows are chosen's
        if n < need["eval"]:
            out.append(f"{m}: {n}/{need['eval']} eval questions executed (`{cli(d)} exec {m}`)")
    return out


def plots(d: DuelConfig, ev: dict, dev: pd.DataFrame, tr: pd.DataFrame) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out, pdir = [], d.refdir / "plots"
    pdir.mkdir(parents=True, exist_ok=True)
    if not tr.empty:
        fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))
        for arm, g in tr.groupby("arm"):
            ax[0].plot(g["step"], g["reward"], marker="o", label=arm)
            ax[1].plot(g["step"], g["success"], marker="o", label=arm)
        ax[0].set(xlabel="step", ylabel="mean reward of kept rollouts", title="training reward")
        ax[1].set(xlabel="step", ylabel="success rate of kept rollouts", title="training success")
        ax[0].legend()
        fig.tight_layout()
        fig.savefig(pdir / "training.png", dpi=110)
        plt.close(fig)
        out.append("plots/training.png")
    if not dev.empty:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        sft = dev[dev.policy == "sft"]
        # equal curves stay visible
        style = {"cf": dict(ls="-", marker="o", ms=9), "global": dict(ls="--", marker="s", ms=5)}
        for arm in ARMS:
            g = pd.concat([sft, dev[dev.policy == arm]]).sort_values("step")
            if len(g):
                ax.plot(g["step"], g["accuracy"], label=arm, **style.get(arm, {}))
        ax.set(xlabel="CF-GRPO step (0 = SFT warm start)", ylabel="dev accuracy",
               title=f"held-out TRAIN-pool dev set (n={int(dev['n'].max())})")
        ax.legend()
        fig.tight_layout()
        fig.savefig(pdir / "dev_curves.png", dpi=110)
        plt.close(fig)
        out.append("plots/dev_curves.png")
    pb = per_benchmark(ev)
    if not pb.empty:
        fig, ax = plt.subplots(figsize=(6, 4))
        for _, r in pb.iterrows():
            ax.scatter(r["worker tokens"], r["accuracy"], color="C3" if r["method"] in POLICIES else "C0")
            ax.annotate(f"{r['method']} (n={r['n']})", (r["worker tokens"], r["accuracy"]), fontsize=8,
                        xytext=(4, 4), textcoords="offset points")
        ax.set(xlabel="mean worker tokens per question", ylabel="accuracy",
               title="accuracy vs worker tokens (eval sample)")
        fig.tight_layout()
        fig.savefig(pdir / "pareto.png", dpi=110)
        plt.close(fig)
        out.append("plots/pareto.png")
    return out


def report(d: DuelConfig, prompts) -> Path:
    """Write ref/summary.md (and plots) from whatever the legs have recorded; returns its path."""
    cfg, ev = d.study(), evaluated(d)
    tr, dev = training_curves(d), dev_curves(d)
    md = lambda df: md_table(df) if not df.empty else "(nothing recorded yet)"  # noqa: E731
    pt = paired_table(d, ev)
    specs = recorded_specs(d, prompts)
    # once both arms have specs: where their structures agree, cf vs global compares duty/role texts only
    comp = spec_composition(specs, reference=("sft", "cf") if "global" in specs else "sft")
    legs = read_rows(d.refdir / "legs.jsonl")
    lines = [
        "# Real-worker CF-GRPO vs global GRPO (issue 13, deliverable 2)", "",
        f"Config: {d}. Trainer: the `cpu-long` study profile's (policy {cfg.train.policy.model} + LoRA "
        f"r={cfg.train.policy.lora_r}, G={cfg.train.num_generations}, "
        f"{cfg.train.batch_size // cfg.train.num_generations} questions per step, lr {cfg.train.learning_rate}, gated "
        f"reward, grammar-constrained rollouts) for {d.steps} steps per arm from one SFT warm start; cf_lambda 1.0 "
        f"(cf) vs 0.0 (global). Workers: the embedded ladder on llama-server. Eval: {d.eval_n} seeded EVAL-pool "
        f"questions per benchmark ({', '.join(cfg.benchmarks)}; seed {d.seed}); dev: {d.dev_n} held-out TRAIN-pool "
        f"questions per benchmark. Regenerate: the commands in `legs.jsonl` order (`{cli(d)} train --arm cf`, `... "
        "train --arm global`, `... specs --arm sft`, `... exec sft cf global cot@small ...`, `... report`).", "",
        "## Paired comparisons on the eval sample", "",
        "delta = accuracy(A) - accuracy(B) on the questions both answered; 95% percentile bootstrap CI "
        "resampled within benchmarks; 'A only / B only' = discordant questions; McNemar = exact two-sided test on "
        "them. A CI that includes 0 means this n cannot tell them apart.", "", md(pt), "",
        "## Dev-set learning curves (held-out TRAIN-pool questions; step 0 = the warm start)", "", md(dev), "",
        "## Training (per step, kept rollouts)", "", md(tr), "",
        "## What the policies' greedy eval specs look like", "", md(comp), "",
        "## Accuracy and tokens per benchmark (eval sample)", "", md(per_benchmark(ev)), "",
    ]
    figs = plots(d, ev, dev, tr)
    lines += [f"![]({f})" for f in figs] + [""]
    miss = missing(d)
    lines += ["## Not done yet", ""] + ([f"- {m}" for m in miss] or ["- nothing: every leg has run"]) + [""]
    lines += ["## Legs (ref/legs.jsonl)", "", md(pd.DataFrame(legs).fillna("").astype(str)), ""]
    out = d.refdir / "summary.md"
    out.write_text("\n".join(lines))
    (d.refdir / "summary.json").write_text(json.dumps({"paired": pt.to_dict("records"), "dev": dev.to_dict("records"),
                                                       "missing": miss}, indent=1, default=str))
    return out
