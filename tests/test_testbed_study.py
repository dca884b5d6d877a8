"""The many-seed study's statistics and report (lemon.testbed.stats tests, lemon.testbed.study): the exact sign and
Wilcoxon tests against brute-force enumeration of sign flips, Holm against its definition, the study's tables on
hand-written run folders, and the random-tiny base of the testbed's runs (issue 30)."""
import gzip
import json
from itertools import product
from math import comb

import numpy as np
import pytest

from lemon.prompts import default_prompts
from lemon.run.executor import ExecutorCaps
from lemon.spec import spec_from_dict
from lemon.testbed import study as S
from lemon.testbed.experiment import ExperimentConfig, train_config, write_experiment, write_run_info
from lemon.testbed.stats import holm, paired_effect, sign_test, wilcoxon_signed_rank
from lemon.testbed.world import best_fixed, two_type_world
from lemon.train.rewards import RewardConfig

P = default_prompts()
WORLD = two_type_world(P)
R = RewardConfig(max_agents=4)
HARD = next(e for e in WORLD.examples() if e.benchmark == "gsm8k")
EASY = next(e for e in WORLD.examples() if e.benchmark == "multiarith")


# ---- exact tests vs slow, obvious references -------------------------------------------------------------------------
def _sign_brute(d):
    d = [x for x in d if x != 0]
    n, k = len(d), sum(x > 0 for x in d)
    obs = abs(k - n / 2)
    return sum(comb(n, j) for j in range(n + 1) if abs(j - n / 2) >= obs) / 2 ** n if n else 1.0


def _wilcoxon_brute(d):
    """Every one of the 2^n sign patterns of the (mid-)ranks of |d|, counted: the definition of the exact null."""
    d = np.asarray([x for x in d if x != 0], dtype=float)
    a = np.abs(d)
    ranks = np.array([np.sum(a < v) + (np.sum(a == v) + 1) / 2 for v in a])  # mid-ranks, written out
    w = ranks[d > 0].sum()
    mean = ranks.sum() / 2
    null = [sum(r for r, s in zip(ranks, signs) if s) for signs in product((0, 1), repeat=len(d))]
    return w, sum(abs(x - mean) >= abs(w - mean) - 1e-9 for x in null) / len(null)


@pytest.mark.parametrize("d", [[1, 2, 3, 4, 5], [-1, 2, 3, 4, -5, 6, 7, 8], [0.1, -0.1, 0.2, 0.2, -0.3, 0.0, 0.4],
                               [-0.05] * 6 + [0.01], [3.0], [0.0, 0.0],
                               list(np.random.default_rng(0).normal(0.1, 1, 11))])
def test_sign_and_wilcoxon_match_brute_force(d):
    assert sign_test(d) == pytest.approx(_sign_brute(d))
    if any(x != 0 for x in d):
        w, p = wilcoxon_signed_rank(d)
        wb, pb = _wilcoxon_brute(d)
        assert w == pytest.approx(wb) and p == pytest.approx(pb)
    else:
        assert wilcoxon_signed_rank(d)[1] == 1.0


def test_known_values_and_holm():
    assert sign_test([-1] * 9 + [1]) == pytest.approx(22 / 1024)  # 1 of 10: 2 * (1 + 10) / 2^10
    # all positive: only 2 of 32 as extreme
    assert wilcoxon_signed_rank([1, 2, 3, 4, 5]) == (15.0, pytest.approx(2 / 32))
    assert holm([0.01, 0.04, 0.03, 0.5]) == pytest.approx([0.04, 0.09, 0.09, 0.5])  # 4p, 3p, then monotone max(2p, .)
    assert holm([0.5, 0.4]) == pytest.approx([0.8, 0.8])
    e = paired_effect([-0.2, -0.1, 0.0, 0.1])
    assert (e["arm_better"], e["ref_better"], e["ties"], e["n"]) == (2, 1, 1, 4)
    assert e["diff"] == pytest.approx(-0.05) and e["dz"] == pytest.approx(-0.05 / np.std([-0.2, -0.1, 0, 0.1], ddof=1))
    assert paired_effect([0.3, 0.1], lower_is_better=False)["arm_better"] == 2


# ---- the study on hand-written folders -------------------------------------------------------------------------------
def _run(root, arm, seed, rollouts, heldout):
    d = root / arm / f"seed-{seed}"
    d.mkdir(parents=True)
    write_run_info(d, arm, seed, R, 4, ExecutorCaps(max_agents=4))
    rows = lambda items: "".join(json.dumps({"step": s, "example_id": ex.id, "text": t}) + "\n"  # noqa: E731
                                 for s, ex, t in items)
    files = {"rollouts.jsonl": rows(rollouts), "heldout.jsonl": rows(heldout),
             "train.json": json.dumps({"steps": 4, "history": [{"step_time": 2.5}] * 4})}
    for name, text in files.items():  # seed 3 as outputs/reference/ keeps records: gzipped, read the same
        if seed == 3:
            (d / f"{name}.gz").write_bytes(gzip.compress(text.encode()))
        else:
            (d / name).write_text(text)


def test_study_tables_tests_and_plot(tmp_path):
    """World 'two' (an easy and a hard type whose optima differ): cf writes each type's optimum from step 3 on, global
    keeps one weak spec; 4 seeds, so cf is better in 4/4 (sign p = 2/16, Wilcoxon p = 2/16), Holm over 2 metrics."""
    opt = {e.id: WORLD.optimum(e, R, 4).spec.text for e in (HARD, EASY)}
    weak = spec_from_dict({"agents": [{"id": "a1", "base_role": "solver", "role": "Solver", "duty": "Do it carefully.",
                                       "capacity": "small", "depends_on": []}], "final": "a1"}).to_yaml()
    exp = ExperimentConfig(world="two", arms=("cf", "global"), seeds=(0, 1, 2, 3), max_steps=4, threshold=0.01,
                           smooth=1, final_window=2)
    root = tmp_path / "runs" / "two"
    for seed in exp.seeds:
        _run(root, "cf", seed, [(s, ex, opt[ex.id] if s >= 3 else weak) for s in range(1, 5) for ex in (HARD, EASY)],
             [(0, HARD, weak), (4, HARD, opt[HARD.id]), (4, EASY, opt[EASY.id])])
        _run(root, "global", seed, [(s, ex, weak) for s in range(1, 5) for ex in (HARD, EASY)],
             [(0, HARD, weak), (4, HARD, weak), (4, EASY, "not a spec")])
    _run(root, "cf", 9, [(1, HARD, weak)], [(0, HARD, weak)])  # a run still in progress (no train.json): left out
    (root / "cf" / "seed-9" / "train.json").unlink()
    write_experiment(root, exp, WORLD, R, 4, ExecutorCaps(max_agents=4), "pytest")
    md = S.study(tmp_path / "runs", tmp_path / "out", P).read_text()
    rec = json.loads((tmp_path / "out" / "study.json").read_text())
    w = rec["worlds"]["two"]
    arms = {a["arm"]: a for a in w["arms"]}
    assert arms["cf"]["final_regret"] == pytest.approx(0.0, abs=1e-12) and arms["cf"]["reached"] == "4/4"
    assert arms["cf"]["seeds"] == 4 and 9 not in {r["seed"] for r in w["runs"]}
    assert arms["global"]["heldout_invalid"] == 0.5 and arms["cf"]["heldout_invalid"] == 0.0
    r_weak_easy = WORLD.regret(weak, EASY, R, 4)
    assert arms["global"]["heldout_regret_valid"] == pytest.approx(WORLD.regret(weak, HARD, R, 4))
    assert arms["global"]["final_regret"] == pytest.approx((WORLD.regret(weak, HARD, R, 4) + r_weak_easy) / 2)
    ref = w["reference"]
    spec, per, regret = best_fixed(WORLD, R, 4, ExecutorCaps(max_agents=4))
    assert ref["best_fixed_regret"] == pytest.approx(regret) and regret > 0 and ref["types"] == ["easy", "hard"]
    assert w["train_s_per_run"] == pytest.approx(10.0)
    comp = {c["metric"]: c for c in rec["comparisons"]}
    assert set(comp) == {"final_regret", "heldout_regret", "mean_reward", "steps_to_threshold"}
    c = comp["final_regret"]
    assert (c["arm_better"], c["n"]) == (4, 4) and c["p_sign"] == pytest.approx(2 / 16)
    # every metric favours cf in 4/4 seeds (p 2/16 each): Holm over the 4 rows gives 4 x 2/16
    assert c["p_wilcoxon"] == pytest.approx(2 / 16) and c["p_sign_holm"] == pytest.approx(4 * 2 / 16)
    assert comp["mean_reward"]["arm_better"] == 4 and comp["mean_reward"]["diff"] > 0  # higher reward is better
    # cf reaches the threshold at step 3, global never: censored at max_steps + 1 = 5
    assert comp["steps_to_threshold"]["diff"] == pytest.approx(3 - 5) and comp["steps_to_threshold"]["arm_better"] == 4
    # 4 seeds cannot separate (Holm p 0.5), and a regret gap this large is not equivalent to 0 either
    assert c["verdict"] == "inconclusive" and c["p_tost_holm"] > 0.5 and c["ci90"][1] < -0.05
    assert "| verdict |" in md and "inconclusive" in md
    assert "## Paired by seed" in md and "| two | cf | global | final_regret |" in md
    assert (tmp_path / "out" / "plots" / "curves.png").stat().st_size > 10_000
    assert S.main([str(tmp_path / "empty")]) == 2  # a folder without experiments: a named error, exit 2


# ---- the random-tiny base --------------------------------------------------------------------------------------------
def test_random_tiny_base_config(monkeypatch):
    with pytest.raises(ValueError, match="base="):
        ExperimentConfig(base="nope")
    with pytest.raises(ValueError, match="init_adapter"):
        ExperimentConfig(base="random-tiny", init_adapter="some/adapter")
    import lemon.policy.model as policy
    monkeypatch.setattr(policy, "cached_random_policy", lambda seed: f"/cache/tiny-seed{seed}")
    exp = ExperimentConfig(world="two", base="random-tiny", profile="smoke")
    a, b = (train_config("cf", s, exp, WORLD) for s in (0, 1))
    assert (a.policy.model, b.policy.model) == ("/cache/tiny-seed0", "/cache/tiny-seed1")  # one policy per seed
    assert train_config("global", 1, exp, WORLD).policy == b.policy  # shared by the arms of a seed: paired
    assert a.policy.lora_r == 8 and a.policy.dtype == "fp32"
    assert train_config("cf", 0, ExperimentConfig(world="two", profile="smoke"), WORLD).policy.model != a.policy.model


def test_cached_random_policy_is_built_once_and_reused():
    from lemon.policy.model import cached_random_policy
    p = cached_random_policy(0)
    stamp = (p / "config.json").stat().st_mtime_ns
    assert cached_random_policy(0) == p and (p / "config.json").stat().st_mtime_ns == stamp  # reused, not rebuilt
    assert json.loads((p / "config.json").read_text())["num_hidden_layers"] == 2


def test_tost_and_t_distribution():
    """The t CDF against tabulated quantiles; TOST declares small paired differences equivalent at +/-0.05 and a real
    difference not; a verdict reads the Holm-adjusted p-values."""
    from lemon.testbed.stats import t_cdf, tost
    assert t_cdf(2.262157, 9) == pytest.approx(0.975, abs=1e-6) and t_cdf(-1.833113, 9) == pytest.approx(0.05, abs=1e-6)
    assert t_cdf(12.706205, 1) == pytest.approx(0.975, abs=1e-6) and t_cdf(0.0, 4) == 0.5
    near = tost([0.01, -0.02, 0.0, 0.015, -0.01, 0.005, 0.0, -0.005, 0.01, 0.0], 0.05)
    far = tost([0.2, 0.1, 0.15, 0.3, 0.0, 0.1, 0.2, 0.25, 0.1, 0.05], 0.05)
    assert near["p_tost"] < 1e-6 and -0.05 < near["ci90"][0] < near["ci90"][1] < 0.05
    assert far["p_tost"] > 0.9 and far["ci90"][0] > 0.05
    wide = tost([0.3, -0.3, 0.2, -0.25], 0.05)  # no difference on average, but far too noisy to call equivalent
    assert wide["p_tost"] > 0.3
    row = {"p_wilcoxon_holm": 0.5, "p_tost_holm": 0.01, "tost_margin": 0.05, "arm_better": 3, "ref_better": 7}
    assert S.verdict(row) == "equivalent (+/-0.05)"
    assert S.verdict({**row, "p_wilcoxon_holm": 0.01}) == "separated: reference better"
    assert S.verdict({**row, "p_tost_holm": 0.2}) == "inconclusive"


def test_global_at_equal_executions_doubles_the_group():
    exp = ExperimentConfig(world="two", profile="smoke", train_overrides={"num_generations": 4, "batch_size": 8})
    cf, g2 = train_config("cf", 0, exp, WORLD), train_config("global-2x", 0, exp, WORLD)
    assert (cf.num_generations, cf.batch_size, cf.cf_lambda) == (4, 8, 1.0)
    # the same questions per step, twice the rollouts: G rollouts + G edits of cf = 2G executions
    assert (g2.num_generations, g2.batch_size, g2.cf_lambda) == (8, 16, 0.0)
    assert g2.batch_size // g2.num_generations == cf.batch_size // cf.num_generations


def _write_seeds(root, seeds):
    for s in seeds:
        exp = ExperimentConfig(world="two", profile="smoke", arms=("cf",), seeds=(s,), max_steps=2)
        write_experiment(root, exp, WORLD, R, 4, ExecutorCaps(max_agents=4), f"seed {s}")


def test_two_processes_merging_one_experiment_folder_lose_no_seed(tmp_path):
    """experiments/mechanisms.sh can run two chains in one world folder: experiment.json's read-merge-write is locked
    and atomic, so every seed and command either process recorded survives (an unlocked merge loses updates)."""
    import multiprocessing as mp
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_write_seeds, args=(tmp_path, range(k, 40, 2))) for k in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    rec = json.loads((tmp_path / "experiment.json").read_text())
    assert rec["config"]["seeds"] == list(range(40)) and len(rec["commands"]) == 40
    assert not list(tmp_path.glob("*.tmp"))
