"""Scoring rollouts for CF-GRPO: parse each sampled spec, execute it, reward it, and (lambda > 0) execute one
counterfactual edit of it (paper §3.3) — concurrently, deterministically, and without letting one bad rollout kill a
training step.

What can go wrong with one rollout, and what happens (each is counted in the step's metrics by lemon.train.grpo):
| event                                         | rollout                     | counterfactual                      |
|-----------------------------------------------|-----------------------------|-------------------------------------|
| the text does not parse                       | invalid, r_invalid          | none (`cf_status` "invalid")        |
| a worker / backend error during execution     | errored: no reward, left    | none ("errored")                    |
|                                               | out of its group and loss   |                                     |
| no eligible edit site in any allowed family   | scored                      | none ("no_site")                    |
| the edit cannot be applied (EditError)        | scored                      | none ("edit_error")                 |
| the edited spec's execution errors            | scored                      | none ("cf_errored"): never a delta  |
|                                               |                             | against an errored execution        |
| the edited span maps onto no sampled token    | scored                      | none ("span_dropped:<reason>")      |
| otherwise                                     | scored                      | delta = r(y) - r(y'), "ok"          |
A dead backend (BackendUnavailableError) is not a rollout's fault: it propagates and stops the step (resume from
checkpoint).

Determinism under concurrency: the edit of rollout i is chosen with its own RNG seeded by (run seed, step, i), and the
adaptive family sampler is read once per batch and updated in rollout order after it, so thread timing changes nothing.
"""
from __future__ import annotations

import hashlib
import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from lemon.run.executor import ExecutorCaps, NodeCache, execute
from lemon.spec import SpecError, parse_spec
from lemon.train.edits import FAMILIES, EditError, FamilySampler, sample_edit
from lemon.train.rewards import RewardBreakdown, RewardConfig, compute_reward
from lemon.train.spanmap import span_positions


@dataclass
class Rollout:
    """What became of one sampled completion."""

    example_id: str
    text: str
    ids: tuple[int, ...]
    group: int  # index of its group (question) in the batch
    valid: bool
    error: str | None  # SpecError code when invalid; the executor's error text when errored
    reward: RewardBreakdown
    agents: int = 0
    edges: int = 0
    tokens_spent: int = 0  # worker tokens really spent (cache hits cost 0)
    attempt: int = 0  # which dynamic-sampling attempt produced it (0 = the first)
    family: str | None = None
    delta: float | None = None  # r(y) - r(y'), None when there is no counterfactual
    cf_status: str = "off"
    cf_tokens_spent: int = 0
    cf_tokens_nominal: int = 0
    span_positions: tuple[int, ...] = ()
    forced_positions: tuple[int, ...] = ()  # completion positions where the grammar allowed exactly one token

    @property
    def errored(self) -> bool:
        return self.reward.errored

    @property
    def total(self) -> float | None:
        return self.reward.total

    def to_row(self, step: int) -> dict:
        """The rollouts.jsonl record (one per sampled completion)."""
        return {"step": step, "example_id": self.example_id, "group": self.group, "attempt": self.attempt,
                "text": self.text, "valid": self.valid, "error": self.error, "errored": self.errored,
                "reward": self.total, "success": self.reward.success, "token_efficiency": self.reward.token_efficiency,
                "graph_cost": self.reward.graph_cost, "worker_tokens": self.reward.worker_tokens, "agents": self.agents,
                "edges": self.edges, "family": self.family, "delta": self.delta, "cf_status": self.cf_status,
                "span_tokens": len(self.span_positions)}


def edit_seed(seed: int, step: int, index: int) -> int:
    return int.from_bytes(hashlib.sha256(f"cf/{seed}/{step}/{index}".encode()).digest()[:8], "big")


class SpecScorer:
    """Parses, executes and rewards rollouts and their counterfactual edits. Pool, prompts, cache and sampler are passed
    in; `concurrency` executions run at once (the executor bounds each backend by its own max_concurrency)."""

    def __init__(self, pool, prompts, examples: dict, benchmarks: dict, *, reward: RewardConfig, caps: ExecutorCaps,
                 cache: NodeCache, sampler: FamilySampler, cf_lambda: float, families=FAMILIES, max_agents: int = 8,
                 seed: int = 0, concurrency: int = 8, worker_seed_per_step: bool = False):
        self.pool, self.prompts, self.examples, self.benchmarks = pool, prompts, examples, benchmarks
        self.reward_cfg, self.caps, self.cache, self.sampler = reward, caps, cache, sampler
        self.cf_lambda, self.families, self.max_agents, self.seed = cf_lambda, tuple(families), max_agents, seed
        self.concurrency = max(1, int(concurrency))
        # False: every execution runs with the run seed (the node cache then reuses work across steps). Greedy
        # llama-server workers are NOT deterministic under batching (11 of 20 repeats flipped at 8 in flight,
        # bench/flip_rate.py): the pool must come from TrainConfig.deterministic_workers for a reward not to depend on
        # what else is in flight. True: a fresh worker seed per step, so a simulated (or sampling) worker cannot hand a
        # spec the same lucky draw at every step; a counterfactual always uses its own step's seed.
        self.worker_seed_per_step = worker_seed_per_step

    def exec_seed(self, step: int) -> int:
        return int(edit_seed(self.seed, step, -1) & 0x7FFFFFFF) if self.worker_seed_per_step else self.seed

    def _map(self, fn, items):
        if self.concurrency == 1 or len(items) <= 1:
            return [fn(x) for x in items]
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(items)),
                                thread_name_prefix="lemon-rollout") as tp:
            return list(tp.map(fn, items))  # map keeps the input order; an exception propagates

    def _execute(self, spec, ex, step: int):
        bench = self.benchmarks[ex.benchmark]
        tr = execute(spec, ex, bench, self.pool, prompts=self.prompts, cache=self.cache, caps=self.caps,
                     seed=self.exec_seed(step))
        r = compute_reward(spec, tr.score, tr.nominal_tokens, self.reward_cfg, errored=tr.error is not None)
        return tr, r

    def score_one(self, item, step: int = 0) -> Rollout:
        """item = (example_id, text, ids, group, attempt), scored with the worker seed of `step`."""
        eid, text, ids, group, attempt = item
        ex = self.examples[eid]
        try:
            spec = parse_spec(text, base_roles=self.prompts.roles_for(self.benchmarks[ex.benchmark].domain),
                              max_agents=self.max_agents)
        except SpecError as e:
            return Rollout(eid, text, tuple(ids), group, False, e.code, compute_reward(None, 0.0, 0, self.reward_cfg),
                           attempt=attempt, cf_status="invalid")
        tr, r = self._execute(spec, ex, step)
        return Rollout(eid, text, tuple(ids), group, True, tr.error, r, len(spec.agents), len(spec.edges()), tr.tokens,
                       attempt, cf_status="errored" if r.errored else "off")

    def score(self, items, step: int = 0) -> list[Rollout]:
        return self._map(lambda it: self.score_one(it, step), list(items))

    def add_counterfactuals(self, rollouts: list[Rollout], step: int, decode) -> None:
        """One edit per valid, non-errored rollout (lambda > 0 only), executed through the node cache; fills family,
        delta, cf_status and span_positions in place, then updates the family sampler in rollout order."""
        if self.cf_lambda == 0:
            return
        probs = self.sampler.probs()  # frozen for the whole batch: thread timing cannot change a choice
        todo = [(i, r) for i, r in enumerate(rollouts) if r.valid and not r.errored]
        self._map(lambda ir: self._cf_one(ir[1], probs, random.Random(edit_seed(self.seed, step, ir[0])), decode, step),
                  todo)
        for _, r in todo:
            if r.cf_status == "ok":
                self.sampler.update(r.family, r.delta)

    def _cf_one(self, r: Rollout, probs: dict, rng: random.Random, decode, step: int) -> None:
        ex = self.examples[r.example_id]
        spec = parse_spec(r.text, base_roles=self.prompts.roles_for(self.benchmarks[ex.benchmark].domain),
                          max_agents=self.max_agents)
        try:
            edit = sample_edit(spec, self.prompts, rng, probs, families=self.families)
        except EditError:
            r.cf_status = "edit_error"
            return
        if edit is None:
            r.cf_status = "no_site"
            return
        tr2, r2 = self._execute(edit.spec, ex, step)
        r.family, r.cf_tokens_spent, r.cf_tokens_nominal = edit.family, tr2.tokens, tr2.nominal_tokens
        if r2.errored:
            r.cf_status = "cf_errored"
            return
        m = span_positions(list(r.ids), decode, r.text, edit.span)
        if m.dropped:
            r.cf_status = f"span_dropped:{m.dropped}"
            return
        r.delta, r.span_positions, r.cf_status = r.total - r2.total, tuple(m.positions), "ok"
