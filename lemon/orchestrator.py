"""The orchestrator's prompt and the *prompted* (untrained) orchestrator: a chat model writes one spec per task.

The trained policy (lemon.grpo) sees exactly the same messages, so "prompted vs trained" differs only in weights.
"""
from __future__ import annotations

from dataclasses import dataclass

from .prompts import Prompts
from .spec import MAX_AGENTS, Spec, SpecError, json_schema, parse_spec


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
    """Ask the pool's `cfg.capacity` model for a spec. An invalid spec is returned (spec=None, error named), never raised:
    the evaluator scores it 0 and keeps going, the trainer gives it r_invalid."""
    roles = prompts.roles_for(domain)
    extra = {"json_schema": json_schema(roles, cfg.max_agents)} if cfg.constrained else {}
    c = pool.chat(cfg.capacity, orchestrator_messages(task, domain, prompts, cfg.max_agents),
                  max_tokens=cfg.max_tokens, temperature=cfg.temperature, seed=seed, **extra)
    try:
        spec = parse_spec(c.text, base_roles=roles, max_agents=cfg.max_agents)
        return SpecProposal(c.text, spec, None, None, c.prompt_tokens, c.completion_tokens)
    except SpecError as e:
        return SpecProposal(c.text, None, str(e), e.code, c.prompt_tokens, c.completion_tokens)
