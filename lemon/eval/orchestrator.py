"""The orchestrator's prompt and the *prompted* (untrained) orchestrator: a chat model writes one spec per task.

The trained policy (lemon.train.grpo) sees exactly the same messages, so "prompted vs trained" differs only in weights.
"""
from __future__ import annotations

from dataclasses import dataclass

from lemon.policy.rollout import GrammarConstraint, sample_specs
from lemon.prompts import Prompts
from lemon.spec import MAX_AGENTS, Spec, SpecError, json_schema, parse_spec
from lemon.spec.grammar import GrammarCache, SpecGrammar


@dataclass(frozen=True)
class OrchestratorConfig:
    """How the prompted orchestrator writes specs."""

    capacity: str = "large"
    """Which worker of the pool writes the spec (its tokens are metered like any worker's)."""
    max_tokens: int = 512
    """Cap on the spec's length in tokens (a spec is ~150-250 tokens)."""
    temperature: float = 0.0
    """0 = greedy; GRPO sampling uses its own temperature."""
    constrained: bool = True
    """Constrain decoding to the spec's JSON schema where the backend supports it (llama.cpp does)."""
    max_agents: int = MAX_AGENTS
    """Upper bound on agents, told to the model and enforced by the parser."""

    def __post_init__(self):
        if self.max_tokens < 64:
            raise ValueError(f"max_tokens={self.max_tokens} cannot hold even a one-agent spec; use >= 64")
        if not 1 <= self.max_agents <= 16:
            raise ValueError(f"max_agents={self.max_agents} must be in 1..16")


def orchestrator_messages(task: str, domain: str, prompts: Prompts, max_agents: int = MAX_AGENTS) -> list[dict]:
    """Chat messages asking for a spec: the task, its domain, the base-role library, the capacity menu, the format."""
    roles = prompts.roles_for(domain)
    role_lines = "\n".join(f"- {name}: {duty}" for name, duty in roles.items())
    cap_lines = "\n".join(f"- {name}: cost {c['cost']} ({c['note']})" for name, c in prompts.capacities.items())
    user = prompts.orchestrator["user"].format(domain=domain, task=task, base_roles=role_lines, capacities=cap_lines,
                                              max_agents=max_agents)
    return [{"role": "system", "content": prompts.orchestrator["system"]}, {"role": "user", "content": user}]


@dataclass(frozen=True)
class SpecProposal:
    """What the orchestrator wrote and whether it parsed."""

    text: str
    spec: Spec | None
    error: str | None
    error_code: str | None
    prompt_tokens: int
    completion_tokens: int


def propose_spec(pool, task: str, domain: str, prompts: Prompts, cfg: OrchestratorConfig = OrchestratorConfig(),
                 seed: int = 0) -> SpecProposal:
    """Ask the pool's `cfg.capacity` model for a spec. An invalid spec is returned (spec=None, error named), never
    raised: the evaluator scores it 0 and keeps going, the trainer gives it r_invalid."""
    roles = prompts.roles_for(domain)
    extra = {"json_schema": json_schema(roles, cfg.max_agents)} if cfg.constrained else {}
    c = pool.chat(cfg.capacity, orchestrator_messages(task, domain, prompts, cfg.max_agents),
                  max_tokens=cfg.max_tokens, temperature=cfg.temperature, seed=seed, **extra)
    try:
        spec = parse_spec(c.text, base_roles=roles, max_agents=cfg.max_agents)
        return SpecProposal(c.text, spec, None, None, c.prompt_tokens, c.completion_tokens)
    except SpecError as e:
        return SpecProposal(c.text, None, str(e), e.code, c.prompt_tokens, c.completion_tokens)


class PoolSpecWriter:
    """The prompted (untrained) orchestrator: a worker of the pool writes the spec."""

    def __init__(self, pool, cfg: OrchestratorConfig = OrchestratorConfig()):
        self.pool, self.cfg = pool, cfg
        self.name = f"prompted:{pool.model_of(cfg.capacity)}"

    def propose(self, task: str, domain: str, prompts: Prompts, seed: int = 0) -> SpecProposal:
        return propose_spec(self.pool, task, domain, prompts, self.cfg, seed=seed)


class PolicySpecWriter:
    """The trained orchestrator: a transformers policy (e.g. base model + LoRA adapter from lemon.train) writes the spec
    greedily, under the same spec grammar it was trained with (`constrained`; lemon.policy.rollout.sample_specs), so an
    evaluated spec is what the policy would write in training. Its prompt and completion tokens are counted like any
    model's. `dtype` as in lemon.policy.rollout.sample_specs: 'model' (the loaded weights, fp32 on CPU: greedy
    evaluation is exact) or 'autocast_bf16'."""

    def __init__(self, model, tokenizer, cfg: OrchestratorConfig = OrchestratorConfig(), name: str = "policy", *,
                 constrained: bool = True, dtype: str = "model"):
        self.model, self.tok, self.cfg, self.name = model, tokenizer, cfg, name
        self.constrained, self.dtype = constrained, dtype
        self._grammar_cache = None

    def propose(self, task: str, domain: str, prompts: Prompts, seed: int = 0) -> SpecProposal:
        msgs = orchestrator_messages(task, domain, prompts, self.cfg.max_agents)
        constraint = None
        if self.constrained:
            self._grammar_cache = self._grammar_cache or GrammarCache()  # compile once per writer
            constraint = GrammarConstraint(SpecGrammar.for_domain(prompts, domain, max_agents=self.cfg.max_agents),
                                           self._grammar_cache)
        (s,) = sample_specs(self.model, self.tok, [msgs], n=1, temperature=self.cfg.temperature,
                            max_new_tokens=self.cfg.max_tokens, seed=seed, constraint=constraint, dtype=self.dtype)
        n_prompt = len(self.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                                    return_dict=True)["input_ids"])
        try:
            spec = parse_spec(s.text, base_roles=prompts.roles_for(domain), max_agents=self.cfg.max_agents)
            return SpecProposal(s.text, spec, None, None, n_prompt, s.n_tokens)
        except SpecError as e:
            return SpecProposal(s.text, None, str(e), e.code, n_prompt, s.n_tokens)
