"""The reward of one executed spec (paper §3.2: task success + token-efficiency reward - graph-structure cost; an
invalid spec gets an invalid-rollout penalty), in two forms.

    eff = max(0, 1 - worker_tokens / token_budget)    worker_tokens = the spec's NOMINAL tokens (no cache discount)
    g   = graph_cost(spec) in [0, 1]                   agents, edges and unreachable agents, normalised by max_agents

| case                                         | form="gated" (default)            | form="paper"                  |
|----------------------------------------------|-----------------------------------|-------------------------------|
| the spec does not parse (SpecError)          | r_invalid                         | r_invalid                     |
| the execution errored (worker / server)      | None: not rewarded at all         | None                          |
| valid, wrong answer (s = 0; over budget too) | 0                                 | w_t * eff - w_g * g           |
| valid, right answer (s = 1)                  | w_s + w_t * eff - w_g * g         | w_s + w_t * eff - w_g * g     |
| valid, partial score s in (0, 1)             | s * (w_s + w_t * eff - w_g * g)   | w_s * s + w_t * eff - w_g * g |

Why "gated": with small workers most rollouts fail, and in the paper form a cheap failing spec out-scores an expensive
failing one, so a group with no success pulls the policy toward the cheapest (usually the most hopeless) spec. Gating
the cost terms by success keeps them as what they are meant to be, a tie-break among specs that work; a group with no
success then has zero spread and gives no global gradient (lemon.train.grpo resamples or skips it). Both forms keep the
required order: a failing rollout never out-scores a succeeding one (checked in __post_init__: w_s - w_g > w_t covers
the paper form's worst case, a free failing spec vs the most expensive success) and an invalid spec scores below every
valid one.

An errored execution (RewardBreakdown.errored) is a fact about the worker, not the spec: the trainer leaves it out of
its group's statistics and the loss and never computes a counterfactual delta against it (lemon.train.grpo).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from lemon.spec import MAX_AGENTS, Spec

FORMS = ("gated", "paper")


@dataclass(frozen=True)
class RewardConfig:
    """Weights and shapes of the reward terms."""

    form: str = "gated"
    """'gated': token efficiency and graph cost count only for successful rollouts; 'paper': every valid rollout."""
    w_success: float = 1.0
    """Weight of task success (exact match / option letter / all tests pass)."""
    w_tokens: float = 0.2
    """Weight of token efficiency."""
    w_graph: float = 0.1
    """Weight of the graph-structure cost."""
    token_budget: int = 3000
    """Nominal worker tokens at which token efficiency reaches 0 (size it from the preset:
    lemon.train.config.size_budgets)."""
    r_invalid: float = -1.0
    """Reward of a spec that fails schema checks (below every valid spec)."""
    agent_cost: float = 1.0
    """Graph cost per agent."""
    edge_cost: float = 0.5
    """Graph cost per dependency edge."""
    unreachable_cost: float = 1.0
    """Extra graph cost per agent that cannot reach final (pure waste)."""
    max_agents: int = MAX_AGENTS
    """Normalises graph cost: a complete DAG of this many agents, all unreachable but one, costs 1. Set it to the
    training max_agents, or every allowed spec looks cheap."""

    def __post_init__(self):
        if self.form not in FORMS:
            raise ValueError(f"form={self.form!r}; valid: {', '.join(FORMS)}")
        if self.token_budget <= 0:
            raise ValueError(f"token_budget={self.token_budget} must be > 0")
        if min(self.w_success, self.w_tokens, self.w_graph, self.agent_cost, self.edge_cost, self.unreachable_cost) < 0:
            raise ValueError("reward weights and costs must be >= 0 (the sign of each term is fixed by the formula)")
        if not 1 <= self.max_agents <= MAX_AGENTS:
            raise ValueError(f"max_agents={self.max_agents} must be in 1..{MAX_AGENTS}")
        if self.w_success - self.w_graph <= self.w_tokens:
            raise ValueError(f"w_success - w_graph = {self.w_success - self.w_graph:g} must exceed w_tokens = "
                             f"{self.w_tokens:g}: otherwise a free failing spec could out-score the most "
                             "expensive success")
        lowest_valid = 0.0 if self.form == "gated" else -self.w_graph
        if self.r_invalid >= lowest_valid:
            raise ValueError(f"r_invalid={self.r_invalid} must be < {lowest_valid} (the worst valid {self.form} "
                             "reward): an invalid spec may never score as well as a valid one")


@dataclass(frozen=True)
class RewardBreakdown:
    """Every term of one reward, for logging; `total` is None when the execution errored (not rewarded)."""

    total: float | None
    success: float
    token_efficiency: float
    graph_cost: float
    valid: bool
    worker_tokens: int
    errored: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


def graph_cost(spec: Spec, cfg: RewardConfig) -> float:
    n, e, u = len(spec.agents), len(spec.edges()), len(spec.unreachable())
    m = cfg.max_agents
    worst = cfg.agent_cost * m + cfg.edge_cost * m * (m - 1) / 2 + cfg.unreachable_cost * (m - 1)
    return min(1.0, (cfg.agent_cost * n + cfg.edge_cost * e + cfg.unreachable_cost * u) / worst) if worst > 0 else 0.0


def compute_reward(spec: Spec | None, score: float, worker_tokens: int, cfg: RewardConfig, *,
                   errored: bool = False) -> RewardBreakdown:
    """Reward of one executed spec (`spec` None = it did not parse; `score` in [0, 1] from the benchmark scorer;
    `worker_tokens` = trace.nominal_tokens; `errored` = the execution hit a worker/backend error: total None)."""
    if spec is None:
        return RewardBreakdown(cfg.r_invalid, 0.0, 0.0, 0.0, False, 0)
    if not 0.0 <= score <= 1.0:
        raise ValueError(f"score={score} must be in [0, 1]")
    eff = max(0.0, 1.0 - worker_tokens / cfg.token_budget)
    g = graph_cost(spec, cfg)
    if errored:
        return RewardBreakdown(None, 0.0, eff, g, True, int(worker_tokens), errored=True)
    if cfg.form == "gated":
        total = score * (cfg.w_success + cfg.w_tokens * eff - cfg.w_graph * g)
    else:
        total = cfg.w_success * score + cfg.w_tokens * eff - cfg.w_graph * g
    return RewardBreakdown(total, float(score), eff, g, True, int(worker_tokens))
