"""Print a markdown table (method x capacity: accuracy with 95% CI, mean worker tokens per question, n) from eval run
folders named <capacity>-<method> under a directory. Usage: python bench/table.py outputs/bench/baselines"""
import json
import sys
from pathlib import Path

from lemon.evaluate import read_rows, summarize


def main(root: str) -> None:
    cells = {}
    for d in sorted(Path(root).iterdir()):
        rows = read_rows(d / "results.jsonl")
        if rows and "-" in d.name:
            cap, method = d.name.split("-", 1)
            cells[(method, cap)] = (summarize(rows), json.loads((d / "manifest.json").read_text()))
    caps = [c for c in ("small", "medium", "large") if any(k[1] == c for k in cells)]
    methods = list(dict.fromkeys(k[0] for k in cells))
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
    # cells may come from different commits (the table is filled over sessions, resumably); what makes them comparable is
    # the same prompts, worker weights and question sample, so say so when they agree and stop when they do not
    manifests = {f"{c}-{m}": man for (m, c), (_, man) in cells.items()}
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
    print("commits: " + "; ".join(f"{sha} ({', '.join(names)})" for sha, names in commits.items()))

if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "outputs/bench/baselines")
