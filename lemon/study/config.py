"""The study's configuration: one frozen StudyConfig per run, built from a profile of configs/profiles.yaml (smoke,
test, cpu, cpu-long, cpu-wide, paper; lemon.study.profiles reads it). lemon.study.runner re-exports everything here
(notebooks call `study.study_preset`, `study.setup`)."""
from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, replace

from lemon import benchmarks as B
from lemon.eval.baselines import BASELINES
from lemon.eval.orchestrator import OrchestratorConfig
from lemon.eval.runner import EvalConfig
from lemon.prompts import CAPACITIES
from lemon.run.models import SHIPPED
from lemon.study.profiles import PROFILES_FILE, Profile, ProfileError, apply_overrides, get_profile, load_profiles
from lemon.train.config import TrainConfig, sft_preset, train_preset, with_workers
from lemon.train.edits import FAMILIES
from lemon.train.sft import SFTConfig

# study profile -> the trainer / warm-start preset it starts from; every profile, what it answers and what it took:
# configs/profiles.yaml (lemon.study.profiles)
STUDY_PROFILES = {name: p.base for name, p in load_profiles().items()}
MATH = ("multiarith", "svamp", "gsm8k")
NOTEBOOKS = ("01_prepare_data", "02_train_grpo_lora", "03_ablations", "04_evaluate")
FIXED = "best-fixed"  # eval method: the one fixed method (baseline spec) that scores best on a TRAIN-pool dev sample
# eval methods besides the baselines: the untrained prompted worker, the trained policy
ORCHESTRATORS = ("prompted", "lemon")
# sft = warm start only (no RL); full = CF over all families
VARIANTS = {"sft": None, "global": {"cf_lambda": 0.0}, "full": {},
            **{f: {"cf_families": (f,)} for f in FAMILIES}}  # one edit family alone


def split_method(method: str) -> tuple[str, str | None]:
    """'cot@large' -> ('cot', 'large'): an eval method may pin its baseline's capacity; 'cot' -> ('cot', None), which
    runs at StudyConfig.baseline_capacity."""
    name, _, cap = method.partition("@")
    return name, cap or None


@dataclass(frozen=True)
class StudyConfig:
    """Everything the four notebooks do for one profile (training itself: `train` / `sft`, from lemon.train.config)."""

    profile: str
    """Name of the profile it was built from (configs/profiles.yaml: smoke, test, cpu, cpu-long, cpu-wide, paper)."""
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
    ablation_variants: tuple[str, ...] = ("global", "full", *FAMILIES)
    """Training variants of notebook 03 (keys of VARIANTS: one per edit family of lemon.train.edits.REGISTRY), all
    started from the same SFT warm start."""
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
    eval_concurrency: int = 1
    """Questions in flight in every evaluation of the study (lemon.eval.runner.run_eval): the llama-servers batch their
    worker calls (4 slots each), ~1.1-1.5x the questions per minute on 2 cores (LOG.md, 2026-12-01); answers are not
    bit-identical to concurrency 1 (batch shape changes greedy replies, lemon.run.servers.DETERMINISTIC)."""
    policy_server: bool = False
    """Trained policies write their evaluation specs on llama-server (lemon.policy.served: the same F32 weights and
    llguidance greedy, token for token the transformers specs; ~9x faster for the 0.5B,
    bench/served_policy_bench.py)."""

    def __post_init__(self):
        if self.profile in STUDY_PROFILES and self.train.profile != STUDY_PROFILES[self.profile]:
            raise ValueError(f"profile={self.profile!r} starts from the {STUDY_PROFILES[self.profile]!r} "
                             f"trainer preset (configs/profiles.yaml), but train.profile={self.train.profile!r}: build "
                             "it with study_preset")
        if self.protocol not in B.PROTOCOLS:
            raise ValueError(f"protocol={self.protocol!r}; valid: {', '.join(B.PROTOCOLS)}")
        for name in (*self.benchmarks, *self.ablation_benchmarks):
            B.get_benchmark(name)  # raises UnknownBenchmarkError naming the valid ones
        # pinned: 'cot@large'; no capacity for 'lemon'
        pinned_ok = lambda n, c: n in BASELINES and c in CAPACITIES  # noqa: E731
        ok = lambda m, extra: (pinned_ok(*split_method(m)) if split_method(m)[1]  # noqa: E731
                               else m in BASELINES + extra)
        bad = [m for m in self.eval_methods if not ok(m, ORCHESTRATORS + (FIXED,))]
        bad += [f"fixed_candidates: {m}" for m in self.fixed_candidates if not ok(m, ())]
        if bad or not self.fixed_candidates or self.fixed_dev_n < 1:
            raise ValueError(f"unknown eval methods {bad} (or no fixed_candidates / fixed_dev_n < 1); valid: "
                             f"{', '.join(BASELINES + ORCHESTRATORS + (FIXED,))}, a baseline may name its capacity as "
                             f"'<baseline>@<capacity>' ({', '.join(CAPACITIES)}), e.g. 'cot@large'; "
                             f"fixed_candidates are baselines")
        if not isinstance(self.eval_concurrency, int) or self.eval_concurrency < 1:
            raise ValueError(f"eval_concurrency={self.eval_concurrency!r} must be an int >= 1 (questions in flight)")
        bad = [v for v in self.ablation_variants if v not in VARIANTS]
        if bad:
            raise ValueError(f"unknown ablation variants {bad}; valid: {', '.join(VARIANTS)}")
        if self.eval_n is not None and self.eval_n < 1:
            raise ValueError("eval_n must be >= 1 (or None for the whole eval pool)")
        cap = self.eval_n or 10**9
        for k in ("edit_n", "ablation_n"):
            if not 0 <= getattr(self, k) <= cap:
                raise ValueError(f"{k}={getattr(self, k)} must be in 0..eval_n={self.eval_n}: its questions are a "
                                 "prefix of the eval sample")
        if min(self.edit_specs, self.edit_sites, self.ablation_steps, self.sc_k, self.dev_every) < 1 or self.dev_n < 0:
            raise ValueError("edit_specs, edit_sites, ablation_steps, sc_k and dev_every must be >= 1, dev_n >= 0")
        if self.dev_n and self.dev_every % self.train.save_steps:
            raise ValueError(f"dev_every={self.dev_every} must be a multiple of "
                             f"train.save_steps={self.train.save_steps}: only saved checkpoints can be evaluated")
        if {self.baseline_capacity, self.orchestrator_capacity} - set(CAPACITIES):
            raise ValueError(f"capacities {self.baseline_capacity!r} / {self.orchestrator_capacity!r}; valid: "
                             f"{', '.join(CAPACITIES)}")
        # same checks as eval
        EvalConfig("tree", "gsm8k", capacity=self.baseline_capacity, n_agents=self.n_agents, k=self.sc_k)
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


def _trainer_key(key: str) -> bool:
    """'train.FIELD' / 'sft.FIELD': a --set item for the trainer or the warm start, not for StudyConfig itself."""
    head, dot, _ = key.partition(".")
    return bool(dot) and head in ("train", "sft")


def _trainer_of(p: Profile, seed: int, sets: dict, workers: str | None) -> tuple[TrainConfig, SFTConfig]:
    """train_sft_preset for a profile already read (study_preset reads the file once)."""
    train = apply_overrides(train_preset(p.base, seed=seed), p.train, f"profile {p.name!r}: train")
    sft = apply_overrides(sft_preset(p.base, seed=seed), p.sft, f"profile {p.name!r}: sft")
    if workers:
        train, notes = with_workers(train, workers)
        for n in notes:
            print(f"note: {n}", file=sys.stderr)
    pick = lambda pre: {k[len(pre):]: v for k, v in sets.items() if k.startswith(pre)}  # noqa: E731
    return apply_overrides(train, pick("train."), "--set train"), apply_overrides(sft, pick("sft."), "--set sft")


def train_sft_preset(profile: str, seed: int = 0, *, sets: dict | None = None, workers: str | None = None,
                     profiles_file=PROFILES_FILE) -> tuple[TrainConfig, SFTConfig]:
    """The trainer and warm-start configs of a profile: its base presets (seeded with `seed`), the profile's train / sft
    overrides, `workers` (a --workers file replacing train.workers), then `sets` ({'train.FIELD' or 'sft.FIELD':
    value}). `python -m lemon train --profile P` and the study of P (notebook 02) train with exactly these."""
    bad = [k for k in sets or {} if not _trainer_key(k)]
    if bad:
        raise ProfileError(f"--set {bad}: trainer settings are train.FIELD or sft.FIELD (e.g. train.max_steps=8)")
    return _trainer_of(get_profile(profile, profiles_file), seed, sets or {}, workers)


def study_preset(profile: str, seed: int = 0, *, sets: dict | None = None, workers: str | None = None,
                 profiles_file=PROFILES_FILE, **overrides) -> StudyConfig:
    """The study of a profile of configs/profiles.yaml: train_sft_preset's trainer and warm start, the profile's study
    overrides, then `sets` (parsed --set items: StudyConfig fields, train.FIELD, sft.FIELD), then `overrides`
    (StudyConfig fields, for code and tests)."""
    sets = sets or {}
    p = get_profile(profile, profiles_file)
    train, sft = _trainer_of(p, seed, {k: v for k, v in sets.items() if _trainer_key(k)}, workers)
    cfg = apply_overrides(StudyConfig(profile, train, sft, seed=seed), p.study, f"profile {profile!r}: study")
    cfg = apply_overrides(cfg, {k: v for k, v in sets.items() if not _trainer_key(k)}, "--set: StudyConfig")
    return replace(cfg, **overrides)
