"""TrainConfig (frozen; every field has a one-line docstring; __post_init__ rejects combinations that cannot work, with
an error that says why) and the trainer / warm-start presets. Every preset VALUE is in configs/profiles.yaml
(`presets`): this module reads it, applies field overrides and derives the token sizes that follow from a preset's
limits."""
from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import yaml

from lemon.spec import MAX_AGENTS
from lemon.spec.grammar import SpecGrammar
from lemon.spec.schema import DUTY_CHARS, ROLE_CHARS
from lemon.policy.dtype import SAMPLING_DTYPES
from lemon.train.edits import FAMILIES
from lemon.policy.model import PolicyConfig
from lemon.run.workers import SERVER_BACKENDS, load_worker_config
from lemon.train.rewards import RewardConfig
from lemon.train.sft import SFTConfig

ROOT = Path(__file__).resolve().parents[2]
PROFILES_FILE = ROOT / "configs" / "profiles.yaml"
"""Every profile and preset value: `presets` (read here) and the study profiles (lemon.study.profiles)."""
_PRESET_KEYS = {"train", "sft", "workers_file"}


class ProfileError(ValueError):
    """A profiles file, profile name or override that cannot be used; the message says what would work."""


def read_profiles_file(path: str | Path = PROFILES_FILE) -> dict:
    """The profiles file as a mapping (a clear error for a missing, invalid or non-mapping file)."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ProfileError(f"{path}: not valid YAML ({e})") from None
    if not isinstance(raw, dict) or not raw:
        raise ProfileError(f"{path}: expected a mapping of profile name -> profile")
    return raw


def read_presets(path: str | Path = PROFILES_FILE) -> dict[str, dict]:
    """The file's `presets`: name -> {train: TrainConfig fields, sft: SFTConfig fields, workers_file: optional path
    (relative to the repo root) of the workers and reply caps}."""
    presets = read_profiles_file(path).get("presets")
    if not isinstance(presets, dict) or not presets:
        raise ProfileError(f"{path}: needs `presets:`, a mapping of preset name -> "
                           f"{{{', '.join(sorted(_PRESET_KEYS))}}}")
    for name, p in presets.items():
        if not isinstance(p, dict) or set(p) - _PRESET_KEYS or not isinstance(p.get("train"), dict) \
                or "max_agents" not in p["train"] or not ("worker_max_tokens" in p["train"]) ^ ("workers_file" in p) \
                or not isinstance(p.get("sft") or {}, dict):
            raise ProfileError(f"{path}: preset {name!r} must be a mapping with train (incl. max_agents and either "
                               f"train.worker_max_tokens or a workers_file with max_tokens), sft and an optional "
                               f"workers_file; keys allowed: {', '.join(sorted(_PRESET_KEYS))}")
    return presets


PROFILES = tuple(read_presets())  # the preset names (smoke, cpu, paper): what TrainConfig.profile may be
TRAIN_DTYPES = ("auto", "fp32", "bf16")


def _coerce(current, value):
    """YAML / JSON lists become tuples where the field holds a tuple (every sequence field of the configs does), and a
    whole number becomes a float where the field holds a float."""
    if isinstance(current, tuple) and isinstance(value, list):
        return tuple(value)
    if isinstance(current, float) and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def apply_overrides(obj, overrides: dict, what: str = "config"):
    """`obj` (a frozen dataclass) with `overrides` ({field or 'nested.field': value}; a mapping for a nested config
    sets its fields) applied through dataclasses.replace, so each config's __post_init__ checks the result. An unknown
    field is an error naming the valid ones."""
    if not overrides:
        return obj
    names = {f.name for f in dataclasses.fields(obj)}
    flat, nested = {}, {}
    for key, value in overrides.items():
        head, dot, rest = key.partition(".")
        if head not in names:
            raise ProfileError(f"{what} has no field {head!r} (from {key!r}); valid: {', '.join(sorted(names))}")
        if dot:
            if not dataclasses.is_dataclass(getattr(obj, head)):
                raise ProfileError(f"{what}.{head} is not a nested config: set it as {head}=VALUE, not {key!r}")
            nested.setdefault(head, {})[rest] = value
        elif dataclasses.is_dataclass(getattr(obj, head)) and isinstance(value, dict):
            nested.setdefault(head, {}).update(value)
        else:
            flat[head] = _coerce(getattr(obj, head), value)
    for head, sub in nested.items():
        flat[head] = apply_overrides(flat.get(head, getattr(obj, head)), sub, f"{what}.{head}")
    return dataclasses.replace(obj, **flat)


def workers_from_file(path) -> tuple[dict, dict]:
    """A --workers file (lemon.run.workers.load_worker_config) split into TrainConfig.workers (its capacity entries,
    with every client setting) and its max_tokens ({} if none). Training caps replies at TrainConfig.worker_max_tokens
    (they size the budgets; pipeline.build_pool hands them to the pool), so a file's max_tokens reach training only via
    a preset's workers_file (the paper preset)."""
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
        notes.append(f"training caps worker replies at the {cfg.profile} preset's {cfg.worker_max_tokens} "
                     f"(they size its budgets), not {path}'s max_tokens {caps}")
    return replace(cfg, workers=workers, deterministic_workers=det), notes

# Measured sizes used to size presets (LOG.md, 2026-12-01; tests/test_config.py re-measures them with the real
# tokenizers):
SPEC_TOKENS_PER_AGENT = 90
"""Qwen2.5 tokens of one agent of a canonical spec with the grammar's longest role (48 chars) and duty (200 chars),
~85."""
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
    each, not the grammar's worst case: 200 free duty characters can take ~200 tokens (the 135M's gibberish duties hit
    the cap in 7 of 480 testbed samples, which then score as invalid; LOG.md 2026-12-02)."""
    max_agents: int = 4
    """Most agents a spec may have (told to the model, enforced by the parser and the grammar)."""
    constrained: bool = True
    """Sample specs under the spec grammar (lemon.spec.grammar): every rollout is valid; False = the unconstrained
    ablation."""
    role_chars: int = ROLE_CHARS
    """Longest `role` text the grammar lets a rollout write (shorter = fewer tokens per spec; tests use this)."""
    duty_chars: int = DUTY_CHARS
    """Longest `duty` text the grammar lets a rollout write."""
    cf_lambda: float = 1.0
    """Weight of the counterfactual contrast on the edited span; 0 = plain GRPO ("global RL only")."""
    cf_families: tuple[str, ...] = FAMILIES
    """Edit families allowed (an ablation may keep one)."""
    cf_baseline: str = "none"
    """CF contrast baseline (lemon.train.cf.baselined_deltas): 'none' = the paper's raw delta; 'family' = minus the
    step's leave-one-out mean delta of the same edit family (an extension: the paper's one-sided edits make most
    deltas > 0)."""
    family_floor: float = 0.1
    """Probability floor of each family in the adaptive sampler."""
    scale_rewards: str = "none"
    """Divisor of both the global and the CF advantage: 'none' (raw reward units: a fixed CF weight), 'batch' std or
    'group' std (lemon.train.cf)."""
    std_floor: float = 0.1
    """Smallest divisor under 'batch' / 'group' scaling (a flat step must not blow up a counterfactual contrast)."""
    resample: int = 1
    """Dynamic sampling: extra attempts for a group whose rewards have no spread (0 = keep every group as sampled)."""
    curriculum: bool = True
    """Prefer training questions whose groups had reward spread (labels from training executions)."""
    mask_forced_tokens: bool = True
    """Tokens the grammar forced (one allowed choice) get advantage 0 in both terms (lemon.train.cf.forced_mask says
    why); False = the whole completion carries the rollout's advantage."""
    stratify: bool = False
    """Every step's questions go round-robin over the training benchmarks (the testbed's task types), so a step of Q >=
    #benchmarks questions sees each of them (lemon.train.episodes.CurriculumSampler); False = drawn regardless of
    benchmark."""
    worker_seed_per_step: bool = False
    """A fresh worker seed each step (the testbed's simulated workers); False = the run seed always (greedy real
    workers)."""
    deterministic_workers: bool = False
    """Score rollouts and their edits on llama-server workers in deterministic mode (ServerConfig.deterministic: one
    request in flight per server, prompt cache off), so a spec's reward and its CF delta do not depend on what else is
    in flight (11 of 20 identical greedy requests flipped at 8 in flight, 0 of 20 in this mode:
    outputs/reference/flip-rate-20261205). On by default in the llama-server presets (smoke, cpu); costs batching
    throughput (1.8x slower in that bench on 2 busy cores). Only for llama-server workers: build_pool refuses it for any
    other backend rather than skip it."""
    rollout_concurrency: int = 8
    """Spec executions in flight at once (workers bound it further by their own slots)."""
    sample_dtype: str = "auto"
    """How rollouts are sampled (lemon.policy.dtype): 'auto' (a bf16 copy on a native-bf16 CPU), 'model', 'bf16_copy',
    'autocast_bf16'."""
    train_dtype: str = "auto"
    """Loss forward/backward: 'auto' (bf16 autocast where the CPU supports it, fp32 otherwise; CUDA: bf16), 'fp32',
    'bf16'."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (the paper profile: a 7B policy at batch 16 x ~1.7k tokens needs
    it)."""
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
            raise ValueError(f"batch_size={self.batch_size} is not a multiple of "
                             f"num_generations={self.num_generations}: every prompt's group must fit in one batch")
        mb = self.micro_batch or self.batch_size
        if self.batch_size % mb:
            raise ValueError(f"micro_batch={self.micro_batch} must divide batch_size={self.batch_size} (gradient "
                             "accumulation)")
        if self.cf_lambda < 0:
            raise ValueError("cf_lambda must be >= 0 (the sign of the contrast is carried by delta)")
        bad = set(self.cf_families) - set(FAMILIES)
        if bad or not self.cf_families:
            raise ValueError(f"cf_families {self.cf_families} must be a non-empty subset of {', '.join(FAMILIES)}")
        if not 1 <= self.max_agents <= MAX_AGENTS:
            raise ValueError(f"max_agents must be in 1..{MAX_AGENTS}")
        if self.train_questions < self.batch_size // self.num_generations:
            raise ValueError(f"train_questions={self.train_questions} < "
                             f"{self.batch_size // self.num_generations} questions per step (batch_size / "
                             "num_generations)")
        if self.max_steps < 1 or self.save_steps < 1 or self.resample < 0 or self.rollout_concurrency < 1:
            raise ValueError("max_steps, save_steps and rollout_concurrency must be >= 1 and resample >= 0")
        if self.cf_baseline not in ("none", "family"):
            raise ValueError(f"cf_baseline={self.cf_baseline!r} must be 'none' (the paper) or 'family' "
                             "(lemon.train.cf)")
        if self.scale_rewards not in ("batch", "group", "none") or self.std_floor <= 0:
            raise ValueError(f"scale_rewards={self.scale_rewards!r} must be batch|group|none and std_floor > 0")
        if self.sample_dtype not in (*SAMPLING_DTYPES, "auto") or self.train_dtype not in TRAIN_DTYPES:
            raise ValueError(f"sample_dtype must be auto or one of {SAMPLING_DTYPES} and train_dtype one of "
                             f"{TRAIN_DTYPES}")
        if self.reward.max_agents != self.max_agents:
            raise ValueError(f"reward.max_agents={self.reward.max_agents} != max_agents={self.max_agents}: graph "
                             "cost must be normalised by the largest spec training allows (use train_preset, "
                             "or set both)")
        # its own bounds check (ValueError)
        SpecGrammar(("solver",), role_chars=self.role_chars, duty_chars=self.duty_chars)
        need = size_budgets(self.max_agents, self.worker_max_tokens)["completion"]
        if self.constrained and self.max_completion_length < need:
            raise ValueError(f"max_completion_length={self.max_completion_length} cannot hold a "
                             f"{self.max_agents}-agent spec (~{need} tokens, lemon.train.config.size_budgets)")

    def grammar(self, prompts, domain: str) -> SpecGrammar:
        """The spec grammar rollouts of this config are sampled under for a task of `domain` (training and held-out
        eval)."""
        return SpecGrammar.for_domain(prompts, domain, max_agents=self.max_agents, role_chars=self.role_chars,
                                      duty_chars=self.duty_chars)

    def to_dict(self) -> dict:
        return asdict(self)


def _preset(profile: str) -> dict:
    presets = read_presets(PROFILES_FILE)  # looked up at call time (a test may point it at another file)
    if profile not in presets:
        raise ProfileError(f"unknown profile {profile!r}; valid: {', '.join(presets)} ({PROFILES_FILE} presets)")
    return presets[profile]


def train_preset(profile: str, **overrides) -> TrainConfig:
    """The named preset (configs/profiles.yaml `presets`), with field overrides (e.g. cf_lambda=0.0 for the
    global-RL-only ablation). Its completion length, task budget and efficiency budget follow from its max_agents and
    worker_max_tokens (size_budgets); override those two in the file, not afterwards."""
    p = _preset(profile)
    values = dict(p["train"])
    if p.get("workers_file"):  # the workers and their reply caps are that file's (configs/workers-paper.yaml)
        path = ROOT / p["workers_file"]
        values["workers"], values["worker_max_tokens"] = workers_from_file(path)
        if set(values["worker_max_tokens"]) != set(values["workers"]):
            raise ValueError(f"{path}: max_tokens must name every capacity ({sorted(values['workers'])}), got "
                             f"{sorted(values['worker_max_tokens'])}")
    n, caps = values.pop("max_agents"), values.pop("worker_max_tokens")
    b = size_budgets(n, caps)
    sized = TrainConfig(profile=profile, max_agents=n, worker_max_tokens=caps, max_completion_length=b["completion"],
                        task_token_budget=b["task"], reward=RewardConfig(max_agents=n, token_budget=b["efficiency"]))
    return replace(apply_overrides(sized, values, f"preset {profile!r}: train"), **overrides)


def sft_preset(profile: str, **overrides) -> SFTConfig:
    """The named warm-start preset (configs/profiles.yaml `presets`), with field overrides."""
    cfg = apply_overrides(SFTConfig(), _preset(profile).get("sft") or {}, f"preset {profile!r}: sft")
    return replace(cfg, **overrides)
