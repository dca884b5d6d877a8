"""A simulated world: real benchmark examples (train pools), the SIMULATED worker pool of lemon.testbed.sim, and the
exact expected reward, optimum and regret of any spec on it.

`expected_reward` mirrors what the executor does with a spec (lemon.run.executor): only agents that reach `final` run,
the token budget is checked at level boundaries on nominal tokens (past it: score 0), and the reward is the project's
own `lemon.train.rewards.compute_reward` applied to each final state, weighted by its exact probability. The Monte-Carlo
test in tests/test_testbed.py runs specs through the real executor with `world.pool()` and checks the mean against this.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from lemon import benchmarks as B
from lemon.prompts import CAPACITIES, Prompts
from lemon.run.executor import ExecutorCaps
from lemon.run.workers import SamplingParams, WorkerPool
from lemon.spec import Spec, SpecError, parse_spec
from lemon.testbed.search import check_reward_properties, search, spec_of, structures
from lemon.testbed.sim import (KIND_OF, MessageReader, Node, SimBackend, SimConfig, SimConfigError, SimUnknownTaskError,
                               TaskType, call_tokens, duty_effect, final_distribution, final_text)
from lemon.train.rewards import RewardConfig, compute_reward

# What a duty must name to pay (lemon.testbed.sim.duty_effect): the testbed's worlds use letter pairs, not real words,
# so that the random tiny policies meet them at step 0 (LOG.md, 2026-12-07; grammar-sampled duties of 16 characters:
# 're' in 19% / 15%, 'in' in 28% / 16% of 148 / 309 duties of the SmolLM2-vocabulary / testbed-BPE random policies;
# 'solve', 'add', 'total', 'check', 'verify' in 0-1%): a policy then has something to find, and m_R's delta has both
# signs. A language-model policy would be given real words ('solve', 'check').
_WORDS = {"solve": ("re",), "check": ("in",)}
_SOLVE_WORDS = {"solve": ("re",)}

# Two task types whose optima differ (default reward): MultiArith is 'easy' (a small solver with a customized duty is
# right every time), GSM8K is 'hard' (a large customized solver, a note, and a large checker all pay).
TWO_TYPES = SimConfig(types={"easy": TaskType({"small": 0.85, "medium": 0.9, "large": 0.95}),
                             "hard": TaskType({"small": 0.05, "medium": 0.25, "large": 0.55}, plan_bonus=0.1)},
                      benchmark_type={"multiarith": "easy", "gsm8k": "hard"}, duty_words=_WORDS, off_duty_penalty=0.1)
# One type for the test suite: the optimum (a large customized solver read by a large customized checker, success ~0.9)
# is far from a typical warm-start spec (random capacities, chains ending in a decider: ~0.2-0.5).
TINY = SimConfig(types={"hard": TaskType({"small": 0.05, "medium": 0.2, "large": 0.5})},
                 benchmark_type={"gsm8k": "hard"}, q_fix={"small": 0.0, "medium": 0.2, "large": 0.6},
                 solve_duty_bonus=0.2, check_duty_bonus=0.1, duty_words=_WORDS, off_duty_penalty=0.1)


# Worlds where a DIFFERENT spec field carries the reward (the question: does localized credit beat global credit when
# several fields pay?). Replies cost the same at every capacity where capacity must not matter, so a capacity edit's
# contrast is 0.
_EQ_TOKENS = {"small": 160, "medium": 160, "large": 160}
# role / duty: capacity is irrelevant and checkers never fix anything; a solver is right 0.25 of the time with its
# default duty, 0.85 with a duty naming 're' and 0.05 with any other duty; any other role answers nothing. The role and
# duty edits pay (both ways), capacity and edges do not.
DUTY = SimConfig(types={"hard": TaskType({"small": 0.25, "medium": 0.25, "large": 0.25})},
                 benchmark_type={"gsm8k": "hard"}, q_fix={"small": 0.0, "medium": 0.0, "large": 0.0},
                 solve_duty_bonus=0.6, check_duty_bonus=0.0, completion_tokens=_EQ_TOKENS, duty_words=_SOLVE_WORDS,
                 off_duty_penalty=0.2)
# dependency: a solver alone is right 0.3 of the time at any capacity; a verifier READING it fixes a wrong answer with
# 0.9 (0.93 together); a verifier reading nothing answers nothing. Dropping the solver -> verifier edge is what pays.
EDGE = SimConfig(types={"hard": TaskType({"small": 0.3, "medium": 0.3, "large": 0.3})},
                 benchmark_type={"gsm8k": "hard"}, q_fix={"small": 0.9, "medium": 0.9, "large": 0.9},
                 solve_duty_bonus=0.0, check_duty_bonus=0.0, completion_tokens=_EQ_TOKENS)
# mixed: two task types whose best workers differ (MultiArith: the small worker is the specialist, 0.9 vs 0.1 for the
# large; GSM8K: the reverse), so no single spec is right on both and only a policy that reads the question reaches the
# optimum; checkers fix little (0.3) and customized duties add 0.05. The best fixed spec's regret is in
# tests/test_testbed_worlds.py.
MIXED = SimConfig(types={"specialist": TaskType({"small": 0.9, "medium": 0.4, "large": 0.1}),
                         "general": TaskType({"small": 0.1, "medium": 0.4, "large": 0.9})},
                  benchmark_type={"multiarith": "specialist", "gsm8k": "general"},
                  q_fix={"small": 0.3, "medium": 0.3, "large": 0.3}, solve_duty_bonus=0.05, check_duty_bonus=0.0,
                  duty_words=_SOLVE_WORDS, off_duty_penalty=0.05)


# multi: one type where SEVERAL live fields each carry a modest, signed effect on reward, through success and token cost
# (where localized credit should pay most: a whole-spec advantage mixes them all). The solver's capacity (0.2 / 0.45 /
# 0.6, a larger worker also costs more tokens), a note it reads (+0.1), a checker reading it (fixes 0.1 / 0.3 / 0.45 of
# wrong answers) and both duties (+0.15 / +0.1 when they name 're' / 'in', -0.1 when they name neither).
MULTI = SimConfig(types={"hard": TaskType({"small": 0.2, "medium": 0.45, "large": 0.6}, plan_bonus=0.1)},
                  benchmark_type={"gsm8k": "hard"}, q_fix={"small": 0.1, "medium": 0.3, "large": 0.45},
                  solve_duty_bonus=0.15, check_duty_bonus=0.1, duty_words=_WORDS, off_duty_penalty=0.1)


@dataclass(frozen=True)
class Evaluation:
    """Exact outcome of one spec on one example in the sim."""

    expected_reward: float
    p_success: float
    tokens: int  # nominal worker tokens (deterministic: they do not depend on outcomes)
    budget_exceeded: bool
    reward_by_state: dict  # final state -> reward


@dataclass(frozen=True)
class Optimum:
    spec: Spec  # parsed from canonical YAML (has text)
    expected_reward: float
    p_success: float
    tokens: int
    searched: int  # structures evaluated


@dataclass(frozen=True)
class TextScore:
    """A spec text scored against the world: valid, expected reward (r_invalid when invalid) and regret."""

    valid: bool
    expected_reward: float
    regret: float
    error: str | None = None
    spec: Spec | None = None  # the parsed spec when valid (callers describing it need not parse the text again)


class SimWorld:
    """Examples by task text, the simulated pool, and exact expected reward / optimum / regret. Prompts passed
    explicitly."""

    def __init__(self, config: SimConfig, prompts: Prompts, examples=None):
        self.config, self.prompts, self.reader = config, prompts, MessageReader(prompts)
        self._default_duty = prompts.roles_for(None)  # base role -> default duty (what `custom` is measured against)
        if examples is None:
            examples = [e for b in config.benchmark_type for e in B.pool(b, "train")]
        examples = list(examples)
        self._by_task: dict[str, B.Example] = {}
        self.ambiguous: list[str] = []  # task texts with two different gold answers (dropped: the sim could not answer)
        for e in examples:
            if e.benchmark not in config.benchmark_type:
                raise ValueError(f"example {e.id!r} is from {e.benchmark!r}, which has no task type in this SimConfig")
            old = self._by_task.get(e.question)
            if old is not None and B.parse_number(old.gold) != B.parse_number(e.gold):
                self.ambiguous.append(e.question)
            self._by_task.setdefault(e.question, e)
        for q in self.ambiguous:
            self._by_task.pop(q, None)
        # every id is kept (a repeated text with the same gold answers the same); examples() lists one per text
        self._by_id = {e.id: e for e in examples if e.question in self._by_task}
        if not self._by_task:
            raise ValueError("a SimWorld needs at least one example")
        self._optima: dict = {}
        self._scores: dict = {}

    # ---- what the sim knows ---------------------------------------------------------------------------------------
    def examples(self) -> list[B.Example]:
        """One example per distinct task text."""
        return list(self._by_task.values())

    def example(self, example_id: str) -> B.Example:
        if example_id not in self._by_id:
            raise SimUnknownTaskError(f"example id {example_id!r} is not in this SimWorld")
        return self._by_id[example_id]

    def type_of(self, example: B.Example) -> str:
        return self.config.benchmark_type[example.benchmark]

    def lookup(self, task: str) -> tuple[B.Example, TaskType]:
        e = self._by_task.get(task)
        if e is None:
            raise SimUnknownTaskError(f"task {task[:80]!r} is not one of this SimWorld's "
                                      f"{len(self._by_task)} examples; build the world with every example the trainer "
                                      "may draw (SimWorld(examples=...))")
        return e, self.config.types[self.type_of(e)]

    def worker_max_tokens(self) -> dict[str, int]:
        """Per-capacity reply caps the run must allow (the sim's replies have exactly these lengths)."""
        return dict(self.config.completion_tokens)

    def worst_tokens(self, max_agents: int) -> int:
        """Nominal tokens of the most expensive spec of max_agents agents: a complete DAG, every agent at the longest
        reply."""
        longest = max(self.config.completion_tokens.values())
        return sum(self.config.prompt_tokens + longest * (1 + k) for k in range(max_agents))

    def pool(self) -> WorkerPool:
        """The SIMULATED worker pool (backend 'sim', models sim-small / sim-medium / sim-large)."""
        return WorkerPool({c: SimBackend(c, self) for c in CAPACITIES},
                          {c: SamplingParams(max_tokens=self.config.completion_tokens[c]) for c in CAPACITIES})

    def describe(self) -> dict:
        return {"workers": "SIMULATED (lemon.testbed.sim)", "config": self.config.to_dict(),
                "examples": len(self._by_task),
                "by_type": {t: sum(self.type_of(e) == t for e in self._by_task.values()) for t in self.config.types}}

    # ---- exact evaluation -----------------------------------------------------------------------------------------
    def nodes_of(self, spec: Spec) -> list[Node]:
        """The agents that run (those reaching final; final last, spec order kept), as the sim sees them."""
        live = spec.ancestors(spec.final) | {spec.final}
        order = [a for a in spec.agents if a.id in live and a.id != spec.final] + [spec.agent(spec.final)]
        index = {a.id: i for i, a in enumerate(order)}
        kinds = [KIND_OF.get(a.base_role, "idle") for a in order]
        return [Node(k, a.capacity, duty_effect(k, a.duty, self._default_duty[a.base_role], self.config),
                     tuple(index[d] for d in a.depends_on)) for k, a in zip(kinds, order)]

    def _score(self, example: B.Example, text: str) -> float:
        """The REAL benchmark scorer on the sim's final reply (memoized: the search scores the same few texts often)."""
        key = (example.id, text)
        if key not in self._scores:
            self._scores[key] = float(B.get_benchmark(example.benchmark).score(example, text))
        return self._scores[key]

    def _reward(self, spec: Spec, score: float, tokens: int, cfg: RewardConfig) -> float:
        return compute_reward(spec, score, tokens, cfg).total  # the project's reward, whatever its formula is

    def evaluate_nodes(self, nodes: list[Node], spec: Spec, example: B.Example, reward_cfg: RewardConfig,
                       caps: ExecutorCaps = ExecutorCaps()) -> Evaluation:
        cfg = self.config
        for n in nodes:
            if caps.max_tokens[n.cap] < cfg.completion_tokens[n.cap]:
                raise SimConfigError(f"caps allow {caps.max_tokens[n.cap]} tokens at {n.cap} but the sim replies with "
                                     f"{cfg.completion_tokens[n.cap]}; raise ExecutorCaps.max_tokens")
        level, per_level = [], defaultdict(int)
        for n in nodes:
            level.append(1 + max((level[j] for j in n.deps), default=-1))
            per_level[level[-1]] += sum(call_tokens(n, nodes, cfg))
        tokens, exceeded = 0, False
        for lv in sorted(per_level):  # the executor's budget check, at level boundaries
            tokens += per_level[lv]
            if tokens > caps.task_token_budget:
                exceeded = True
                break
        dist = final_distribution(nodes, self.config.types[self.type_of(example)], cfg)
        last = nodes[-1]
        rewards = {s: self._reward(spec, 0.0 if exceeded else self._score(example, final_text(s, last.cap, last.kind,
                                                                                            example.gold, 1)),
                                   tokens, reward_cfg)
                   for s in dist}
        p_ok = 0.0 if exceeded else dist.get("correct", 0.0)
        return Evaluation(sum(p * rewards[s] for s, p in dist.items()), p_ok, tokens, exceeded, rewards)

    def evaluate(self, spec: Spec, example: B.Example, reward_cfg: RewardConfig,
                 caps: ExecutorCaps = ExecutorCaps()) -> Evaluation:
        if len(spec.agents) > caps.max_agents:
            raise ValueError(f"spec has {len(spec.agents)} agents > caps.max_agents={caps.max_agents}: the "
                             "executor refuses it")
        return self.evaluate_nodes(self.nodes_of(spec), spec, example, reward_cfg, caps)

    def expected_reward(self, spec: Spec, example: B.Example, reward_cfg: RewardConfig,
                        caps: ExecutorCaps = ExecutorCaps()) -> float:
        return self.evaluate(spec, example, reward_cfg, caps).expected_reward

    def optimum(self, example: B.Example, reward_cfg: RewardConfig, max_agents: int,
                caps: ExecutorCaps = ExecutorCaps()) -> Optimum:
        """The best spec for this example's type (lemon.testbed.search), cached per (type, reward, max_agents, caps)."""
        if not 1 <= max_agents <= 5:
            raise ValueError(f"max_agents={max_agents}: the exhaustive search is run for 1..5 agents (5 takes minutes)")
        key = (self.type_of(example), repr(reward_cfg), max_agents, hash(caps), example.benchmark)
        if key not in self._optima:
            check_reward_properties(lambda s, sc, t: self._reward(s, sc, t, reward_cfg), self.prompts)
            def value(nodes):
                return self.evaluate_nodes(nodes, spec_of(nodes, self.prompts, self.config), example, reward_cfg,
                                           caps).expected_reward
            nodes, _, count = search(value, self.config.types[self.type_of(example)], self.config,
                                     min(max_agents, caps.max_agents))
            spec = parse_spec(spec_of(nodes, self.prompts, self.config).to_yaml(),
                              base_roles=self.prompts.roles_for("math"))
            ev = self.evaluate(spec, example, reward_cfg, caps)
            self._optima[key] = Optimum(spec, ev.expected_reward, ev.p_success, ev.tokens, count)
        return self._optima[key]

    def score_text(self, text: str, example: B.Example, reward_cfg: RewardConfig, max_agents: int,
                   caps: ExecutorCaps = ExecutorCaps()) -> TextScore:
        """Parse a spec text as the trainer does; invalid -> the reward of an invalid spec (compute_reward(None,
        ...))."""
        best = self.optimum(example, reward_cfg, max_agents, caps).expected_reward
        try:
            spec = parse_spec(text, base_roles=self.prompts.roles_for(B.get_benchmark(example.benchmark).domain),
                              max_agents=max_agents)
        except SpecError as e:
            r = compute_reward(None, 0.0, 0, reward_cfg).total
            return TextScore(False, r, best - r, e.code)
        r = self.expected_reward(spec, example, reward_cfg, caps)
        return TextScore(True, r, best - r, spec=spec)

    def regret(self, text: str, example: B.Example, reward_cfg: RewardConfig, max_agents: int,
               caps: ExecutorCaps = ExecutorCaps()) -> float:
        return self.score_text(text, example, reward_cfg, max_agents, caps).regret

    def score_texts(self, texts, example_ids, reward_cfg: RewardConfig, max_agents: int,
                    caps: ExecutorCaps = ExecutorCaps()) -> list[TextScore]:
        """A batch of spec texts (e.g. one training step's rollouts) with the example id each was written for."""
        by_id = self._by_id
        missing = sorted(set(example_ids) - set(by_id))
        if missing:
            raise SimUnknownTaskError(f"example ids {missing[:5]} are not in this SimWorld")
        return [self.score_text(t, by_id[i], reward_cfg, max_agents, caps) for t, i in zip(texts, example_ids)]


def best_fixed(world: SimWorld, reward_cfg: RewardConfig, max_agents: int, caps: ExecutorCaps = ExecutorCaps()):
    """The best ONE spec for every task type of the world (what a policy that ignores the question can do at best):
    (spec, its expected reward per type, its regret = mean over types of optimum - its reward). Types weigh equally, as
    the trainer's round-robin draws them. Exhaustive over the search's structures (lemon.testbed.search)."""
    types = list(world.config.types)
    ex = {t: next(e for e in world.examples() if world.type_of(e) == t) for t in types}
    opt = {t: world.optimum(ex[t], reward_cfg, max_agents, caps).expected_reward for t in types}
    widest = TaskType({c: 0.0 for c in CAPACITIES}, plan_bonus=max(t.plan_bonus for t in world.config.types.values()))
    best = None
    for nodes in structures(widest, world.config, min(max_agents, caps.max_agents)):
        spec = spec_of(nodes, world.prompts, world.config)
        per = {t: world.evaluate_nodes(nodes, spec, ex[t], reward_cfg, caps).expected_reward for t in types}
        regret = sum(opt[t] - per[t] for t in types) / len(types)
        if best is None or regret < best[2] - 1e-12:
            best = (spec, per, regret)
    return best


def two_type_world(prompts: Prompts, config: SimConfig = TWO_TYPES) -> SimWorld:
    """MultiArith train (easy) + GSM8K train (hard): every example the trainer can draw from those train pools."""
    return SimWorld(config, prompts)


def tiny_world(prompts: Prompts, n: int | None = None) -> SimWorld:
    """GSM8K train only, one hard type (TINY); `n` = only the first n examples (tests)."""
    ex = B.pool("gsm8k", "train")
    return SimWorld(TINY, prompts, ex[:n] if n else ex)


def duty_world(prompts: Prompts, n: int | None = None) -> SimWorld:
    """GSM8K train, role / duty decide success at equal capacity (DUTY)."""
    ex = B.pool("gsm8k", "train")
    return SimWorld(DUTY, prompts, ex[:n] if n else ex)


def edge_world(prompts: Prompts, n: int | None = None) -> SimWorld:
    """GSM8K train, a verifier reading the solver decides success (EDGE)."""
    ex = B.pool("gsm8k", "train")
    return SimWorld(EDGE, prompts, ex[:n] if n else ex)


def multi_world(prompts: Prompts, n: int | None = None) -> SimWorld:
    """GSM8K train, several fields each pay a little (MULTI)."""
    ex = B.pool("gsm8k", "train")
    return SimWorld(MULTI, prompts, ex[:n] if n else ex)


def mixed_world(prompts: Prompts) -> SimWorld:
    """MultiArith train (the small worker is the specialist) + GSM8K train (the large one is): MIXED."""
    return SimWorld(MIXED, prompts)
