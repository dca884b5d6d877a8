"""Print a markdown table (method x capacity: accuracy with 95% CI, mean worker tokens per question, n) from eval run
folders named <capacity>-<method> under a directory, and optionally plot accuracy (95% CI) against mean worker tokens
(colour = method, marker = capacity).
Usage: python bench/table.py outputs/bench/baselines [--plot accuracy_vs_tokens.png]"""
import argparse
import json
import sys
from pathlib import Path

from lemon.eval.baselines import BASELINES
from lemon.eval.runner import read_rows, summarize


def plot(cells: dict, path: str) -> None:
    from lemon.study.plots import _plt, save
    plt, _ = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 5))
    methods = list(dict.fromkeys(m for m, _ in cells))
    markers = {"small": "v", "medium": "o", "large": "^"}
    for (m, c), (s, _, _) in cells.items():
        lo, hi = s["ci95"]
        colour = f"C{methods.index(m)}"
        ax.errorbar(s["mean_worker_tokens"], s["accuracy"], yerr=[[s["accuracy"] - lo], [hi - s["accuracy"]]],
                    fmt=markers[c], color=colour, ms=8, capsize=3, alpha=0.85)
        ax.annotate(f"{m}/{c[0]} n={s['n']}", (s["mean_worker_tokens"], s["accuracy"]), fontsize=7,
                    xytext=(5, 3), textcoords="offset points")
    for c, mk in markers.items():  # legend entries: one per capacity, one per method
        ax.plot([], [], mk, color="gray", label=f"capacity {c}")
    for i, m in enumerate(methods):
        ax.plot([], [], "s", color=f"C{i}", label=m)
    xmax = max(s["mean_worker_tokens"] for s, _, _ in cells.values())
    ax.set_xlim(0, xmax * 1.25)  # room for the labels of the right-most points before the legend
    ax.set(xlabel="mean worker tokens per question", ylabel="accuracy (95% Wilson CI)",
           title="GSM8K test, seeded sample: baselines x capacity")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    print(f"plot: {save(fig, path)}")


def main(root: str, plot_path: str | None = None) -> None:
    cells = {}
    for d in sorted(Path(root).iterdir()):
        rows = read_rows(d / "results.jsonl")
        if rows and "-" in d.name:
            cap, method = d.name.split("-", 1)
            cells[(method, cap)] = (summarize(rows), json.loads((d / "manifest.json").read_text()), rows)
    caps = [c for c in ("small", "medium", "large") if any(k[1] == c for k in cells)]
    # the baselines in the order (lemon.eval.baselines.BASELINES), then anything else (e.g. a spec file) by name
    rank = lambda m: (BASELINES.index(m) if m in BASELINES else len(BASELINES), m)  # noqa: E731
    methods = sorted(dict.fromkeys(k[0] for k in cells), key=rank)
    cells = {k: cells[k] for m in methods for k in cells if k[0] == m}
    print("| method | " + " | ".join(caps) + " |")
    print("|---|" + "---|" * len(caps))
    for m in methods:
        out = []
        for c in caps:
            if (m, c) not in cells:
                out.append("-")
                continue
            s = cells[(m, c)][0]
            lo, hi = s["ci95"]
            out.append(f"{s['accuracy']:.2f} [{lo:.2f}-{hi:.2f}], {s['mean_worker_tokens']:.0f} tok, n={s['n']}")
        print(f"| {m} | " + " | ".join(out) + " |")
    # cells may come from different commits (the table is filled over sessions, resumably); what makes them comparable
    # is the same prompts, worker weights and question sample, so say so when they agree and stop when they do not
    manifests = {f"{c}-{m}": man for (m, c), (_, man, _) in cells.items()}
    for what, get in (("prompts", lambda man: man["prompts_sha256"]),
                      ("worker weights", lambda man: {c: w.get("sha256") for c, w in man["workers"].items()}),
                      ("question sample", lambda man: man["config"]["example_ids_sha256"])):
        if len({json.dumps(get(man), sort_keys=True) for man in manifests.values()}) > 1:
            sys.exit(f"cells are not comparable: their {what} differ ({', '.join(sorted(manifests))})")
    first = next(iter(manifests.values()))
    models = {c: w.get("model") for c, w in first["workers"].items()}
    commits = {}
    for name, man in sorted(manifests.items()):
        commits.setdefault(man["git"][:7] + ("+dirty" if man["git"].endswith("+dirty") else ""), []).append(name)
    print(f"\nsplit: gsm8k/test (seeded sample, seed {first['config']['eval']['seed']}, same {len(manifests)} cells: "
          f"prompts {first['prompts_sha256'][:12]}, question ids {first['config']['example_ids_sha256'][:12]}); "
          f"workers: {models}")
    print("commits (of each cell's first execution; a resumed cell may have finished on a later one): "
          + "; ".join(f"{sha} ({', '.join(names)})" for sha, names in commits.items()))
    paired(cells, methods, caps)
    if plot_path:
        plot(cells, plot_path)


def paired(cells: dict, methods: list[str], caps: list[str], ref: str = "cot") -> None:
    """Each method against CoT at the same capacity on the questions both answered: with CIs this wide, the discordant
    pairs (right where CoT was wrong, and the reverse) say more than the accuracy gap."""
    lines = []
    for c in caps:
        if (ref, c) not in cells:
            continue
        base = {r["id"]: r["correct"] for r in cells[(ref, c)][2]}
        for m in methods:
            if m == ref or (m, c) not in cells:
                continue
            pairs = [(r["correct"], base[r["id"]]) for r in cells[(m, c)][2] if r["id"] in base]
            won, lost = sum(a and not b for a, b in pairs), sum(b and not a for a, b in pairs)
            lines.append(f"{m}/{c}: +{won} -{lost} of {len(pairs)}")
    if lines:
        print(f"paired vs {ref} (same questions; +: right where {ref} was wrong, -: the reverse): " + "; ".join(lines))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", nargs="?", default="outputs/bench/baselines",
                    help="folder of <capacity>-<method> eval runs")
    ap.add_argument("--plot", metavar="PNG", help="also write the accuracy-vs-tokens plot here")
    a = ap.parse_args()
    main(a.root, a.plot)
