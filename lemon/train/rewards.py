"""The reward (paper §3.2): r = w_s * success + w_t * token_efficiency - w_g * graph_cost; an invalid spec gets r_invalid.

token_efficiency = max(0, 1 - worker_tokens / token_budget) uses the spec's NOMINAL worker tokens (what it costs without the
node cache), so a counterfactual re-execution that hits the cache is not rewarded for the cache's savings.
graph_cost = (c_a * agents + c_e * edges + c_u * unreachable agents) / (the same for the largest allowed spec), in [0, 1].
Every term is returned separately so each can be logged.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from lemon.spec import MAX_AGENTS, Spec


@dataclass(frozen=True)
class RewardConfig:
    """Weights and shapes of the reward terms."""

    w_success: float = 1.0
    """Weight of task success (exact match / all tests pass)."""
    w_tokens: float = 0.2
    """Weight of token efficiency."""
    w_graph: float = 0.1
    """Weight of the graph-structure cost."""
    token_budget: int = 3000
    """Worker tokens at which token efficiency reaches 0."""
    r_invalid: float = -1.0
    """Reward of a spec that fails schema checks (below any valid spec's minimum, -w_graph)."""
    agent_cost: float = 1.0
    """Graph cost per agent."""
    edge_cost: float = 0.5
    """Graph cost per dependency edge."""
    unreachable_cost: float = 1.0
    """Extra graph cost per agent that cannot reach final (pure waste)."""
    max_agents: int = MAX_AGENTS
    """Normalises graph cost: a complete DAG of this many agents, all unreachable but one, costs 1."""

    def __post_init__(self):
        if self.token_budget <= 0:
            raise ValueError(f"token_budget={self.token_budget} must be > 0")
        if min(self.w_success, self.w_tokens, self.w_graph, self.agent_cost, self.edge_cost, self.unreachable_cost) < 0:
            raise ValueError("reward weights and costs must be >= 0 (the sign of each term is fixed by the formula)")
        if self.r_invalid > -self.w_graph:
            raise ValueError(f"r_invalid={self.r_invalid} must be <= -w_graph={-self.w_graph}: an invalid spec may never "
                             "score above the worst valid one")


@dataclass(frozen=True)
class RewardBreakdown:
    total: float
    success: float
    token_efficiency: float
    graph_cost: float
    valid: bool
    worker_tokens: int

    def to_dict(self) -> dict:
        return asdict(self)


def graph_cost(spec: Spec, cfg: RewardConfig) -> float:
    n, e, u = len(spec.agents), len(spec.edges()), len(spec.unreachable())
    worst = cfg.agent_cost * cfg.max_agents + cfg.edge_cost * cfg.max_agents * (cfg.max_agents - 1) / 2 \
        + cfg.unreachable_cost * (cfg.max_agents - 1)
    return min(1.0, (cfg.agent_cost * n + cfg.edge_cost * e + cfg.unreachable_cost * u) / worst) if worst > 0 else 0.0


def compute_reward(spec: Spec | None, score: float, worker_tokens: int, cfg: RewardConfig) -> RewardBreakdown:
    """Reward of one executed spec (`score` in [0, 1] from the benchmark scorer, `worker_tokens` = trace.nominal_tokens)."""
    if spec is None:
        return RewardBreakdown(cfg.r_invalid, 0.0, 0.0, 0.0, False, 0)
    eff = max(0.0, 1.0 - worker_tokens / cfg.token_budget)
    g = graph_cost(spec, cfg)
    total = cfg.w_success * score + cfg.w_tokens * eff - cfg.w_graph * g
    return RewardBreakdown(total, float(score), eff, g, True, int(worker_tokens))
