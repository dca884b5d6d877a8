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
    any_manifest = next(iter(cells.values()))[1]
    models = {c: w.get("model") for c, w in any_manifest["workers"].items()}
    print(f"\nsplit: gsm8k/test (seeded sample, seed {any_manifest['config']['eval']['seed']}); workers: {models}; "
          f"git {any_manifest['git']}; prompts {any_manifest['prompts_sha256'][:12]}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "outputs/bench/baselines")
