"""The study's configuration: one frozen StudyConfig per run and the named profiles (smoke, test, cpu, cpu-long,
cpu-wide, paper) that build it. lemon.study.runner re-exports everything here (notebooks call `study.study_preset`, `study.setup`)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from lemon import benchmarks as B
from lemon.eval.baselines import BASELINES
from lemon.eval.orchestrator import OrchestratorConfig
from lemon.eval.runner import EvalConfig
from lemon.prompts import CAPACITIES
from lemon.run.models import SHIPPED
from lemon.train.config import TrainConfig, sft_preset, train_preset
from lemon.train.edits import FAMILIES
from lemon.train.sft import SFTConfig

# study profile -> the trainer preset (lemon.train.config) it trains with. 'test' is the smoke trainer cut to what the
# end-to-end notebook test needs (1 step, 1 question per benchmark; study_preset says what it leaves out). 'cpu' asks one
# question with enough questions to answer it (does training help on the math pools?); 'cpu-wide' is the same trainer
# spread over six benchmarks and every method at 2 questions each (breadth, not a ranking); 'cpu-long' is cpu's question
# at a size that can separate CF from global GRPO (issue 13's real-worker comparison; ~13 h on 2 cores)
STUDY_PROFILES = {"smoke": "smoke", "test": "smoke", "cpu": "cpu", "cpu-long": "cpu", "cpu-wide": "cpu", "paper": "paper"}
MATH = ("multiarith", "svamp", "gsm8k")
NOTEBOOKS = ("01_prepare_data", "02_train_grpo_lora", "03_ablations", "04_evaluate")
FIXED = "best-fixed"  # eval method: the one fixed method (baseline spec) that scores best on a TRAIN-pool dev sample
ORCHESTRATORS = ("prompted", "lemon")  # eval methods besides the baselines: the untrained prompted worker, the trained policy
VARIANTS = {"sft": None, "global": {"cf_lambda": 0.0}, "full": {},  # sft = warm start only (no RL); full = CF over all families
            **{f: {"cf_families": (f,)} for f in FAMILIES}}  # one edit family alone


def split_method(method: str) -> tuple[str, str | None]:
    """'cot@large' -> ('cot', 'large'): an eval method may pin its baseline's capacity; 'cot' -> ('cot', None), which runs
    at StudyConfig.baseline_capacity."""
    name, _, cap = method.partition("@")
    return name, cap or None


@dataclass(frozen=True)
class StudyConfig:
    """Everything the four notebooks do for one profile (training itself: `train` / `sft`, from lemon.train.config)."""

    profile: str
    """smoke | test | cpu | cpu-long | cpu-wide | paper (STUDY_PROFILES)."""
    train: TrainConfig
    """CF-GRPO config of the main run (lemon.train.config.train_preset(profile))."""
    sft: SFTConfig
    """Warm-start config (lemon.train.config.sft_preset(profile))."""
    seed: int = 0
    """Seeds the eval/edit/ablation samples, every worker call and (through train/sft) training."""
    protocol: str = "paper"
    """Train/eval pool protocol (lemon.benchmarks.PROTOCOLS)."""
    benchmarks: tuple[str, ...] = B.BENCHMARKS
    """Benchmarks evaluated in notebook 04 (their EVAL pools)."""
    eval_n: int | None = 2
    """Eval questions per benchmark (a seeded sample of the eval pool; None = the whole pool)."""
    eval_methods: tuple[str, ...] = BASELINES + ORCHESTRATORS
    """Methods of notebook 04: baselines ('cot', or 'cot@large' at a pinned capacity), 'prompted' (untrained
    orchestrator), 'lemon' (trained policy), 'best-fixed' (the best of fixed_candidates on a train-pool dev sample)."""
    fixed_candidates: tuple[str, ...] = ("cot@small", "cot@medium", "cot@large", "chain@large", "complete@medium")
    """What 'best-fixed' chooses from (baselines, capacity optionally pinned): each runs on the dev sample, the most
    accurate (ties: fewer worker tokens) is evaluated on the eval sample."""
    fixed_dev_n: int = 10
    """TRAIN-pool questions per benchmark on which 'best-fixed' chooses (a seeded sample; never eval-pool questions)."""
    baseline_capacity: str = "medium"
    """Capacity of every baseline agent."""
    n_agents: int = 3
    """Agents (final included) of chain / tree / complete / random."""
    sc_k: int = 3
    """SC-CoT samples."""
    orchestrator_capacity: str = "large"
    """Which worker writes the prompted orchestrator's spec."""
    orchestrator_max_tokens: int = 320
    """Spec length cap of the prompted orchestrator (the trained one keeps train.max_completion_length)."""
    edit_n: int = 1
    """Edit-effect questions per benchmark (a prefix of the eval sample)."""
    edit_specs: int = 1
    """Held-out (mutated baseline) specs per edit-effect question."""
    edit_sites: int = 1
    """Sites per family and spec at which an edit is applied (seeded choice among the eligible ones)."""
    ablation_variants: tuple[str, ...] = ("global", "full", "edge", "role", "capacity")
    """Training variants of notebook 03 (keys of VARIANTS), all started from the same SFT warm start."""
    ablation_steps: int = 1
    """GRPO steps of each variant ('full' reuses notebook 02's run when this equals train.max_steps)."""
    ablation_benchmarks: tuple[str, ...] = ("gsm8k", "mmlu")
    """Benchmarks each variant's adapter is evaluated on."""
    ablation_n: int = 1
    """Eval questions per ablation benchmark (a prefix of the eval sample)."""
    gallery: int = 4
    """Generated specs drawn in notebook 04."""
    dev_n: int = 0
    """Held-out TRAIN-pool questions per training benchmark (after the training questions in the seeded order, so never
    trained on) on which the main run's and each trained variant's checkpoints are evaluated in notebook 03; 0 = off."""
    dev_every: int = 4
    """Checkpoints evaluated on the dev set: step 0 (the warm start), every this many steps (a multiple of save_steps
    that exists), and the final adapter."""
    policy_server: bool = False
    """Trained policies write their evaluation specs on llama-server (lemon.policy.served: the same F32 weights and
    llguidance greedy, token for token the transformers specs; ~9x faster for the 0.5B, bench/served_policy_bench.py)."""

    def __post_init__(self):
        if self.profile not in STUDY_PROFILES or self.train.profile != STUDY_PROFILES[self.profile]:
            raise ValueError(f"profile={self.profile!r} (train preset {self.train.profile!r}); valid: "
                             f"{', '.join(f'{k} (train preset {v})' for k, v in STUDY_PROFILES.items())}")
        if self.protocol not in B.PROTOCOLS:
            raise ValueError(f"protocol={self.protocol!r}; valid: {', '.join(B.PROTOCOLS)}")
        for name in (*self.benchmarks, *self.ablation_benchmarks):
            B.get_benchmark(name)  # raises UnknownBenchmarkError naming the valid ones
        pinned_ok = lambda n, c: n in BASELINES and c in CAPACITIES  # noqa: E731  ('cot@large'; no capacity for 'lemon')
        ok = lambda m, extra: pinned_ok(*split_method(m)) if split_method(m)[1] else m in BASELINES + extra  # noqa: E731
        bad = [m for m in self.eval_methods if not ok(m, ORCHESTRATORS + (FIXED,))]
        bad += [f"fixed_candidates: {m}" for m in self.fixed_candidates if not ok(m, ())]
        if bad or not self.fixed_candidates or self.fixed_dev_n < 1:
            raise ValueError(f"unknown eval methods {bad} (or no fixed_candidates / fixed_dev_n < 1); valid: "
                             f"{', '.join(BASELINES + ORCHESTRATORS + (FIXED,))}, a baseline may name its capacity as "
                             f"'<baseline>@<capacity>' ({', '.join(CAPACITIES)}), e.g. 'cot@large'; fixed_candidates are "
                             f"baselines")
        bad = [v for v in self.ablation_variants if v not in VARIANTS]
        if bad:
            raise ValueError(f"unknown ablation variants {bad}; valid: {', '.join(VARIANTS)}")
        if self.eval_n is not None and self.eval_n < 1:
            raise ValueError("eval_n must be >= 1 (or None for the whole eval pool)")
        cap = self.eval_n or 10**9
        for k in ("edit_n", "ablation_n"):
            if not 0 <= getattr(self, k) <= cap:
                raise ValueError(f"{k}={getattr(self, k)} must be in 0..eval_n={self.eval_n}: its questions are a prefix of the eval sample")
        if min(self.edit_specs, self.edit_sites, self.ablation_steps, self.sc_k, self.dev_every) < 1 or self.dev_n < 0:
            raise ValueError("edit_specs, edit_sites, ablation_steps, sc_k and dev_every must be >= 1, dev_n >= 0")
        if self.dev_n and self.dev_every % self.train.save_steps:
            raise ValueError(f"dev_every={self.dev_every} must be a multiple of train.save_steps={self.train.save_steps}: "
                             "only saved checkpoints can be evaluated")
        if {self.baseline_capacity, self.orchestrator_capacity} - set(CAPACITIES):
            raise ValueError(f"capacities {self.baseline_capacity!r} / {self.orchestrator_capacity!r}; valid: {', '.join(CAPACITIES)}")
        EvalConfig("tree", "gsm8k", capacity=self.baseline_capacity, n_agents=self.n_agents, k=self.sc_k)  # same checks as eval
        OrchestratorConfig(capacity=self.orchestrator_capacity, max_tokens=self.orchestrator_max_tokens)
        if self.policy_server and self.train.policy.model not in SHIPPED:
            raise ValueError(f"policy_server=True serves a shipped GGUF policy; {self.train.policy.model!r} is not one "
                             f"({', '.join(SHIPPED)}): set policy_server=False (transformers writes the specs)")

    def is_main_run(self, variant: str) -> bool:
        """'full' trained for the main run's step count is notebook 02's run itself: not retrained, not compared."""
        return variant == "full" and self.ablation_steps == self.train.max_steps

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        """One line per field (train / sft nested one level), for the notebooks' config cell."""
        flat = lambda d, pre="": [f"{pre}{k} = {v!r}" for k, v in d.items()]  # noqa: E731
        d = self.to_dict()
        return "\n".join([*flat({k: v for k, v in d.items() if k not in ("train", "sft")}), *flat(d["train"], "train."),
                          *flat(d["sft"], "sft.")])


def study_preset(profile: str, seed: int = 0, **overrides) -> StudyConfig:
    """The study of a profile; `overrides` replace StudyConfig fields."""
    if profile not in STUDY_PROFILES:
        raise ValueError(f"unknown profile {profile!r}; valid: {', '.join(STUDY_PROFILES)}")
    preset = STUDY_PROFILES[profile]
    train, sft = train_preset(preset, seed=seed), sft_preset(preset, seed=seed)
    if profile == "smoke":
        # CI: 135M everywhere, 2 questions per benchmark, 1-step variants (global, full, edge). Measured on 2 lightly loaded
        # cores (2026-11-30): 01 3 s, 02 375 s (SFT ~5 min, CF-GRPO 21 s/step), 03 181 s, 04 498 s; total 17.7 min.
        # Under heavy contention from other jobs (load ~5 on 2 cores) the same study took ~75 min.
        cfg = StudyConfig("smoke", train, sft, seed=seed, orchestrator_max_tokens=256, ablation_variants=("global", "full", "edge"), ablation_benchmarks=("gsm8k",), ablation_n=1)
    elif profile == "test":
        # tests/test_notebooks.py::test_study_end_to_end (issue 28): each kind of step of the four notebooks once, on the real
        # code paths (llama-server workers and the 135M policy everywhere; SFT warm start on 2 corpus rows, 1 epoch = 1 step;
        # 1 CF-GRPO step; the trained policy writes its eval specs on llama-server, 3-5x faster than transformers here),
        # 1 question per benchmark on one math and one multiple-choice benchmark; methods: a single-agent baseline, a
        # multi-agent one, the prompted orchestrator, best-fixed (2 candidates on 1 dev question) and LEMON; the SFT
        # warm start as the one ablation variant (so summary.md leads with the lemon-vs-sft answer). Left out for time,
        # each measured on the same machine: the valid-rate probes (probe_questions=0; one probe question took ~60 s
        # before SFT and ~145 s after it: the 135M policy greedy-decodes ~7 tokens/s in transformers here, up to 286),
        # HumanEval (512-token code replies: +~150 s over edit effects and 04), a trained variant (a 2nd CF-GRPO step, +~85 s).
        # The smoke profile keeps all of them. MEASURED (2026-12-04, AMD EPYC, 2 idle cores, AVX2): 01 4 s, 02 104 s
        # (SFT 21 s, the CF-GRPO step 73 s), 03 37 s, 04 66 s; the test (+ resume 13 s + nbval 26 s) 250 s.
        cfg = StudyConfig("test", replace(train, max_steps=1), replace(sft, questions=1, epochs=1.0, probe_questions=0),
                          seed=seed, benchmarks=("gsm8k", "mmlu"), eval_n=1,
                          eval_methods=("cot", "chain", "prompted", FIXED, "lemon"),
                          fixed_candidates=("cot@small", "vanilla@large"), fixed_dev_n=1, orchestrator_max_tokens=256,
                          edit_n=1, ablation_variants=("sft",), ablation_benchmarks=("gsm8k",), ablation_n=1, gallery=2,
                          policy_server=True)
    elif profile == "cpu":
        # The embedded default asks ONE question: does CF-GRPO training help with these workers? The trained policy
        # (notebook 02: SFT warm start + 4 CF-GRPO steps on the math train pools) is paired with its own SFT warm start
        # (notebook 03 evaluates it on the same questions) and with CoT at each capacity, on 20 seeded EVAL-pool questions
        # of each math benchmark (60 paired questions). summary.md leads with the paired difference and its CI.
        # MEASURED end to end (2026-12-02, 2 idle cores; outputs/reference/cpu-20261202): 01 4 s; 02 42 min (SFT + 4
        # CF-GRPO steps of 263-511 s); 03 24 min (the SFT policy on 60 questions); 04 50 min (CoT x 3, the trained policy
        # ~20-30 s per question); 116 min in all (the estimate was ~2 h).
        # 60 pairs resolve a difference of ~0.15-0.2 in accuracy (the CI half-width), not a few points: the capacity the
        # policy picks moves accuracy by ~0.5 on GSM8K (CoT@small 0.00 vs CoT@large 0.53, 30 questions:
        # outputs/reference/baselines-gsm8k-20261130),
        # so a policy that learned it shows here.
        # Learning rate: the trainer preset's 2e-5 moves each LoRA weight by ~2e-5 per Adam step, ~1e-4 in 4 steps, and
        # the 8-step run at 2e-5 showed no trend (LOG.md session 8); the testbed's 135M policy learned at 2e-4 in 10
        # steps (session 9). 4 steps at 1e-4 can move the policy; whether that helps is the question (summary.md's
        # "differs from sft" column says whether the greedy specs moved at all).
        cfg = StudyConfig("cpu", replace(train, max_steps=4, learning_rate=1e-4), replace(sft, questions=8), seed=seed,
                          policy_server=True,
                          benchmarks=MATH, eval_n=20, eval_methods=("cot@small", "cot@medium", "cot@large", "lemon"),
                          edit_n=0, ablation_variants=("sft",), ablation_benchmarks=MATH, ablation_n=20)
    elif profile == "cpu-long":
        # cpu's question at a size that can separate methods, for a machine that can run unattended for ~13 h (ESTIMATED
        # from the same measured parts as cpu; never run): 15 CF-GRPO steps, global GRPO (lambda = 0) for 15 steps from
        # the same SFT adapter and seed, 50 EVAL-pool questions per math benchmark (150 paired), and the baselines the
        # issue names: CoT at each capacity, SC-CoT and Complete at medium, the prompted orchestrator, and the single best
        # fixed spec (of fixed_candidates) chosen on 10 TRAIN-pool questions per benchmark; CF and global checkpoints
        # every 4 steps on 10 held-out TRAIN-pool questions per benchmark (the learning curves). cpu's learning rate.
        cfg = StudyConfig("cpu-long", replace(train, max_steps=15, learning_rate=1e-4), replace(sft, questions=8), seed=seed,
                          policy_server=True, benchmarks=MATH, eval_n=50,
                          eval_methods=("cot@small", "cot@medium", "cot@large", "sc-cot@medium", "complete@medium",
                                        "prompted", FIXED, "lemon"),
                          edit_n=0, ablation_variants=("sft", "global"), ablation_steps=15, ablation_benchmarks=MATH,
                          ablation_n=50, dev_n=10, dev_every=4)
    elif profile == "cpu-wide":
        # Breadth for users with more time: the six benchmarks, every method, the five training variants at 1 step, 2
        # questions per benchmark (the `cpu` profile of 2026-11-30). MEASURED then (llama.cpp on both cores, LOG.md;
        # summed over resumes): 01 7 s; 02 ~39 min (SFT corpus on 8 questions 13.4 min, valid-rate probes 2 x 2.3 min,
        # SFT 3 steps ~2 min, 4 CF-GRPO steps 215-333 s each); 03 ~25 min; 04 ~57 min. About 2 h in all, before the
        # served policy (~9x faster trained-policy specs) and the math-pool trainer preset (~11 min per CF-GRPO step).
        cfg = StudyConfig("cpu-wide", replace(train, max_steps=4), replace(sft, questions=8), seed=seed, policy_server=True)
    elif profile == "paper":  # one GPU + vLLM workers: full eval pools, Table-2 ablation at 300 steps on 200 MMLU / GSM8K questions
        cfg = StudyConfig("paper", train, sft, seed=seed, eval_n=None, n_agents=4, sc_k=5, orchestrator_max_tokens=1024,
                          edit_n=20, edit_specs=2, edit_sites=2,
                          ablation_variants=("sft", "global", "full", "edge", "role", "capacity"), ablation_steps=300,
                          ablation_benchmarks=("mmlu", "gsm8k"), ablation_n=200, gallery=8)
    else:
        raise AssertionError(profile)
    return replace(cfg, **overrides)
