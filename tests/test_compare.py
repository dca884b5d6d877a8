"""lemon.study.compare: paired comparisons against slow, obvious references, and the study's headline on a hand-written
study folder."""
import json
import random
from types import SimpleNamespace

import numpy as np
import pytest

from lemon.study.compare import comparisons, mcnemar_p, paired, study_comparisons, verdict
from lemon.study.plots import headline_md


def rows(correct: dict[str, bool]) -> list[dict]:
    return [{"id": i, "correct": c} for i, c in correct.items()]


def brute_mcnemar(w: int, l: int) -> float:
    """Enumerate every outcome of w + l fair coins; P(min(heads, tails) <= min(w, l))."""
    m, k, hits = w + l, min(w, l), 0
    for mask in range(2 ** m):
        h = bin(mask).count("1")
        hits += min(h, m - h) <= k
    return hits / 2 ** m if m else 1.0


@pytest.mark.parametrize("w,l", [(0, 0), (3, 0), (0, 5), (4, 4), (7, 2), (1, 9), (6, 5)])
def test_mcnemar_matches_enumeration(w, l):
    assert mcnemar_p(w, l) == pytest.approx(brute_mcnemar(w, l))


def test_paired_counts_and_delta_by_hand():
    rng = random.Random(0)
    a = {b: {f"{b}-{i}": rng.random() < 0.6 for i in range(30)} for b in ("gsm8k", "svamp")}
    b = {k: {i: rng.random() < 0.4 for i in v} for k, v in a.items()}
    b["svamp"].pop("svamp-0")  # B never answered one question: it is left out of the pairing
    a["multiarith"] = {"m-1": True}  # a benchmark only A has: left out too
    res = paired({k: rows(v) for k, v in a.items()}, {k: rows(v) for k, v in b.items()})
    common = [(a[k][i], b[k][i]) for k in b for i in b[k]]
    assert res["n"] == len(common) == 59
    assert res["delta"] == pytest.approx(sum(x - y for x, y in common) / 59)
    assert res["acc_a"] == pytest.approx(sum(x for x, _ in common) / 59)
    assert res["wins"] == sum(x and not y for x, y in common) and res["losses"] == sum(y and not x for x, y in common)
    assert res["benchmarks"] == ["gsm8k", "svamp"]
    lo, hi = res["ci"]
    assert lo <= res["delta"] <= hi


def test_bootstrap_ci_against_a_per_resample_loop():
    """The vectorised stratified bootstrap against a loop that resamples each benchmark's questions one resample at a
    time with the same generator calls: identical resamples, identical quantiles."""
    rng = random.Random(1)
    a = {b: rows({f"{b}{i}": rng.random() < 0.5 for i in range(n)}) for b, n in (("x", 12), ("y", 7))}
    b = {k: rows({r["id"]: rng.random() < 0.5 for r in v}) for k, v in a.items()}
    res = paired(a, b, n_boot=500, seed=3)
    diffs = {k: np.array([float(ra["correct"]) - float(rb["correct"]) for ra, rb in
                          zip(sorted(a[k], key=lambda r: r["id"]), sorted(b[k], key=lambda r: r["id"]))]) for k in a}
    g = np.random.default_rng(3)
    draws = {k: g.choice(diffs[k], size=(500, len(diffs[k])), replace=True) for k in sorted(diffs)}
    boot = [sum(draws[k][j].sum() for k in draws) / 19 for j in range(500)]
    assert res["ci"] == pytest.approx(tuple(np.quantile(boot, [0.025, 0.975])))


def test_identical_methods_are_not_separated_and_a_clear_win_is():
    same = {"gsm8k": rows({str(i): i % 2 == 0 for i in range(40)})}
    r = paired(same, same)
    assert r["delta"] == 0 and r["ci"] == (0.0, 0.0) and r["p_mcnemar"] == 1.0
    assert verdict(r, "A", "B").startswith("not separated at n=40")
    good = {"gsm8k": rows({str(i): True for i in range(40)})}
    bad = {"gsm8k": rows({str(i): i < 5 for i in range(40)})}
    r = paired(good, bad)
    assert r["ci"][0] > 0 and verdict(r, "A", "B") == "A better" and r["p_mcnemar"] < 1e-6
    assert verdict(paired(bad, good), "A", "B") == "B better"


def test_no_common_question_gives_none_and_no_table_row():
    assert paired({"gsm8k": rows({"1": True})}, {"gsm8k": rows({"2": True})}) is None
    assert paired({}, {}) is None
    assert comparisons([("a", "b", {"gsm8k": rows({"1": True})}, {})]).empty


def _write(path, correct):
    path.mkdir(parents=True, exist_ok=True)
    (path / "results.jsonl").write_text("".join(json.dumps({"id": i, "correct": c}) + "\n" for i, c in correct.items()))


def test_study_headline_on_a_hand_written_folder(tmp_path):
    cfg = SimpleNamespace(benchmarks=("gsm8k", "svamp"), ablation_benchmarks=("gsm8k", "svamp"),
                          ablation_variants=("sft", "global", "full"), ablation_steps=4, eval_methods=("cot", "lemon"),
                          baseline_capacity="large", seed=0, train=SimpleNamespace(max_steps=4, cf_lambda=1.0),
                          is_main_run=lambda v: v == "full")  # StudyConfig.is_main_run at ablation_steps == max_steps
    for b in cfg.benchmarks:
        _write(tmp_path / "eval" / "lemon" / b, {f"{b}{i}": i < 15 for i in range(20)})
        _write(tmp_path / "eval" / "cot" / b, {f"{b}{i}": i < 14 for i in range(20)})
        _write(tmp_path / "ablations" / "variants" / "sft" / "eval" / b, {f"{b}{i}": i < 3 for i in range(10)})
        _write(tmp_path / "ablations" / "variants" / "full" / "eval" / b, {f"{b}{i}": True for i in range(10)})
    c = study_comparisons(cfg, tmp_path)
    # 'full' at the main step count is the main adapter: not a comparison; 'global' has no rows yet: left out
    assert list(c["B"]) == ["sft (warm start, no RL)", "cot@large"]
    sft = c.iloc[0]
    assert sft["n"] == 20 and sft["delta"] == pytest.approx(0.7) and sft["verdict"] == "lemon better"
    assert c.iloc[1]["verdict"].startswith("not separated at n=40")
    md = "\n".join(headline_md(cfg, tmp_path, "workers w; policy p"))
    assert md.startswith("## Does training help?")
    assert "**Training vs its warm start: delta +0.700" in md and "n = 20: lemon better.**" in md
    cfg_no_sft = SimpleNamespace(**{**vars(cfg), "ablation_variants": ("global",)})
    md = "\n".join(headline_md(cfg_no_sft, tmp_path, ""))
    assert "The SFT warm start was not evaluated" in md and "cot@large" in md
    assert headline_md(SimpleNamespace(**{**vars(cfg), "eval_methods": ("lemon",), "ablation_variants": ()}),
                       tmp_path / "empty", "") == []


def test_spec_composition_counts_structures_not_duties():
    from dataclasses import replace

    from lemon.eval.baselines import baseline_spec
    from lemon.study.compare import spec_composition
    chain = baseline_spec("chain", "math", n_agents=3)
    reworded = replace(chain, agents=tuple(replace(a, duty=a.duty + " Carefully.") for a in chain.agents))
    big = replace(chain, agents=tuple(replace(a, capacity="large") for a in chain.agents))
    q = lambda ss: {("gsm8k", str(i)): s for i, s in enumerate(ss)}  # noqa: E731
    t = spec_composition({"collapsed": q([chain, reworded, chain]), "mixed": q([chain, big, None, None]),
                          "none": q([None])}, reference="collapsed")
    t = t.set_index("method")
    # vs the reference on shared questions: structure changed on q1 (big) and q2 / q3 (None vs a spec / not shared)
    assert t.loc["mixed", "differs from collapsed"] == "2/3" and t.loc["none", "differs from collapsed"] == "1/1"
    assert t.loc["collapsed", "differs from collapsed"] == "(reference)"
    assert t.loc["collapsed", "distinct"] == 1 and t.loc["collapsed", "valid"] == 1.0  # duties do not count
    assert t.loc["mixed", "distinct"] == 2 and t.loc["mixed", "valid"] == 0.5 and t.loc["mixed", "n"] == 4
    caps = [a.capacity for a in chain.agents + big.agents]
    assert t.loc["mixed", "large share"] == pytest.approx(caps.count("large") / len(caps))
    assert t.loc["mixed", "agents"] == 3 and t.loc["mixed", "edges"] == sum(len(a.depends_on) for a in chain.agents)
    assert t.loc["mixed", "final large"] == pytest.approx(np.mean([chain.agent(chain.final).capacity == "large", True]))
    assert t.loc["none", "distinct"] == 0 and np.isnan(t.loc["none", "agents"])


def test_policy_specs_parses_what_the_policies_wrote(tmp_path):
    from lemon.eval.baselines import baseline_spec
    from lemon.prompts import default_prompts
    from lemon.study.compare import policy_specs
    text = baseline_spec("chain", "math", n_agents=3).to_yaml()
    cfg = SimpleNamespace(benchmarks=("gsm8k",), ablation_benchmarks=("gsm8k",), ablation_variants=("sft", "global"))
    d = tmp_path / "eval" / "lemon" / "gsm8k"
    d.mkdir(parents=True)
    (d / "results.jsonl").write_text(json.dumps({"id": "1", "correct": True, "spec": text}) + "\n" +
                                     json.dumps({"id": "2", "correct": False, "spec": "agents: [oops"}) + "\n")
    specs = policy_specs(cfg, tmp_path, default_prompts())
    assert list(specs) == ["lemon"] and specs["lemon"][("gsm8k", "1")].final  # variants: no rows yet
    assert specs["lemon"][("gsm8k", "2")] is None
