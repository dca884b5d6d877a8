"""What the counterfactual term climbs, computed exactly on a testbed world (no training, no sampling).

For a spec y the CF term of CF-GRPO adds lambda * delta(y) to the tokens of the edited value, delta = r(y) - r(edit(y)).
The paper's edits only take away (drop an edge, roll a duty back to its default, lower a capacity), so the "baseline" of
the CF contrast, r(edit(y)), depends on the action the policy took: its expectation is not 0 and the term is not an
unbiased piece of the policy gradient of E[r]. At a field with value v it raises pi(v) in proportion to
Q(v) - Q(lower(v)), which favours values whose edit HURTS most, not values that score best. Its pull on a whole spec is
measured here by the mean contrast E_edit[delta(y)] (family uniform among those with an eligible site, then a site
uniform: lemon.train.edits.sample_edit at the sampler's uniform start) and the proxy
J_lambda(y) = r(y) + lambda * E_edit[delta(y)].

Over every structure of the world's optimum search (lemon.testbed.search.structures, with each duty customised or
default) the script prints the best specs by r and by J_lambda, and where a run folder is given, scores the greedy
held-out specs of its runs the same way.

  .venv/bin/python experiments/cf_objective.py --world tiny [--lam 1]
      [--runs outputs/reference/testbed-pilot-20261207/tiny]
"""
from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

from lemon.prompts import default_prompts
from lemon.spec import SpecError, parse_spec
from lemon.testbed.experiment import WORLD_BUILDERS, ExperimentConfig, run_caps, train_config
from lemon.testbed.search import spec_of, structures
from lemon.testbed.sim import Node
from lemon.train.edits import FAMILIES, EditError, apply_edit, eligible_sites

# the study's settings (experiments/mechanisms.sh): the reward and caps of its runs
OVERRIDES = {"num_generations": 4, "batch_size": 8, "learning_rate": 2e-2, "resample": 0, "role_chars": 12,
             "duty_chars": 16, "curriculum": False, "stratify": True}


def contrasts(spec, world, example, reward, caps, prompts) -> dict[str, list[float]]:
    """Every eligible edit's delta = r(y) - r(edit(y)), per family (exact expected rewards)."""
    r = world.expected_reward(spec, example, reward, caps)
    out = {}
    for fam in FAMILIES:
        ds = []
        for site in eligible_sites(spec, fam, prompts):
            try:
                e = apply_edit(spec, fam, site, prompts)
            except EditError:
                continue
            ds.append(r - world.expected_reward(e.spec, example, reward, caps))
        out[fam] = ds
    return out


def mean_contrast(per_family: dict[str, list[float]]) -> float:
    """E[delta] under sample_edit's uniform start: a family uniformly among those with a site, then a site uniformly;
    0 when no family has a site (that rollout gets no CF term)."""
    fams = [f for f, ds in per_family.items() if ds]
    return sum(sum(per_family[f]) / len(per_family[f]) for f in fams) / len(fams) if fams else 0.0


def row(spec, world, example, reward, caps, prompts, lam: float, label: str) -> dict:
    per = contrasts(spec, world, example, reward, caps, prompts)
    r, d = world.expected_reward(spec, example, reward, caps), mean_contrast(per)
    fam = {f"E[delta|{f}]": (sum(v) / len(v) if v else float("nan")) for f, v in per.items()}
    shape = " -> ".join(f"{a.base_role[:4]}:{a.capacity}{'*' if a.duty != prompts.default_duty(a.base_role) else ''}"
                        f"{'(' + ','.join(a.depends_on) + ')' if a.depends_on else ''}" for a in spec.agents)
    return {"spec": label or shape, "r": r, "E[delta]": d, f"J_{lam:g}": r + lam * d, **fam}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", default="tiny", choices=sorted(WORLD_BUILDERS))
    ap.add_argument("--lam", type=float, default=1.0, help="cf_lambda (TrainConfig default 1.0)")
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--runs", type=Path, help="a world folder of a study (<arm>/seed-<s>/heldout.jsonl.gz): score its "
                                              "last greedy held-out specs too")
    a = ap.parse_args()
    import pandas as pd
    prompts = default_prompts()
    world = WORLD_BUILDERS[a.world](prompts)
    exp = ExperimentConfig(world=a.world, profile="smoke", base="random-tiny-bpe", train_overrides=OVERRIDES)
    cfg = train_config("cf", 0, exp, world)
    caps, reward = run_caps(cfg), cfg.reward
    examples = {world.type_of(e): e for e in world.examples()}
    pd.set_option("display.width", 200)
    for ttype, ex in examples.items():
        rows = []
        for nodes in structures(world.config.types[ttype], world.config, min(cfg.max_agents, caps.max_agents)):
            for custom in (True, False):  # the search keeps duties customised (P3); the CF term also sees defaults
                ns = [Node(n.kind, n.cap, int(custom) if n.kind in ("solve", "check") else n.custom, n.deps)
                      for n in nodes]
                spec = parse_spec(spec_of(ns, prompts, world.config).to_yaml(), base_roles=prompts.roles_for("math"))
                rows.append(row(spec, world, ex, reward, caps, prompts, a.lam, ""))
        df = pd.DataFrame(rows).drop_duplicates("spec")
        jcol = f"J_{a.lam:g}"
        print(f"\n## world {a.world}, type {ttype}: {len(df)} structures, lambda {a.lam:g}\n")
        print("best by r (the optimum):")
        print(df.sort_values("r", ascending=False).head(a.top).to_string(index=False, float_format="%.3f"))
        print(f"\nbest by {jcol} = r + lambda * E[delta]:")
        print(df.sort_values(jcol, ascending=False).head(a.top).to_string(index=False, float_format="%.3f"))
        print(f"\ncorrelation of r and E[delta] over structures: {df['r'].corr(df['E[delta]']):+.3f}")
        if a.runs:
            got = []
            for f in sorted(a.runs.glob("*/seed-*/heldout.jsonl.gz")):
                lines = [json.loads(x) for x in gzip.open(f, "rt")]
                last = max(x["step"] for x in lines)
                for x in lines:
                    if x["step"] == last and world.type_of(world.example(x["example_id"])) == ttype:
                        try:
                            spec = parse_spec(x["text"], base_roles=prompts.roles_for("math"))
                        except SpecError:
                            continue
                        got.append({"run": f"{f.parent.parent.name}/{f.parent.name}@{last}",
                                    **row(spec, world, ex, reward, caps, prompts, a.lam, "")})
                        break
            print("\ngreedy held-out specs of the runs (first question of this type):")
            print(pd.DataFrame(got).to_string(index=False, float_format="%.3f"))


if __name__ == "__main__":
    main()
