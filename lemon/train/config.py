"""Frozen, per-stage configs and the profiles (smoke / cpu / paper). Every field has a one-line docstring; __post_init__
rejects combinations that cannot work, with an error that says why."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from lemon.train.policy import PolicyConfig
from lemon.train.rewards import RewardConfig
from lemon.train.sft import SFTConfig

PROFILES = ("smoke", "cpu", "paper")


@dataclass(frozen=True)
class TrainConfig:
    """CF-GRPO training of the orchestrator (paper §3.3, stage 2)."""

    profile: str = "cpu"
    """Name of the preset this config came from (recorded in manifests)."""
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    """The orchestrator model and its LoRA."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward weights, token budget, invalid-spec penalty."""
    workers: dict = field(default_factory=dict)
    """Worker pool config for lemon.run.workers.WorkerPool.from_config ({} = the embedded llama.cpp ladder)."""
    benchmarks: tuple[str, ...] = ("gsm8k",)
    """Training benchmarks (their TRAIN pools only; see lemon.benchmarks.pools)."""
    train_questions: int = 16
    """Questions drawn (seeded) from the train pools."""
    num_generations: int = 4
    """GRPO group size G (paper: 4)."""
    batch_size: int = 4
    """Completions per optimisation step; must be a multiple of num_generations."""
    max_steps: int = 12
    """Optimisation steps."""
    learning_rate: float = 2e-5
    """AdamW learning rate of the LoRA weights."""
    beta: float = 0.0
    """KL weight to the reference policy (0 = no reference forward pass, TRL's default)."""
    temperature: float = 1.0
    """Sampling temperature of the orchestrator's rollouts."""
    max_completion_length: int = 320
    """Max spec tokens per rollout (a spec is ~150-250 tokens)."""
    max_agents: int = 4
    """Most agents a spec may have (told to the model, enforced by the parser)."""
    cf_lambda: float = 1.0
    """Weight of the counterfactual contrast on the edited span; 0 = plain GRPO ("global RL only")."""
    cf_families: tuple[str, ...] = ("edge", "role", "capacity")
    """Edit families allowed (an ablation may keep one)."""
    family_floor: float = 0.1
    """Probability floor of each family in the adaptive sampler."""
    worker_max_tokens: dict = field(default_factory=lambda: {"small": 192, "medium": 256, "large": 320})
    """Per-capacity cap on each agent's reply during training."""
    save_steps: int = 2
    """Checkpoint every this many steps (resume restores optimizer, RNG, sampler state)."""
    seed: int = 0
    """Seeds question sampling, rollouts, edits and workers."""

    def __post_init__(self):
        if self.profile not in PROFILES:
            raise ValueError(f"profile={self.profile!r}; valid: {', '.join(PROFILES)}")
        if self.num_generations < 2:
            raise ValueError("num_generations must be >= 2: GRPO's advantage is relative to the group")
        if self.batch_size % self.num_generations:
            raise ValueError(f"batch_size={self.batch_size} is not a multiple of num_generations={self.num_generations}: "
                             "every prompt's group must fit in one batch")
        if self.cf_lambda < 0:
            raise ValueError("cf_lambda must be >= 0 (the sign of the contrast is carried by delta)")
        bad = set(self.cf_families) - {"edge", "role", "capacity"}
        if bad or not self.cf_families:
            raise ValueError(f"cf_families {self.cf_families} must be a non-empty subset of edge, role, capacity")
        if not 1 <= self.max_agents <= 8:
            raise ValueError("max_agents must be in 1..8")
        if self.train_questions < 1 or self.max_steps < 1 or self.save_steps < 1:
            raise ValueError("train_questions, max_steps and save_steps must be >= 1")

    def to_dict(self) -> dict:
        return asdict(self)


def train_preset(profile: str, **overrides) -> TrainConfig:
    """The named preset, with field overrides (e.g. cf_lambda=0.0 for the global-RL-only ablation)."""
    if profile == "smoke":
        # CI: the 135M policy and 135M workers everywhere, a couple of steps on 2 questions.
        cfg = TrainConfig(profile="smoke", policy=PolicyConfig(model="smollm2-135m", lora_r=8, lora_alpha=16),
                          workers={c: {"backend": "llama_cpp", "model": "smollm2-135m"} for c in ("small", "medium", "large")},
                          train_questions=2, num_generations=2, batch_size=2, max_steps=2, max_completion_length=200,
                          max_agents=3, worker_max_tokens={"small": 16, "medium": 24, "large": 32}, save_steps=1,
                          learning_rate=1e-4, temperature=0.6)  # a 135M policy at T=1 writes almost no valid spec
    elif profile == "cpu":
        # The embedded default on 2 cores: 0.5B policy, 135M/0.5B/1.5B workers. Sized from the `cpu` study's measured unit
        # times (2026-11-30, LOG.md): CF-GRPO 215-333 s per step of 4 rollouts, so 8 steps ~37 min; with the warm start
        # below (16 questions at ~100 s each ~27 min, probes + SFT ~5 min) `lemon train --profile cpu` is ~70 min.
        cfg = TrainConfig(profile="cpu", max_steps=8)
    elif profile == "paper":
        # One GPU with internet: Qwen2.5-7B policy via Unsloth; workers served by vLLM (edit base_url/models to your server).
        cfg = TrainConfig(profile="paper", policy=PolicyConfig(model="Qwen/Qwen2.5-7B-Instruct", backend="auto"),
                          workers={c: {"backend": "openai", "base_url": "http://127.0.0.1:8000/v1", "model": m}
                                   for c, m in (("small", "Qwen/Qwen2.5-7B-Instruct"), ("medium", "Qwen/Qwen2.5-14B-Instruct"),
                                                ("large", "Qwen/Qwen2.5-32B-Instruct"))},
                          benchmarks=("gsm8k", "multiarith", "svamp", "aqua", "mmlu", "humaneval"), train_questions=6000,
                          num_generations=4, batch_size=16, max_steps=1500, max_agents=8,
                          worker_max_tokens={"small": 1024, "medium": 1024, "large": 1024}, save_steps=50)
    else:
        raise ValueError(f"unknown profile {profile!r}; valid: {', '.join(PROFILES)}")
    return replace(cfg, **overrides)


def sft_preset(profile: str, **overrides) -> SFTConfig:
    """Warm-start preset. smoke: format only (no execution filter) so the 135M policy learns to write parseable specs in a
    couple of minutes; cpu / paper: rejection sampling (executed, solving specs only)."""
    if profile == "smoke":
        cfg = SFTConfig(questions=8, candidates_per_question=2, keep_per_question=2, filter_by_execution=False, max_agents=3, epochs=3.0, probe_questions=2,
                        learning_rate=5e-4, batch_size=2)
    elif profile == "cpu":
        cfg = SFTConfig(questions=16, candidates_per_question=2, use_orchestrator=True, filter_by_execution=True,
                        keep_per_question=1, max_agents=4, epochs=3.0, learning_rate=2e-4)
    elif profile == "paper":
        cfg = SFTConfig(questions=2000, candidates_per_question=4, use_orchestrator=True, filter_by_execution=True,
                        keep_per_question=2, max_agents=8, epochs=2.0, learning_rate=1e-4, batch_size=8, max_length=4096)
    else:
        raise ValueError(f"unknown profile {profile!r}; valid: {', '.join(PROFILES)}")
    return replace(cfg, **overrides)
