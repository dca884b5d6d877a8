"""Frozen, per-stage configs and the profiles (smoke / cpu / paper). Every field has a one-line docstring; __post_init__
rejects combinations that cannot work, with an error that says why."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from lemon.spec import MAX_AGENTS
from lemon.spec.grammar import SpecGrammar
from lemon.spec.schema import DUTY_CHARS, ROLE_CHARS
from lemon.policy.dtype import SAMPLING_DTYPES
from lemon.train.edits import FAMILIES
from lemon.policy.model import PolicyConfig
from lemon.run.workers import SERVER_BACKENDS, load_worker_config
from lemon.train.rewards import RewardConfig
from lemon.train.sft import SFTConfig

PROFILES = ("smoke", "cpu", "paper")
TRAIN_DTYPES = ("auto", "fp32", "bf16")
PAPER_WORKERS = Path(__file__).resolve().parents[2] / "configs" / "workers-paper.yaml"
"""The paper profile's workers: the only place their endpoints, client settings (timeout_s, max_concurrency, max_retries,
backoff_s) and reply caps (max_tokens) are written; train_preset('paper') reads it."""


def workers_from_file(path) -> tuple[dict, dict]:
    """A --workers file (lemon.run.workers.load_worker_config) split into TrainConfig.workers (its capacity entries, with
    every client setting) and its max_tokens ({} if none). Training caps replies at TrainConfig.worker_max_tokens (they size
    the budgets; pipeline.build_pool hands them to the pool), so a file's max_tokens reach training only via the paper preset."""
    cfg = load_worker_config(path)
    caps = cfg.pop("max_tokens", None) or {}
    return cfg, caps



def with_workers(cfg: "TrainConfig", path) -> tuple["TrainConfig", list[str]]:
    """`cfg` training with the workers of a --workers file, and notes for the user: deterministic_workers is turned off
    for workers that are not llama-servers (it applies to them only; build_pool would refuse it), and the file's
    max_tokens do not replace the preset's reply caps (they size its budgets)."""
    workers, caps = workers_from_file(path)
    notes, det = [], cfg.deterministic_workers
    if det and any(e.get("backend") not in SERVER_BACKENDS for e in workers.values()):
        det = False
        notes.append(f"{path} names workers that are not llama-servers: deterministic_workers is off (it applies to "
                     "llama-server workers only)")
    if caps and caps != cfg.worker_max_tokens:
        notes.append(f"training caps worker replies at the {cfg.profile} preset's {cfg.worker_max_tokens} (they size its "
                     f"budgets), not {path}'s max_tokens {caps}")
    return replace(cfg, workers=workers, deterministic_workers=det), notes

# Measured sizes used to size presets (2026-12-01; tests/test_config.py re-measures them with the real tokenizers):
SPEC_TOKENS_PER_AGENT = 90
"""Qwen2.5 tokens of one agent of a canonical spec with the grammar's longest role (48 chars) and duty (200 chars), ~85."""
SPEC_TOKENS_FIXED = 16
"""Tokens of `agents:` and `final: aN` around the agents."""
WORKER_PROMPT_TOKENS = 420
"""Worker prompt tokens of one agent before any parent output (system + user template + a long GSM8K question), ~360."""


def size_budgets(max_agents: int, worker_max_tokens: dict, max_context_tokens: int = 600) -> dict:
    """Token sizes that follow from a preset's limits, so that no allowed spec is cut off by a budget it cannot see:
    `completion` = the longest spec of max_agents agents; `task` = the nominal worker tokens of the most expensive
    allowed spec (a complete DAG, every agent at the largest reply cap, every edge passing a parent's reply of at most
    max_context_tokens); `efficiency` = the same, so token efficiency is 0 only for the worst spec and stays informative
    for every multi-agent spec (a 3-agent chain at the cpu caps keeps ~0.5)."""
    reply = max(worker_max_tokens.values())
    edges = max_agents * (max_agents - 1) // 2
    worst = max_agents * (WORKER_PROMPT_TOKENS + reply) + edges * min(reply, max_context_tokens)
    return {"completion": SPEC_TOKENS_FIXED + max_agents * SPEC_TOKENS_PER_AGENT, "task": worst, "efficiency": worst}


@dataclass(frozen=True)
class TrainConfig:
    """CF-GRPO training of the orchestrator (paper §3.3, stage 2)."""

    profile: str = "cpu"
    """Name of the preset this config came from (recorded in manifests)."""
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    """The orchestrator model and its LoRA."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward form, weights, token budget, invalid-spec penalty."""
    workers: dict = field(default_factory=dict)
    """Worker pool config for lemon.run.workers.WorkerPool.from_config ({} = the embedded default ladder)."""
    benchmarks: tuple[str, ...] = ("gsm8k",)
    """Training benchmarks (their TRAIN pools only; see lemon.benchmarks.pools)."""
    train_questions: int = 16
    """Questions drawn (seeded) from the train pools."""
    num_generations: int = 4
    """GRPO group size G (paper: 4)."""
    batch_size: int = 4
    """Completions per optimisation step (= questions per step x G); must be a multiple of num_generations."""
    micro_batch: int = 0
    """Completions per forward/backward pass (gradient accumulation up to batch_size); 0 = batch_size."""
    max_steps: int = 12
    """Optimisation steps."""
    learning_rate: float = 2e-5
    """AdamW learning rate of the LoRA weights."""
    beta: float = 0.0
    """KL weight to the reference policy (0 = no reference forward pass, TRL's default)."""
    temperature: float = 1.0
    """Sampling temperature of the orchestrator's rollouts."""
    max_completion_length: int = 320
    """Max spec tokens per rollout. size_budgets()['completion'] holds max_agents canonical agents at ~90 Qwen2.5 tokens
    each, not the grammar's worst case: 200 free duty characters can take ~200 tokens (the 135M's gibberish duties hit the
    cap in 7 of 480 testbed samples, which then score as invalid; LOG.md 2026-12-02)."""
    max_agents: int = 4
    """Most agents a spec may have (told to the model, enforced by the parser and the grammar)."""
    constrained: bool = True
    """Sample specs under the spec grammar (lemon.spec.grammar): every rollout is valid; False = the unconstrained ablation."""
    role_chars: int = ROLE_CHARS
    """Longest `role` text the grammar lets a rollout write (shorter = fewer tokens per spec; tests use this)."""
    duty_chars: int = DUTY_CHARS
    """Longest `duty` text the grammar lets a rollout write."""
    cf_lambda: float = 1.0
    """Weight of the counterfactual contrast on the edited span; 0 = plain GRPO ("global RL only")."""
    cf_families: tuple[str, ...] = FAMILIES
    """Edit families allowed (an ablation may keep one)."""
    family_floor: float = 0.1
    """Probability floor of each family in the adaptive sampler."""
    scale_rewards: str = "none"
    """Divisor of both the global and the CF advantage: 'none' (raw reward units: a fixed CF weight), 'batch' std or 'group' std (lemon.train.cf)."""
    std_floor: float = 0.1
    """Smallest divisor under 'batch' / 'group' scaling (a flat step must not blow up a counterfactual contrast)."""
    resample: int = 1
    """Dynamic sampling: extra attempts for a group whose rewards have no spread (0 = keep every group as sampled)."""
    curriculum: bool = True
    """Prefer training questions whose groups had reward spread (labels from training executions)."""
    worker_seed_per_step: bool = False
    """A fresh worker seed each step (the testbed's simulated workers); False = the run seed always (greedy real workers)."""
    deterministic_workers: bool = False
    """Score rollouts and their edits on llama-server workers in deterministic mode (ServerConfig.deterministic: one request
    in flight per server, prompt cache off), so a spec's reward and its CF delta do not depend on what else is in flight
    (issue 30: 11 of 20 identical greedy requests flipped at 8 in flight, 0 of 20 in this mode, LOG.md 2026-12-05). On by
    default in the llama-server presets (smoke, cpu); costs batching throughput (1.8x slower in that bench on 2 busy
    cores). Only for llama-server workers: build_pool refuses it for any other backend rather than skip it."""
    rollout_concurrency: int = 8
    """Spec executions in flight at once (workers bound it further by their own slots)."""
    sample_dtype: str = "auto"
    """How rollouts are sampled (lemon.policy.dtype): 'auto' (a bf16 copy on a native-bf16 CPU), 'model', 'bf16_copy', 'autocast_bf16'."""
    train_dtype: str = "auto"
    """Loss forward/backward: 'auto' (bf16 autocast where the CPU supports it, fp32 otherwise; CUDA: bf16), 'fp32', 'bf16'."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (the paper profile: a 7B policy at batch 16 x ~1.7k tokens needs it)."""
    worker_max_tokens: dict = field(default_factory=lambda: {"small": 192, "medium": 256, "large": 320})
    """Per-capacity cap on each agent's reply during training."""
    task_token_budget: int = 6000
    """Nominal worker tokens of one execution past which its remaining levels are not run (score 0)."""
    save_steps: int = 2
    """Checkpoint every this many steps (resume restores optimizer, RNG, sampler and curriculum state)."""
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
        mb = self.micro_batch or self.batch_size
        if self.batch_size % mb:
            raise ValueError(f"micro_batch={self.micro_batch} must divide batch_size={self.batch_size} (gradient accumulation)")
        if self.cf_lambda < 0:
            raise ValueError("cf_lambda must be >= 0 (the sign of the contrast is carried by delta)")
        bad = set(self.cf_families) - set(FAMILIES)
        if bad or not self.cf_families:
            raise ValueError(f"cf_families {self.cf_families} must be a non-empty subset of {', '.join(FAMILIES)}")
        if not 1 <= self.max_agents <= MAX_AGENTS:
            raise ValueError(f"max_agents must be in 1..{MAX_AGENTS}")
        if self.train_questions < self.batch_size // self.num_generations:
            raise ValueError(f"train_questions={self.train_questions} < {self.batch_size // self.num_generations} questions "
                             "per step (batch_size / num_generations)")
        if self.max_steps < 1 or self.save_steps < 1 or self.resample < 0 or self.rollout_concurrency < 1:
            raise ValueError("max_steps, save_steps and rollout_concurrency must be >= 1 and resample >= 0")
        if self.scale_rewards not in ("batch", "group", "none") or self.std_floor <= 0:
            raise ValueError(f"scale_rewards={self.scale_rewards!r} must be batch|group|none and std_floor > 0")
        if self.sample_dtype not in (*SAMPLING_DTYPES, "auto") or self.train_dtype not in TRAIN_DTYPES:
            raise ValueError(f"sample_dtype must be auto or one of {SAMPLING_DTYPES} and train_dtype one of {TRAIN_DTYPES}")
        if self.reward.max_agents != self.max_agents:
            raise ValueError(f"reward.max_agents={self.reward.max_agents} != max_agents={self.max_agents}: graph cost must be "
                             "normalised by the largest spec training allows (use train_preset, or set both)")
        SpecGrammar(("solver",), role_chars=self.role_chars, duty_chars=self.duty_chars)  # its own bounds check (ValueError)
        need = size_budgets(self.max_agents, self.worker_max_tokens)["completion"]
        if self.constrained and self.max_completion_length < need:
            raise ValueError(f"max_completion_length={self.max_completion_length} cannot hold a {self.max_agents}-agent spec "
                             f"(~{need} tokens, lemon.train.config.size_budgets)")

    def grammar(self, prompts, domain: str) -> SpecGrammar:
        """The spec grammar rollouts of this config are sampled under for a task of `domain` (training and held-out eval)."""
        return SpecGrammar.for_domain(prompts, domain, max_agents=self.max_agents, role_chars=self.role_chars,
                                      duty_chars=self.duty_chars)

    def to_dict(self) -> dict:
        return asdict(self)


def _sized(profile: str, max_agents: int, worker_max_tokens: dict, reward: RewardConfig | None = None, **kw) -> TrainConfig:
    """A TrainConfig whose completion length, task budget and efficiency budget follow from its limits (size_budgets)."""
    b = size_budgets(max_agents, worker_max_tokens)
    reward = replace(reward or RewardConfig(), max_agents=max_agents, token_budget=b["efficiency"])
    return TrainConfig(profile=profile, max_agents=max_agents, worker_max_tokens=worker_max_tokens, reward=reward,
                       max_completion_length=b["completion"], task_token_budget=b["task"], **kw)


def train_preset(profile: str, **overrides) -> TrainConfig:
    """The named preset, with field overrides (e.g. cf_lambda=0.0 for the global-RL-only ablation). Sizes come from
    size_budgets(); override max_agents / worker_max_tokens through the preset, not afterwards."""
    if profile == "smoke":
        # CI: the 135M policy and 135M workers everywhere, 2 steps on 2 questions, grammar-constrained.
        cfg = _sized("smoke", 3, {"small": 16, "medium": 24, "large": 32},
                     policy=PolicyConfig(model="smollm2-135m", lora_r=8, lora_alpha=16),
                     workers={c: {"backend": "llama_cpp", "model": "smollm2-135m"} for c in ("small", "medium", "large")},
                     train_questions=2, num_generations=2, batch_size=2, max_steps=2, save_steps=1,
                     learning_rate=1e-4, temperature=1.0, curriculum=False, deterministic_workers=True)
    elif profile == "cpu":
        # The embedded default on 2 cores: 0.5B policy, 135M/0.5B/1.5B workers, 2 questions x G=4 per step. The math
        # pools run easiest first (round-robin MultiArith, SVAMP, GSM8K) and a flat group gets two more draws: on GSM8K
        # alone with one redraw, half the groups were all-fail under the gated reward (LOG.md, 2026-12-01 session 7).
        cfg = _sized("cpu", 4, {"small": 192, "medium": 256, "large": 320}, benchmarks=("multiarith", "svamp", "gsm8k"),
                     train_questions=64, num_generations=4, batch_size=8, micro_batch=4, max_steps=8,
                     learning_rate=2e-5, resample=2, deterministic_workers=True)
    elif profile == "paper":
        # One GPU with internet: Qwen2.5-7B policy via Unsloth; one vLLM server per capacity (scripts/vllm_workers.sh),
        # workers and reply caps read from PAPER_WORKERS (edit its base_urls, or pass `lemon train --workers`). Paper: G=4,
        # ~1500 steps.
        workers, caps = workers_from_file(PAPER_WORKERS)
        if set(caps) != set(workers):
            raise ValueError(f"{PAPER_WORKERS}: max_tokens must name every capacity ({sorted(workers)}), got {sorted(caps)}")
        cfg = _sized("paper", 8, caps, policy=PolicyConfig(model="Qwen/Qwen2.5-7B-Instruct", backend="auto"), workers=workers,
                     benchmarks=("gsm8k", "multiarith", "svamp", "aqua", "mmlu", "humaneval"), train_questions=6000,
                     num_generations=4, batch_size=16, max_steps=1500, save_steps=50, rollout_concurrency=64,
                     gradient_checkpointing=True)
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
