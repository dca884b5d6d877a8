"""SIMULATED workers with an explicit success and cost model: a known-optimum testbed for CF-GRPO.

Only the workers are simulated. The spec parser, the executor (lemon.run.executor: levels, node cache, token budget),
the worker prompts (lemon/prompts.yaml), the edits and the real benchmark scorer are the project's own. A `SimBackend`
(one per capacity) reads exactly the chat messages the executor sends (parsed back with the prompts file's `worker`
templates; it never sees the spec) and `params.seed`, and replies with a one-line state tag that its children read, e.g.
`[sim state=wrong cap=large kind=solve]`; the final agent adds `Answer: <gold>` when its state is correct, a wrong
number when wrong, no number at all when it holds no answer. Everything below is the whole model.

Behaviour of an agent, by the kind of its base role (math domain; any other base role is `idle`):

| kind  | base roles           | output state (C correct, W wrong, N no answer)                                   |
|-------|----------------------|----------------------------------------------------------------------------------|
| solve | solver               | C with p = p_solve[type][cap] + solve_duty_bonus*custom + plan_bonus[type]*noted |
|       |                      | (clipped to [0, 1]), else W. It ignores its parents' answers.                    |
| check | verifier, critic     | candidate c = vote of its answering (C/W) parents; N when none answers. c = C    |
|       |                      | stays C; c = W becomes C with q = q_fix[cap] + check_duty_bonus*custom.          |
| pass  | decider, summarizer, | the vote c itself (N when no parent answers).                                    |
|       | calculator           |                                                                                  |
| note  | planner, extractor   | N; a solve agent that reads a note is `noted` (helps where plan_bonus > 0).      |
| idle  | any other base role  | N.                                                                               |

custom (the duty's effect, `duty_effect`): 0 for the base role's default duty (what the m_R edit rolls back to); for a
customized duty, +1 when the world rewards what it says, else -1. A world that lists words for a kind
(SimConfig.duty_words) rewards a duty of that kind only when it names one of them (case-insensitive): the bonus above
for +1, minus off_duty_penalty for -1, so rolling a duty back can raise reward or lower it and a policy has something to
learn in the text. A kind without words keeps the lenient rule (any customized duty is +1, so no m_R delta is negative).
vote = C when more than half of the answering parents are C, W when fewer, a fair coin on a tie. The task type comes
from the example's benchmark (e.g. MultiArith easy, GSM8K hard): the orchestrator can only tell them apart by the
question's style (no explicit tag). Tokens (independent of outcomes): completion = completion_tokens[cap]; prompt =
prompt_tokens + the completion tokens of every parent read. A call allowed fewer tokens than the model's reply raises
SimConfigError (stops the run).

Randomness: an agent's outcome is F^-1(u) over (C, W, N) of the distribution above, u = sha256(params.seed, its
capacity, the exact messages) / 2^64. So the node cache and re-execution are consistent (same inputs, same output),
while two specs whose agent a1 shares the executor's per-agent seed (grammar-constrained ids are fixed) still draw
independently as soon as the agent's capacity, role, duty or parents' states differ; the CF re-execution of an edited
agent is an independent draw too. With a fixed run seed the same spec on the same task gets the same outcome at every
step (as greedy real workers would). `SimWorld.expected_reward` enumerates these distributions exactly (no sampling) and
scores each final state with the real benchmark scorer and lemon.train.rewards.compute_reward (lemon.testbed.world);
`SimWorld.optimum` searches spec structures (lemon.testbed.search).
"""
from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from fractions import Fraction
from types import MappingProxyType
from typing import Mapping, NamedTuple

from lemon.benchmarks import canonical_number, get_benchmark, parse_number
from lemon.prompts import CAPACITIES, Prompts
from lemon.run.backends import BackendError, BackendUnavailableError, Completion, SamplingParams

KIND_OF = MappingProxyType({"solver": "solve", "verifier": "check", "critic": "check", "decider": "pass",
                            "summarizer": "pass", "calculator": "pass", "planner": "note", "extractor": "note"})
KINDS = ("solve", "check", "pass", "note", "idle")
STATES = ("correct", "wrong", "none")  # F^-1(u) walks them in this order
C, W, N = STATES
MAX_TAG_CHARS = 64  # the executor cuts a parent's output to max_context_chars (>= 64): a tag is never cut


class SimProtocolError(BackendError):
    """The messages are not an executor agent call built from this world's prompts file (e.g. an orchestrator prompt, or
    a parent output that is not a sim tag). A BackendError: the executor records it as that agent's error."""


class SimConfigError(BackendUnavailableError):
    """The world is set up wrongly for this run (e.g. a call allows fewer completion tokens than the simulated reply
    has). A BackendUnavailableError so that the executor stops the run instead of scoring it 0."""


class SimUnknownTaskError(SimConfigError):
    """The task text is not one of the world's examples: build the SimWorld with every example the trainer may draw."""


def _probs(m: Mapping[str, float], what: str) -> Mapping[str, float]:
    if set(m) != set(CAPACITIES) or not all(0.0 <= float(v) <= 1.0 for v in m.values()):
        raise ValueError(f"{what} must give a probability in [0, 1] for each of {CAPACITIES}, got {dict(m)}")
    return MappingProxyType({c: float(m[c]) for c in CAPACITIES})


@dataclass(frozen=True)
class TaskType:
    """How hard one type of task is for a solver."""

    p_solve: Mapping[str, float]
    """capacity -> P(a solve agent with the base duty is correct)."""
    plan_bonus: float = 0.0
    """Added to p when the solver reads a note agent (planner / extractor); 0 = notes only cost tokens."""

    def __post_init__(self):
        object.__setattr__(self, "p_solve", _probs(self.p_solve, "p_solve"))
        if not 0.0 <= self.plan_bonus <= 1.0:
            raise ValueError(f"plan_bonus={self.plan_bonus} must be in [0, 1] (the search assumes notes never hurt)")


@dataclass(frozen=True)
class SimConfig:
    """The whole simulated world: task types, how checking, duties and capacities act, and what every call costs."""

    types: Mapping[str, TaskType]
    """type name -> TaskType."""
    benchmark_type: Mapping[str, str]
    """benchmark name -> type name (the type is visible in the task text through the benchmark's style)."""
    q_fix: Mapping[str, float] = field(default_factory=lambda: {"small": 0.0, "medium": 0.3, "large": 0.5})
    """capacity -> P(a check agent turns a wrong candidate into the right answer)."""
    solve_duty_bonus: float = 0.15
    """Added to a solver's p when its duty is customized."""
    check_duty_bonus: float = 0.1
    """Added to a checker's q when its duty is customized."""
    completion_tokens: Mapping[str, int] = field(default_factory=lambda: {"small": 100, "medium": 160, "large": 240})
    """capacity -> completion tokens of every reply (under the cpu preset's caps 192 / 256 / 320)."""
    prompt_tokens: int = 400
    """Prompt tokens of a call before the parents' replies are added (system + task + duty; the real ones are
    ~360-420)."""
    duty_words: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """kind -> lower-case words one of which a customized duty of that kind must contain to pay its bonus; kinds not
    listed pay for any customized duty (the lenient rule)."""
    off_duty_penalty: float = 0.0
    """Subtracted from p (solve) or q (check) when a listed kind's customized duty names none of its words."""

    def __post_init__(self):
        object.__setattr__(self, "types", MappingProxyType(dict(self.types)))
        object.__setattr__(self, "benchmark_type", MappingProxyType(dict(self.benchmark_type)))
        object.__setattr__(self, "q_fix", _probs(self.q_fix, "q_fix"))
        if not self.types or not set(self.benchmark_type.values()) <= set(self.types):
            raise ValueError(f"benchmark_type {dict(self.benchmark_type)} must map benchmarks to types in "
                             f"{list(self.types)}")
        for b in self.benchmark_type:
            if get_benchmark(b).kind != "number":
                raise ValueError(f"benchmark {b!r} is not numeric: the sim answers with numbers (gsm8k, "
                                 "multiarith, svamp)")
        if not (0 <= self.solve_duty_bonus <= 1 and 0 <= self.check_duty_bonus <= 1):
            raise ValueError("duty bonuses must be in [0, 1]: the search assumes a customized duty never hurts")
        toks = {c: self.completion_tokens.get(c) for c in CAPACITIES}
        if not all(isinstance(t, int) and t >= 1 for t in toks.values()) or not isinstance(self.prompt_tokens, int) \
                or self.prompt_tokens < 1:
            raise ValueError("completion_tokens (one positive int per capacity) and prompt_tokens must be "
                             "positive ints")
        object.__setattr__(self, "completion_tokens", MappingProxyType(toks))
        words = {k: tuple(v) for k, v in dict(self.duty_words).items()}
        bad = [k for k, v in words.items() if k not in ("solve", "check") or not v
               or not all(isinstance(w, str) and w and w == w.lower().strip() for w in v)]
        if bad:
            raise ValueError(f"duty_words for kinds {bad}: keys must be 'solve' or 'check' (the kinds a duty "
                             "bonus acts on), values non-empty tuples of lower-case words")
        object.__setattr__(self, "duty_words", MappingProxyType(words))
        if not 0.0 <= self.off_duty_penalty <= 1.0:
            raise ValueError(f"off_duty_penalty={self.off_duty_penalty} must be in [0, 1]")

    def to_dict(self) -> dict:
        return {"types": {k: {"p_solve": dict(t.p_solve), "plan_bonus": t.plan_bonus} for k, t in self.types.items()},
                "benchmark_type": dict(self.benchmark_type), "q_fix": dict(self.q_fix),
                "solve_duty_bonus": self.solve_duty_bonus, "check_duty_bonus": self.check_duty_bonus,
                "completion_tokens": dict(self.completion_tokens), "prompt_tokens": self.prompt_tokens,
                "duty_words": {k: list(v) for k, v in self.duty_words.items()},
                "off_duty_penalty": self.off_duty_penalty}

    @classmethod
    def from_dict(cls, d: Mapping) -> "SimConfig":
        """The inverse of to_dict. A record written before duty_words existed reads back with the lenient rule."""
        return cls(types={k: TaskType(v["p_solve"], v.get("plan_bonus", 0.0)) for k, v in d["types"].items()},
                   benchmark_type=d["benchmark_type"], q_fix=d["q_fix"], solve_duty_bonus=d["solve_duty_bonus"],
                   check_duty_bonus=d["check_duty_bonus"], completion_tokens=d["completion_tokens"],
                   prompt_tokens=d["prompt_tokens"],
                   duty_words={k: tuple(v) for k, v in d.get("duty_words", {}).items()},
                   off_duty_penalty=d.get("off_duty_penalty", 0.0))


def duty_effect(kind: str, duty: str, default_duty: str, cfg: SimConfig) -> int:
    """0 for the default duty; +1 for a customized duty the world rewards; -1 for one it does not (see the
    docstring)."""
    if duty == default_duty:
        return 0
    words = cfg.duty_words.get(kind)
    if words is None:
        return 1
    low = duty.lower()
    return 1 if any(w in low for w in words) else -1


class Node(NamedTuple):
    """What the model sees of one agent: kind, capacity, its duty's effect, and its parents (indices of earlier
    nodes)."""

    kind: str
    cap: str
    custom: int  # duty_effect: -1, 0 or +1 (True / False read as +1 / 0)
    deps: tuple[int, ...] = ()


def _vote(parent_states) -> dict[str, float]:
    answering = [s for s in parent_states if s != N]
    if not answering:
        return {N: 1.0}
    k, m = sum(s == C for s in answering), len(answering)
    pc = 1.0 if 2 * k > m else 0.0 if 2 * k < m else 0.5
    return {C: pc, W: 1.0 - pc}


def outcome_dist(node: Node, parents: list[tuple[str, str]], ttype: TaskType, cfg: SimConfig) -> dict[str, float]:
    """P(state) of one agent given its parents' (kind, state): the table in the module docstring, in one place."""
    if node.kind == "solve":
        noted = any(k == "note" for k, _ in parents)
        p = min(1.0, max(0.0, ttype.p_solve[node.cap] + _duty_shift(node.custom, cfg.solve_duty_bonus, cfg)
                         + ttype.plan_bonus * noted))
        return {C: p, W: 1.0 - p}
    if node.kind in ("check", "pass"):
        v = _vote([s for _, s in parents])
        if node.kind == "pass" or N in v:
            return v
        q = min(1.0, max(0.0, cfg.q_fix[node.cap] + _duty_shift(node.custom, cfg.check_duty_bonus, cfg)))
        return {C: v[C] + v[W] * q, W: v[W] * (1.0 - q)}
    return {N: 1.0}


def _duty_shift(effect: int, bonus: float, cfg: SimConfig) -> float:
    return bonus if effect > 0 else -cfg.off_duty_penalty if effect < 0 else 0.0


def final_distribution(nodes: list[Node], ttype: TaskType, cfg: SimConfig) -> dict[str, float]:
    """Exact P(state) of the LAST node, by enumerating the joint states of all nodes in order (3^n at most)."""
    joint = {(): 1.0}
    for node in nodes:
        nxt: dict[tuple, float] = defaultdict(float)
        for states, p in joint.items():
            for s, q in outcome_dist(node, [(nodes[j].kind, states[j]) for j in node.deps], ttype, cfg).items():
                if q > 0:
                    nxt[states + (s,)] += p * q
        joint = nxt
    out: dict[str, float] = defaultdict(float)
    for states, p in joint.items():
        out[states[-1]] += p
    return dict(out)


def call_tokens(node: Node, nodes: list[Node], cfg: SimConfig) -> tuple[int, int]:
    """(prompt, completion) tokens of one call: the parents' replies are part of its prompt."""
    return (cfg.prompt_tokens + sum(cfg.completion_tokens[nodes[j].cap] for j in node.deps),
            cfg.completion_tokens[node.cap])


# ---- the replies and the messages ------------------------------------------------------------------------------------
_TAG_RE = re.compile(r"\[sim state=(?P<state>correct|wrong|none) cap=(?P<cap>small|medium|large) "
                     r"kind=(?P<kind>solve|check|pass|note|idle)\]")


def tag(state: str, cap: str, kind: str) -> str:
    return f"[sim state={state} cap={cap} kind={kind}]"


def final_text(state: str, cap: str, kind: str, gold: str, offset: int) -> str:
    """The final agent's reply; `offset` (>= 1) makes the wrong number. No digit outside `Answer:` (the scorer falls
    back to the last number of the text)."""
    if state == C:
        return f"{tag(state, cap, kind)}\nAnswer: {gold}"
    if state == W:
        g = parse_number(gold)
        return f"{tag(state, cap, kind)}\nAnswer: {canonical_number((g if g is not None else Fraction(0)) + offset)}"
    return f"{tag(state, cap, kind)}\n(no answer)"


def _template_re(template: str, patterns: Mapping[str, str] = MappingProxyType({})) -> re.Pattern:
    """A str.format template as a regex with one named group per placeholder (`patterns` overrides the lazy `.*?`)."""
    parts = re.split(r"\{(\w+)\}", template)  # literal, name, literal, ...
    return re.compile("".join(re.escape(p) if i % 2 == 0 else f"(?P<{p}>{patterns.get(p, '.*?')})"
                              for i, p in enumerate(parts)), re.S)


class AgentView(NamedTuple):
    """An agent call as the sim reads it from the messages."""

    task: str
    kind: str
    duty: str
    base_duty: str  # the base role's default duty (duty_effect compares against it)
    final: bool
    parents: list[tuple[str, str, str]]  # (kind, state, cap) read from the parents' tags, in context order

    @property
    def custom(self) -> bool:
        """The duty is not the base role's default (whether it PAYS is duty_effect's question, which needs the
        world)."""
        return self.duty != self.base_duty


class MessageReader:
    """Parses the executor's agent messages back with the prompts file's worker templates (round-trip checked)."""

    def __init__(self, prompts: Prompts):
        w = prompts.worker
        self.w = w
        roles = sorted(prompts.roles_for(None), key=len, reverse=True)  # a role NAME may contain ", a ": anchor on the
        self.system = _template_re(w["system"], {"base_role": "|".join(map(re.escape, roles))})  # known base roles
        item_prefix = w["context_item"].split("{", 1)[0]
        user = re.escape(w["user"]).replace(re.escape("{task}"), "(?P<task>.*?)")
        user = user.replace(re.escape("{context}"), f"(?P<context>(?:\\n{re.escape(item_prefix)}.*?\\n)?)")
        user = user.replace(re.escape("{duty}"), "(?P<duty>.*?)")
        suffix = re.escape(w["final_suffix"]).replace(re.escape("{answer_convention}"), "(?P<convention>.+)")
        self.user = re.compile(f"{user}(?P<suffix>{suffix})?", re.S)
        item = _template_re(w["context_item"]).pattern.replace("(?P<output>.*?)", f"(?P<output>{_TAG_RE.pattern})")
        self.item = re.compile(item, re.S)  # a parent's output is exactly one tag (non-final replies are tags only)

    def read(self, messages: list[dict]) -> AgentView:
        if len(messages) != 2 or [m.get("role") for m in messages] != ["system", "user"]:
            raise SimProtocolError("the sim only answers executor agent calls (one system + one user message)")
        s, u = self.system.fullmatch(messages[0]["content"]), self.user.fullmatch(messages[1]["content"])
        if not s or not u or self.w["system"].format(**s.groupdict()) != messages[0]["content"]:
            raise SimProtocolError(f"not a worker prompt of this prompts file: {messages[0]['content'][:80]!r}")
        user = self.w["user"].format(task=u["task"], context=u["context"], duty=u["duty"]) + (u["suffix"] or "")
        if user != messages[1]["content"]:
            raise SimProtocolError(f"the user message does not round-trip through the worker template: {user[:80]!r}")
        return AgentView(u["task"], KIND_OF.get(s["base_role"], "idle"), u["duty"], s["base_duty"],
                         u["suffix"] is not None, self._parents(u["context"]))

    def _parents(self, context: str) -> list[tuple[str, str, str]]:
        """(kind, state, cap) of each context item; context = "\n" + "\n\n".join(items) + "\n" (build_messages)."""
        if not context:
            return []
        items = list(self.item.finditer(context))
        rebuilt = "\n" + "\n\n".join(self.w["context_item"].format(id=m["id"], role=m["role"], output=m["output"])
                                      for m in items) + "\n"
        if rebuilt != context:
            raise SimProtocolError(f"the parents' outputs are not sim tags: {context[:120]!r}")
        return [(m["kind"], m["state"], m["cap"]) for m in items]


# ---- the backend ----------------------------------------------------------------------------------------------------
def draw(seed: int, cap: str, messages: list[dict]) -> tuple[float, int]:
    """(u in [0, 1), wrong-answer offset in 1..9) from the call's seed, capacity and exact messages."""
    h = hashlib.sha256(json.dumps([seed, cap, messages], ensure_ascii=False, sort_keys=True).encode()).digest()
    return int.from_bytes(h[:8], "big") / 2.0 ** 64, 1 + h[8] % 9


def pick(dist: Mapping[str, float], u: float) -> str:
    acc = 0.0
    for s in STATES:
        acc += dist.get(s, 0.0)
        if u < acc:
            return s
    return max(dist, key=dist.get)  # u within float round-off of 1


class SimBackend:
    """The simulated worker of one capacity (the lemon.run.backends Backend protocol). Stateless apart from a call
    count."""

    backend, supports_json_schema = "sim", False

    # world: a lemon.testbed.world.SimWorld (not imported here: that module imports this one)
    def __init__(self, capacity: str, world: "SimWorld", max_concurrency: int = 16):  # noqa: F821
        if capacity not in CAPACITIES:
            raise ValueError(f"capacity {capacity!r}; valid: {', '.join(CAPACITIES)}")
        self.capacity, self.world, self.model = capacity, world, f"sim-{capacity}"
        self.max_concurrency = max_concurrency
        self.calls, self._lock = 0, threading.Lock()

    def chat(self, messages: list[dict], params: SamplingParams) -> Completion:
        w, cap = self.world, self.capacity
        view = w.reader.read(messages)
        example, ttype = w.lookup(view.task)
        n_comp = w.config.completion_tokens[cap]
        if params.max_tokens < n_comp:
            raise SimConfigError(f"sim-{cap}: the simulated reply is {n_comp} tokens but the call allows "
                                 f"{params.max_tokens}; raise the worker token caps (SimWorld.worker_max_tokens()) or "
                                 "lower completion_tokens")
        node = Node(view.kind, cap, duty_effect(view.kind, view.duty, view.base_duty, w.config))
        dist = outcome_dist(node, [(k, s) for k, s, _ in view.parents], ttype, w.config)
        u, offset = draw(params.seed, cap, messages)
        state = pick(dist, u)
        text = final_text(state, cap, view.kind, example.gold, offset) if view.final else tag(state, cap, view.kind)
        n_prompt = w.config.prompt_tokens + sum(w.config.completion_tokens[c] for _, _, c in view.parents)
        with self._lock:
            self.calls += 1
        return Completion(text, n_prompt, n_comp, 0.0, self.model, self.backend, "stop")

    def close(self) -> None:
        pass
