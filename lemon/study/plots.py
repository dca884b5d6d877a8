"""Tables and figures of the study (seaborn, saved as PNG) and its summary.md. Everything reads what the notebooks wrote
to the study folder (results.jsonl, metrics.jsonl, edit_effects.jsonl), so a table can be rebuilt at any time without a
model."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from lemon import benchmarks as B
from lemon.eval.baselines import BASELINES
from lemon.eval.runner import read_rows, summarize
from lemon.prompts import default_prompts
from lemon.report import md_table, shown_path
# re-exported, not used here: the notebooks call plots.save(...)
from lemon.report import save  # noqa: F401
from lemon.study.compare import policy_specs, spec_composition, study_comparisons
from lemon.study.config import split_method
from lemon.study.paths import StudyPaths
from lemon.train.edits import REGISTRY

FAMILY_LABEL = {f.name: f.label for f in REGISTRY.values()}  # one record per family: lemon.train.edits.REGISTRY


def _plt():
    import matplotlib
    import matplotlib.pyplot as plt
    import seaborn as sns
    if "inline" not in matplotlib.get_backend().lower():
        matplotlib.use("Agg")  # headless unless a notebook's inline backend is active
    sns.set_theme(style="whitegrid", context="notebook")
    return plt, sns


def pool_sizes(stats: pd.DataFrame):
    """Train / eval pool sizes per benchmark (log scale)."""
    plt, sns = _plt()
    fig, ax = plt.subplots(figsize=(8, 3.5))
    sns.barplot(data=stats, x="benchmark", y="n", hue="pool", ax=ax)
    ax.set(yscale="log", ylabel="questions", title="disjoint train / eval pools")
    return fig


# ---- training --------------------------------------------------------------------------------------------------------
def read_metrics(path: Path) -> pd.DataFrame:
    """Per-step training metrics (metrics.jsonl: one JSON per logged step); a resumed run's repeated steps keep the
    last."""
    rows = [r for r in read_rows(Path(path)) if "reward" in r]
    if not rows:
        return pd.DataFrame()
    return pd.DataFrame(rows).drop_duplicates("step", keep="last").sort_values("step").reset_index(drop=True)


def training_curves(m: pd.DataFrame, sft_loss: list[float] | None = None):
    """Reward and its terms, valid-spec rate, worker / CF tokens, CF delta per family, family probabilities, SFT
    loss."""
    plt, sns = _plt()
    from matplotlib.ticker import MaxNLocator
    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5))
    panels = [("reward and its terms", ["reward", "rewards/success/mean", "rewards/token_efficiency/mean",
                                        "rewards/graph_cost/mean", "rewards/invalid/mean"]),
              ("valid-spec rate (and why invalid)",
               ["spec/valid_rate", *sorted(c for c in m.columns if c.startswith("spec/invalid_"))]),
              ("worker tokens per step", ["tokens/worker_spent", "tokens/cf_spent", "tokens/cf_nominal"]),
              ("CF delta = R(orig) - R(edit)", [f"cf/delta_{f}" for f in FAMILY_LABEL]),
              ("edit-family probability", [f"cf/prob_{f}" for f in FAMILY_LABEL])]
    for ax, (title, cols) in zip(axes.flat, panels):
        cols = [c for c in cols if c in m.columns and m[c].notna().any()]
        if cols:
            long = m[["step", *cols]].melt("step", var_name="metric").dropna()
            sns.lineplot(data=long, x="step", y="value", hue="metric", marker="o", ax=ax)
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "not logged yet", ha="center", transform=ax.transAxes)
        ax.set_title(title)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax = axes.flat[5]
    if sft_loss:
        sns.lineplot(x=range(1, len(sft_loss) + 1), y=sft_loss, marker="o", ax=ax)
    ax.set(title="SFT warm-start loss", xlabel="logging step")
    fig.tight_layout()
    return fig


# ---- evaluation ------------------------------------------------------------------------------------------------------
def eval_table(root: Path, methods, benchmarks, sub=lambda root, m, b: Path(root) / "eval" / m / b) -> pd.DataFrame:
    """One row per (method, benchmark) from results.jsonl: n, accuracy with its 95% Wilson CI, mean worker tokens."""
    out = []
    for m in methods:
        for b in benchmarks:
            rows = read_rows(sub(root, m, b) / "results.jsonl")
            if not rows:
                continue
            s = summarize(rows)
            out.append({"method": m, "benchmark": b, "split": rows[0].get("split"), "n": s["n"],
                        "accuracy": s["accuracy"], "ci_lo": s["ci95"][0], "ci_hi": s["ci95"][1],
                        "tokens": s["mean_worker_tokens"],
                        "orchestrator_tokens": sum(r.get("orchestrator_tokens", 0) for r in rows) / s["n"],
                        "invalid_specs": s["invalid_specs"], "errors": s["errors"]})
    return pd.DataFrame(out)


def wide_table(t: pd.DataFrame, methods, benchmarks) -> pd.DataFrame:
    """Methods x benchmarks, each cell 'accuracy [CI] · tokens'; headers name the split and n."""
    cell = {(r.method, r.benchmark): f"{r.accuracy:.2f} [{r.ci_lo:.2f}, {r.ci_hi:.2f}] · {r.tokens:.0f}"
            for r in t.itertuples()}
    head = {b: f"{b} ({g.split.iloc[0]}, n={'/'.join(map(str, sorted(set(g.n))))})" for b, g in t.groupby("benchmark")}
    return pd.DataFrame([{"method": m, **{head[b]: cell.get((m, b), "-") for b in benchmarks if b in head}}
                         for m in methods if m in set(t.method)])


def pareto_front(costs, accs) -> list[bool]:
    """True where no other point has cost <= and accuracy >= with one of them strict (lower cost, higher accuracy
    wins)."""
    pts = list(zip(costs, accs))
    return [not any(c2 <= c and a2 >= a and (c2 < c or a2 > a) for c2, a2 in pts) for c, a in pts]


def method_summary(t: pd.DataFrame) -> pd.DataFrame:
    """Per method: macro-average accuracy over benchmarks, mean worker tokens, total n, and whether it is
    Pareto-optimal."""
    g = t.groupby("method", sort=False).agg(accuracy=("accuracy", "mean"), tokens=("tokens", "mean"), n=("n", "sum"),
                                            benchmarks=("benchmark", "count"),
                                            orchestrator_tokens=("orchestrator_tokens", "mean")).reset_index()
    g["pareto"] = pareto_front(g["tokens"].tolist(), g["accuracy"].tolist())
    return g


def pareto_plot(s: pd.DataFrame):
    plt, sns = _plt()
    fig, ax = plt.subplots(figsize=(7, 5))
    sns.scatterplot(data=s, x="tokens", y="accuracy", hue="method", style="pareto", s=120, ax=ax)
    front = s[s["pareto"]].sort_values("tokens")
    ax.step(front["tokens"], front["accuracy"], where="post", color="gray", ls="--", lw=1, label="Pareto front")
    for _, r in s.iterrows():
        ax.annotate(r["method"], (r["tokens"], r["accuracy"]), fontsize=8, xytext=(4, 4), textcoords="offset points")
    ax.set(xlabel="mean worker tokens per question", ylabel="accuracy (macro avg over benchmarks)",
           title="accuracy vs tokens")
    ax.legend(fontsize=7, loc="best")
    return fig


def accuracy_heatmap(t: pd.DataFrame):
    plt, sns = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(14, 0.45 * t["method"].nunique() + 2))
    for ax, (col, fmt, title) in zip(axes, (("accuracy", ".2f", "accuracy"), ("tokens", ".0f", "mean worker tokens"))):
        piv = t.pivot(index="method", columns="benchmark", values=col)
        sns.heatmap(piv, annot=True, fmt=fmt, cmap="viridis", ax=ax, cbar=False)
        ax.set_title(title)
    fig.tight_layout()
    return fig


# ---- ablations -------------------------------------------------------------------------------------------------------
def edit_table(rows: list[dict]) -> pd.DataFrame:
    """Mean effect of applying each edit family (edited minus original), per family and benchmark, with the edit
    count."""
    if not rows:
        return pd.DataFrame(columns=["family", "benchmark", "edits", "d_accuracy", "d_tokens"])
    d = pd.DataFrame(rows)
    return d.groupby(["family", "benchmark"]).agg(edits=("d_score", "size"), d_accuracy=("d_score", "mean"),
                                                   d_tokens=("d_tokens", "mean")).reset_index()


def edit_heatmap(e: pd.DataFrame):
    plt, sns = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(13, 3.6))
    for ax, (col, fmt, cmap) in zip(axes, (("d_accuracy", ".2f", "RdBu"), ("d_tokens", ".0f", "RdBu_r"))):
        piv = e.pivot(index="family", columns="benchmark", values=col) if len(e) else pd.DataFrame()
        if len(piv):  # symmetric colour scale around 0 (score deltas live in [-1, 1])
            lim = 1.0 if col == "d_accuracy" else max(1.0, float(piv.abs().max().max()))
            sns.heatmap(piv, annot=True, fmt=fmt, cmap=cmap, vmin=-lim, vmax=lim, ax=ax)
            ax.tick_params(axis="y", rotation=0)
        else:  # say so rather than save two empty frames (e.g. the cpu profile measures no edit effects: edit_n = 0)
            ax.text(0.5, 0.5, "no edits measured in this study", ha="center", va="center", transform=ax.transAxes)
            ax.set_axis_off()
        ax.set_title(f"{col} (edited - original)")
    fig.tight_layout()
    return fig


def ablation_table(root: Path, variants, benchmarks) -> pd.DataFrame:
    """Paper Table 2 shape: one row per training variant, accuracy and mean worker tokens per benchmark and averaged."""
    t = eval_table(root, variants, benchmarks, sub=lambda r, m, b: StudyPaths(r).variant_eval_dir(m, b))
    if t.empty:
        return t
    out = t.pivot(index="method", columns="benchmark", values=["accuracy", "tokens"])
    out.columns = [f"{b} {'acc' if k == 'accuracy' else 'tokens'}" for k, b in out.columns]
    out["avg acc"], out["avg tokens"] = t.groupby("method")["accuracy"].mean(), t.groupby("method")["tokens"].mean()
    out["n per benchmark"] = t.groupby("method")["n"].min()
    return out.reindex([v for v in variants if v in out.index]).rename_axis("variant").reset_index()


def ablation_plot(a: pd.DataFrame):
    """Average accuracy vs average tokens of the training variants."""
    if a.empty:
        return pareto_plot(pd.DataFrame({"method": [], "tokens": [], "accuracy": [], "pareto": []}))
    s = a.rename(columns={"variant": "method", "avg acc": "accuracy", "avg tokens": "tokens"})
    s["pareto"] = pareto_front(s["tokens"].tolist(), s["accuracy"].tolist())
    fig = pareto_plot(s)
    fig.axes[0].set_title("training variants: accuracy vs tokens")
    return fig


def dev_plot(d: pd.DataFrame):
    """Dev-set accuracy of each training run against its step (notebook 03's dev_curves)."""
    plt, sns = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    sns.lineplot(data=d, x="step", y="accuracy", hue="run", marker="o", ax=ax)
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"held-out TRAIN-pool dev set (n = {int(d['n'].max()) if len(d) else 0} per point)")
    fig.tight_layout()
    return fig


# ---- specs -----------------------------------------------------------------------------------------------------------
def spec_gallery(items: list[tuple[str, object]]):
    """Draw specs with lemon.study.widgets.draw_spec when available; else return their YAML. items: (title, Spec)."""
    try:
        from lemon.study.widgets import draw_spec  # lazy: matplotlib, IPython (optional)
    except ImportError:
        draw_spec = None
    out = []
    for title, spec in items:
        if draw_spec is None:
            out.append((title, spec.to_yaml()))
            continue
        fig = draw_spec(spec)
        fig.suptitle(title, fontsize=9)
        out.append((title, fig))
    return out


# ---- summary.md ------------------------------------------------------------------------------------------------------
def headline_md(cfg, root: Path, models: str) -> list[str]:
    """summary.md's first section: the trained policy paired with its warm start, global GRPO and the other methods on
    the same questions (lemon.study.compare), led by the one-sentence answer of 'lemon vs sft'."""
    c = study_comparisons(cfg, root)
    if c.empty:
        return []
    lead = c[c["B"].str.startswith("sft")]
    answer = ("Training vs its warm start: "
              + "; ".join(f"delta {r['delta']:+.3f} {r['95% CI']}, n = {r['n']}: {r['verdict']}"
                          for r in lead.to_dict("records")) + ".") if len(lead) else \
        "The SFT warm start was not evaluated (add 'sft' to ablation_variants): no training-effect comparison."
    return ["## Does training help? (paired on the same questions)", "", f"**{answer}**", "",
            f"`lemon` = the CF-GRPO policy of notebook 02 ({cfg.train.max_steps} steps, "
            f"cf_lambda={cfg.train.cf_lambda}), paired question by question with each method on the EVAL-pool "
            f"questions both answered (seed {cfg.seed}). delta = accuracy(A) - accuracy(B); 95% percentile "
            "bootstrap CI over questions, resampled within each benchmark; 'A only / B only' = questions only one of "
            "them got right; McNemar = exact two-sided test on those. "
            f"A CI that includes 0 means this n cannot tell the two apart (not that they are equal). {models}.", "",
            md_table(c), "",
            "What the policies' evaluation specs look like (distinct = spec structures over the questions; one for all "
            "= a collapsed policy; shares = agents at each capacity):", "",
            md_table(spec_composition(policy_specs(cfg, root, default_prompts()))), ""]


def write_summary(cfg, paths) -> Path:
    """summary.md: every table of the study, each captioned with split, n, models and seed."""
    root = Path(paths.root)
    man = json.loads((root / "manifest.json").read_text()) if (root / "manifest.json").exists() else {}
    workers = ", ".join(f"{c}={w.get('model')}" for c, w in man.get("workers", {}).items()) or "see manifest.json"
    models = f"workers {workers}; policy {cfg.train.policy.model} + LoRA r={cfg.train.policy.lora_r}"
    splits = ", ".join(f"{b} {B.POOL_SPLITS['eval'][b]}" for b in cfg.benchmarks)
    md = [f"# LEMON study — profile `{cfg.profile}`", "",
          f"Folder `{shown_path(root)}`; git `{man.get('git', '?')}`; seed {cfg.seed}; protocol `{cfg.protocol}` "
          f"(disjoint train/eval pools); {models}. Regenerate: `scripts/main.sh --profile {cfg.profile} --out "
          f"{shown_path(root)}`.", ""]
    md += headline_md(cfg, root, models)
    stats = json.loads((root / "data" / "stats.json").read_text()) if (root / "data" / "stats.json").exists() else []
    md += ["## Data pools (notebook 01)", "", md_table(pd.DataFrame(stats)), ""]
    sft_p, tr_p = root / "train" / "sft" / "sft.json", root / "train" / "grpo" / "train.json"
    if sft_p.exists() and tr_p.exists():
        sft, m = json.loads(sft_p.read_text()), read_metrics(root / "train" / "grpo" / "metrics.jsonl")
        last = m.iloc[-1].to_dict() if len(m) else {}
        probed = (f"valid-spec rate {sft['valid_before']['rate']:.2f} -> {sft['valid_after']['rate']:.2f} "
                  f"(greedy, n={sft['valid_after']['n']} train-pool questions)" if sft["valid_after"]["n"] else
                  "valid-spec rate not probed (sft.probe_questions = 0; the `sft` evaluation below measures it)")
        md += ["## Training (notebook 02)", "",
               f"SFT warm start: {sft['rows']} corpus rows; {probed}. CF-GRPO: {len(m)} logged steps on "
               f"{cfg.train.train_questions} train-pool questions ({', '.join(cfg.train.benchmarks)}), "
               f"G={cfg.train.num_generations}, cf_lambda={cfg.train.cf_lambda}; last step reward "
               f"{last.get('reward', float('nan')):.3f}, valid rate {last.get('spec/valid_rate', float('nan')):.2f}. "
               f"Seed {cfg.train.seed}; {models}.", ""]
    t = eval_table(root, cfg.eval_methods, cfg.benchmarks)
    if not t.empty:
        md += ["## Main results (notebook 04)", "",
               f"Accuracy [95% Wilson CI] · mean worker tokens per question, on the EVAL pools ({splits}); "
               f"n = {cfg.eval_n or 'all'} seeded questions per benchmark (seed {cfg.seed}; a column header gives "
               "split and n); "
               # the default capacity only matters for baselines named without `@capacity`
               + (f"baselines at capacity `{cfg.baseline_capacity}` ({cfg.n_agents} agents, SC-CoT k={cfg.sc_k}); "
                  if any(split_method(m) in ((b, None) for b in BASELINES) for m in cfg.eval_methods) else "") +
               f"`prompted` = the untrained orchestrator ({cfg.orchestrator_capacity} worker writes the spec), "
               f"`lemon` = the trained policy; {models}.", "",
               md_table(wide_table(t, cfg.eval_methods, cfg.benchmarks)), "",
               f"Macro average over the {len(cfg.benchmarks)} benchmarks (n = questions in all; orchestrator_tokens = "
               "tokens the orchestrator spent writing specs, not counted in `tokens`; Pareto = no other method is both "
               "cheaper and more accurate):", "", md_table(method_summary(t)), ""]
    a = ablation_table(root, cfg.ablation_variants, cfg.ablation_benchmarks)
    if not a.empty:
        md += ["## Ablation: training variants (notebook 03, paper Table 2 shape)", "",
               (f"Each variant: {cfg.ablation_steps} CF-GRPO step(s) from the same SFT warm start "
                f"(seed {cfg.train.seed}; `sft` = that warm start, no steps); "
                if set(cfg.ablation_variants) - {"sft"} else
                "`sft` = notebook 02's SFT warm start (no CF-GRPO step), ") +
               f"evaluated on n = {cfg.ablation_n} EVAL-pool questions per benchmark "
               f"({', '.join(b + ' ' + B.POOL_SPLITS['eval'][b] for b in cfg.ablation_benchmarks)}); "
               f"{models}.", "", md_table(a), ""]
    if (root / "dev" / "curves.json").exists():
        md += ["## Learning curves (notebook 03)", "",
               f"Each training run's adapter at step 0 (the SFT warm start), every {cfg.dev_every} steps and at the "
               f"end, on {cfg.dev_n} held-out TRAIN-pool questions per training benchmark (after the training "
               f"questions in the seeded order: never trained on; seed {cfg.seed}); {models}.", "",
               md_table(pd.DataFrame(json.loads((root / "dev" / "curves.json").read_text()))), ""]
    e = edit_table(read_rows(root / "ablations" / "edit_effects.jsonl"))
    if not e.empty:
        md += ["## Edit effects (notebook 03)", "",
               "Mean change when one edit is applied to a held-out spec (edited minus original; score and nominal "
               f"worker tokens), on n = {cfg.edit_n} EVAL-pool question(s) per benchmark x {cfg.edit_specs} "
               f"mutated-baseline spec(s), up to {cfg.edit_sites} site(s) per family (seed {cfg.seed}); {models}.", "",
               md_table(e), ""]
    if (root / "timings.json").exists():
        tm = json.loads((root / "timings.json").read_text())
        tm = {nb: v if isinstance(v, list) else [v] for nb, v in tm.items()}
        secs = lambda x: x["s"] if isinstance(x, dict) else x  # noqa: E731  (a dict = an execution that stopped early)
        text = lambda x: f"{x['s']:.0f} ({x['stopped']})" if isinstance(x, dict) else f"{x:.0f}"  # noqa: E731
        rows = [{"notebook": nb, "executions": " + ".join(map(text, v)), "total_s": sum(map(secs, v))}
                for nb, v in tm.items()]
        rows.append({"notebook": "all", "executions": "", "total_s": sum(r["total_s"] for r in rows)})
        md += ["## Wall time (notebook executions, seconds; a resumed notebook adds an execution; a runner killed "
               "outright records nothing)", "", md_table(pd.DataFrame(rows), "{:.0f}"), ""]
    p = root / "summary.md"
    p.write_text("\n".join(md) + "\n")
    return p
