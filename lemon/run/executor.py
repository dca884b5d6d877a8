"""Run a spec on one task: topological levels, agents of a level concurrently, a node cache, token and latency
accounting.

Paper §3.1: the validated spec is compiled to a DAG and executed by the worker LLMs in dependency order; the final
agent's output is the answer. Paper §3.3: the counterfactual re-execution of an edited spec reuses the outputs of
unchanged agents (a node-level cache), which is why the cache key below holds *everything* that determines an agent's
output and nothing else: an edit then misses exactly for the edited agent and its descendants.

Accounting (two token totals, on purpose): `Trace.tokens` is what this call really spent (cache hits cost 0);
`Trace.nominal_tokens` is what the spec costs without any cache (hits count their recorded usage). Rewards must use the
nominal total, or a spec would look cheaper merely because a sibling rollout warmed the cache. The token budget is
checked on the nominal total, at level boundaries, so whether an execution is over budget never depends on the cache or
on thread timing.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from lemon.prompts import CAPACITIES, Prompts
from lemon.spec import MAX_AGENTS, Agent, Spec
from lemon.run.workers import DEFAULT_MAX_TOKENS, BackendUnavailableError, Completion

CACHE_VERSION = 1  # bump when the meaning of a cache entry changes; old entries are then ignored


# Smallest reply cap per benchmark domain. Code needs more room than a number or a letter: the coder workers echo the
# HumanEval prompt (signature + docstring, ~100-300 tokens) before writing the body, so at the training caps (medium
# 256) every HumanEval reply of outputs/reference/cpu-20261130 was cut off (0/2 for every method) while the same 0.5B
# worker passed 2 of 6 with 384 tokens (LOG.md, 2026-12-01, defect 9).
MIN_REPLY_TOKENS = {"math": 0, "knowledge": 0, "code": 512}


def domain_reply_caps(max_tokens: dict[str, int], domain: str) -> dict[str, int]:
    """Per-capacity reply caps for one benchmark domain: `max_tokens`, raised to the domain's MIN_REPLY_TOKENS."""
    if domain not in MIN_REPLY_TOKENS:
        raise ValueError(f"unknown domain {domain!r}; known: {sorted(MIN_REPLY_TOKENS)}")
    return {c: max(int(n), MIN_REPLY_TOKENS[domain]) for c, n in max_tokens.items()}


@dataclass(frozen=True)
class ExecutorCaps:
    """Hard limits on one execution (the orchestrator cannot buy its way past them)."""

    max_agents: int = MAX_AGENTS
    """Specs with more agents are not run at all (trace.error says so, score 0)."""
    max_tokens: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_MAX_TOKENS))
    """capacity -> hard cap on completion tokens per agent call; the pool's own max_tokens is clipped to it (default:
    the pool's defaults, lemon.run.workers.DEFAULT_MAX_TOKENS, the one place those numbers live)."""
    task_token_budget: int = 6000
    """Total prompt+completion tokens (nominal) for one execution; past it the remaining levels are not run, score 0."""
    max_context_chars: int = 2400
    """Each upstream output shown to a child is cut to this many characters (head and tail kept, the cut marked)."""

    def __post_init__(self):
        if not isinstance(self.max_agents, int) or not 1 <= self.max_agents <= MAX_AGENTS:
            raise ValueError(f"max_agents={self.max_agents!r} must be an int in 1..{MAX_AGENTS} (the spec "
                             "schema's limit)")
        unknown = set(self.max_tokens) - set(CAPACITIES)
        if unknown:
            raise ValueError(f"max_tokens has unknown capacities {sorted(unknown)}; valid: {', '.join(CAPACITIES)}")
        merged = {**DEFAULT_MAX_TOKENS, **self.max_tokens}  # a capacity left out keeps the default cap: always capped
        for c, n in merged.items():
            if not isinstance(n, int) or n < 1:
                raise ValueError(f"max_tokens[{c!r}]={n!r} must be a positive int (tokens per agent call)")
        object.__setattr__(self, "max_tokens", merged)
        if not isinstance(self.task_token_budget, int) or self.task_token_budget < 1:
            raise ValueError(f"task_token_budget={self.task_token_budget!r} must be a positive int (tokens "
                             "per execution)")
        if not isinstance(self.max_context_chars, int) or self.max_context_chars < 64:
            raise ValueError(f"max_context_chars={self.max_context_chars!r} must be an int >= 64 (room for "
                             "head, tail, mark)")

    def __hash__(self):  # the dict field would make the generated hash fail
        return hash((self.max_agents, tuple(sorted(self.max_tokens.items())), self.task_token_budget,
                     self.max_context_chars))


@dataclass
class AgentTrace:
    id: str
    capacity: str
    model: str
    prompt_tokens: int = 0  # recorded usage, also for cache hits (nominal); 0 when skipped
    completion_tokens: int = 0
    latency_s: float = 0.0  # latency of the call that produced the output (recorded, for hits too)
    cache_hit: bool = False
    skipped: bool = False
    output: str = ""
    level: int = 0
    skip_reason: str | None = None  # "unreachable" | "budget" | "error" when skipped
    finish_reason: str | None = None
    seed: int = 0  # the per-agent seed it ran with

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class Trace:
    agents: list[AgentTrace]
    output: str = ""  # the final agent's raw text ("" when it did not run or the budget was exceeded)
    answer: str | None = None  # benchmark.extract_answer(output)
    score: float = 0.0
    tokens: int = 0  # spent by this call (cache hits cost 0)
    nominal_tokens: int = 0  # the spec's cost without cache: use this for token-efficiency rewards
    worker_latency_s: float = 0.0  # summed latency of the calls actually made
    wall_s: float = 0.0
    budget_exceeded: bool = False
    error: str | None = None

    @classmethod
    def empty(cls, error: str | None = None, wall_s: float = 0.0) -> "Trace":
        """A trace of nothing run (e.g. an invalid spec): score 0, the reason in `error`."""
        return cls(agents=[], error=error, wall_s=wall_s)

    @property
    def cache_hits(self) -> int:
        return sum(a.cache_hit for a in self.agents)

    def tokens_by_capacity(self) -> dict[str, int]:
        """Nominal tokens per capacity level (for cost models that price capacities differently)."""
        out = {c: 0 for c in CAPACITIES}
        for a in self.agents:
            out[a.capacity] = out.get(a.capacity, 0) + a.total_tokens
        return out

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---- node cache ------------------------------------------------------------------------------------------------------
class NodeCache:
    """Agent outputs keyed by everything that determines them (see `node_key`), bounded: at most `max_entries` in memory
    (least recently used evicted first) and, with `path`, an append-only JSONL file read at start so reruns are free
    across processes. The file is compacted (rewritten atomically with the live entries) once it holds 2 x max_entries
    lines, so neither memory nor disk grows without bound over a long training run. Each entry is one line written with
    a single `write` in append mode (whole lines even with several writers); an unreadable line (a killed writer) is
    skipped. Thread-safe. `stats()` reports hits, misses, hit_rate, entries and evictions."""

    def __init__(self, path: str | Path | None = None, max_entries: int = 100_000):
        if not isinstance(max_entries, int) or max_entries < 1:
            raise ValueError(f"max_entries={max_entries!r} must be a positive int")
        self.path = Path(path) if path is not None else None
        self.max_entries = max_entries
        self._mem: OrderedDict[str, dict] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = self.evictions = 0
        self._needs_newline = False
        self._lines = 0  # lines in the file (live or stale), to know when to compact
        if self.path is not None and self.path.exists():
            raw = self.path.read_bytes()
            self._needs_newline = bool(raw) and not raw.endswith(b"\n")  # torn tail: start our first line afresh
            for line in raw.splitlines():
                self._lines += 1
                try:
                    row = json.loads(line)
                    if row.get("v") == CACHE_VERSION:
                        self._mem[row["key"]] = row["completion"]
                        self._mem.move_to_end(row["key"])
                except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
                    continue
            while len(self._mem) > self.max_entries:  # the newest lines win
                self._mem.popitem(last=False)

    def get(self, key: str) -> Completion | None:
        with self._lock:
            d = self._mem.get(key)
            if d is None:
                self.misses += 1
                return None
            self._mem.move_to_end(key)
            self.hits += 1
        return Completion(**d)

    def put(self, key: str, completion: Completion) -> None:
        d = {f.name: getattr(completion, f.name) for f in dataclasses.fields(completion)}
        with self._lock:
            self._mem[key] = d
            self._mem.move_to_end(key)
            while len(self._mem) > self.max_entries:
                self._mem.popitem(last=False)
                self.evictions += 1
            if self.path is None:
                return
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self._lines + 1 > 2 * self.max_entries:
                self._compact()
                return
            line = _cache_line(key, d)
            if self._needs_newline:
                line, self._needs_newline = "\n" + line, False
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line)
            self._lines += 1

    def _compact(self) -> None:
        """Rewrite the file with exactly the live entries (caller holds the lock); atomic via rename."""
        tmp = self.path.with_name(self.path.name + f".tmp{os.getpid()}")
        with open(tmp, "w", encoding="utf-8") as f:
            for k, d in self._mem.items():
                f.write(_cache_line(k, d))
        os.replace(tmp, self.path)
        self._lines, self._needs_newline = len(self._mem), False

    def stats(self) -> dict[str, float]:
        with self._lock:
            n = self.hits + self.misses
            return {"hits": self.hits, "misses": self.misses, "hit_rate": self.hits / n if n else 0.0,
                    "entries": len(self._mem), "evictions": self.evictions}

    def __len__(self) -> int:
        return len(self._mem)


def _cache_line(key: str, completion: dict) -> str:
    return json.dumps({"v": CACHE_VERSION, "key": key, "completion": completion}, ensure_ascii=False) + "\n"


def node_key(agent: Agent, parents: list[tuple[str, str, str]], task: str, *, model: str, backend: str, params_key: str,
             seed: int, final: bool, answer_convention: str | None, prompts_sha256: str, messages: list[dict]) -> str:
    """sha256 over what determines an agent's output: its fields (id too: children's context labels use it), its
    parents' ordered (id, role, output), the task, the worker (model, backend kind, sampling params incl. seed), the
    final flag and answer convention, the prompts file, and (belt and braces: covers truncation and templates) the
    rendered messages."""
    blob = {"v": CACHE_VERSION, "agent": [agent.id, agent.base_role, agent.role, agent.duty, agent.capacity],
            "parents": [list(p) for p in parents], "task": task, "model": model, "backend": backend,
            "params": params_key, "seed": seed, "final": final, "convention": answer_convention if final else None,
            "prompts": prompts_sha256, "messages": messages}
    return hashlib.sha256(json.dumps(blob, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def _backend_kind(b) -> str:
    return str(getattr(b, "backend", type(b).__name__))


# ---- prompts ---------------------------------------------------------------------------------------------------------
def agent_seed(seed: int, agent_id: str) -> int:
    """Per-agent seed from (run seed, agent id): reruns reproduce, and an edit elsewhere in the spec leaves it
    unchanged."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{agent_id}".encode()).digest()[:4], "big") & 0x7FFFFFFF


def truncate(text: str, limit: int) -> str:
    """Keep the head and the tail (answers usually come last), marking the cut."""
    if len(text) <= limit:
        return text
    mark = f"\n[... {len(text) - limit} characters cut ...]\n"
    keep = max(0, limit - len(mark))
    head = keep // 2
    return text[:head] + mark + text[len(text) - (keep - head):]


def build_messages(agent: Agent, parents: list[tuple[str, str, str]], task: str, prompts: Prompts, *,
                   answer_convention: str | None = None, max_context_chars: int = 2400) -> list[dict]:
    """Chat messages of one agent from the prompts file's worker templates. `parents` = ordered (id, role, output);
    `answer_convention` is given for the final agent only (it then gets `worker.final_suffix`)."""
    w = prompts.worker
    items = [w["context_item"].format(id=pid, role=prole, output=truncate(out, max_context_chars))
             for pid, prole, out in parents]
    context = "\n" + "\n\n".join(items) + "\n" if items else ""
    system = w["system"].format(role=agent.role, base_role=agent.base_role,
                                base_duty=prompts.default_duty(agent.base_role))
    user = w["user"].format(task=task, context=context, duty=agent.duty)
    if answer_convention is not None:
        user += w["final_suffix"].format(answer_convention=answer_convention)
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


# ---- execution -------------------------------------------------------------------------------------------------------
def execute(spec: Spec, example, benchmark, pool, *, prompts: Prompts, cache: NodeCache | None = None,
            caps: ExecutorCaps = ExecutorCaps(), seed: int = 0, meter=None,
            sampling: Mapping[str, Any] | None = None) -> Trace:
    """Run `spec` on `example`. `sampling` = extra SamplingParams overrides for every agent (e.g. a temperature for
    SC-CoT).

    Failures: an agent's backend exception ends the run with trace.error naming the agent and the exception (score 0;
    the eval loop goes on, the row shows it); BackendUnavailableError propagates (a dead backend must stop the run, not
    score 0)."""
    t0 = time.perf_counter()
    if len(spec.agents) > caps.max_agents:
        return Trace.empty(error=f"spec has {len(spec.agents)} agents > max_agents={caps.max_agents}; not run",
                           wall_s=time.perf_counter() - t0)
    missing = sorted({a.capacity for a in spec.agents} - set(pool.backends))
    if missing:  # a configuration bug, not the spec's fault: fail loudly
        raise ValueError(f"worker pool has no backend for capacity {missing}; it has {sorted(pool.backends)}")
    if sampling and {"seed", "max_tokens"} & set(sampling):
        raise ValueError("sampling may not override seed (derived per agent) or max_tokens (set by the pool, "
                         "capped by caps)")
    level_of = {aid: i for i, lvl in enumerate(spec.levels()) for aid in lvl}
    dead = set(spec.unreachable())
    traces: dict[str, AgentTrace] = {}
    outputs: dict[str, str] = {}
    convention = benchmark.answer_convention
    tokens = nominal = 0
    latency = 0.0
    errors: list[str] = []
    exceeded = False
    backends = {id(pool.backends[a.capacity]): pool.backends[a.capacity] for a in spec.agents}
    # Bound concurrency per backend: a server takes as many requests as it has slots (max_concurrency), a local model 1.
    sems = {k: threading.BoundedSemaphore(max(1, int(b.max_concurrency))) for k, b in backends.items()}
    n_threads = max(1, min(len(spec.agents), sum(max(1, int(b.max_concurrency)) for b in backends.values())))

    def skip(a: Agent, reason: str, model: str) -> AgentTrace:
        return AgentTrace(a.id, a.capacity, model, skipped=True, level=level_of[a.id], skip_reason=reason,
                          seed=agent_seed(seed, a.id))

    def run_one(a: Agent, messages: list[dict], key: str, overrides: dict) -> tuple[Completion, bool]:
        if cache is not None:
            hit = cache.get(key)
            if hit is not None:
                return hit, True
        backend = pool.backends[a.capacity]
        with sems[id(backend)]:
            comp = pool.chat(a.capacity, messages, **overrides)
        if cache is not None:
            cache.put(key, comp)
        return comp, False

    with ThreadPoolExecutor(max_workers=n_threads, thread_name_prefix="lemon-agent") as tp:
        for level in spec.levels():
            futures = {}
            for aid in level:
                a = spec.agent(aid)
                model = pool.model_of(a.capacity)
                if aid in dead or errors or exceeded:
                    traces[aid] = skip(a, "unreachable" if aid in dead else "error" if errors else "budget", model)
                    continue
                parents = [(d, spec.agent(d).role, outputs[d]) for d in a.depends_on]
                is_final = aid == spec.final
                messages = build_messages(a, parents, example.question, prompts,
                                          answer_convention=convention if is_final else None,
                                          max_context_chars=caps.max_context_chars)
                base = pool.params[a.capacity]
                overrides = {**(sampling or {}), "max_tokens": min(base.max_tokens, caps.max_tokens[a.capacity]),
                             "seed": agent_seed(seed, aid)}
                params = dataclasses.replace(base, **overrides)
                key = node_key(a, parents, example.question, model=model,
                               backend=_backend_kind(pool.backends[a.capacity]), params_key=params.key(), seed=seed,
                               final=is_final, answer_convention=convention, prompts_sha256=prompts.sha256,
                               messages=messages)
                futures[aid] = (a, model, overrides["seed"], tp.submit(run_one, a, messages, key, overrides))
            unavailable = None
            for aid, (a, model, aseed, fut) in futures.items():  # wait for the whole level before judging it
                try:
                    comp, hit = fut.result()
                except BackendUnavailableError as e:
                    unavailable = unavailable or e
                    continue
                except Exception as e:  # noqa: BLE001 - recorded in trace.error, never swallowed
                    errors.append(f"agent {aid!r} (capacity {a.capacity}, model {model}): {type(e).__name__}: {e}")
                    traces[aid] = skip(a, "error", model)
                    continue
                outputs[aid] = comp.text
                traces[aid] = AgentTrace(aid, a.capacity, comp.model or model, comp.prompt_tokens,
                                         comp.completion_tokens, comp.latency_s, hit, False, comp.text, level_of[aid],
                                         None, comp.finish_reason, aseed)
                nominal += comp.prompt_tokens + comp.completion_tokens
                if not hit:
                    tokens += comp.prompt_tokens + comp.completion_tokens
                    latency += comp.latency_s
                if meter is not None:
                    meter.add(a.capacity, comp, cached=hit)
            if unavailable is not None:
                raise unavailable
            if nominal > caps.task_token_budget:
                exceeded = True

    trace = Trace(agents=[traces[a.id] for a in spec.agents], tokens=tokens, nominal_tokens=nominal,
                  worker_latency_s=latency, budget_exceeded=exceeded, error="; ".join(errors) or None)
    if not errors and not exceeded:
        trace.output = outputs[spec.final]
        trace.answer = benchmark.extract_answer(trace.output, example)
        trace.score = float(benchmark.score(example, trace.output))
    trace.wall_s = time.perf_counter() - t0
    return trace
