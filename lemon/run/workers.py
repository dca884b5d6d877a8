"""The capacity-level worker pool that runs a spec's agents, a deterministic fake backend for control-flow tests, and the
token meter. The real backends (llama.cpp, OpenAI-compatible, transformers) and the shared types are in lemon.run.backends and
re-exported here.
"""
from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple

from lemon.run.backends import Backend, Completion, LlamaCppBackend, OpenAIBackend, SamplingParams, TransformersBackend, UnknownCapacityError
from lemon.run.backends import BackendError, BackendUnavailableError, ModelUnavailableError  # noqa: F401  (re-exported: callers catch these)
from lemon.run.models import DEFAULT_LADDER, SHIPPED

__all__ = ["Backend", "BackendError", "BackendUnavailableError", "Completion", "FakeBackend", "LlamaCppBackend",
           "ModelUnavailableError", "OpenAIBackend", "SamplingParams", "TokenMeter", "TransformersBackend",
           "UnknownCapacityError", "WorkerPool"]

DEFAULT_MAX_TOKENS = {"small": 256, "medium": 384, "large": 512}


class FakeCall(NamedTuple):
    messages: list[dict]
    params: SamplingParams


class FakeBackend:
    """Deterministic double: replies by `reply(messages, params)` (or a fixed string); tokens = whitespace-split words.
    Records every call in `calls` (FakeCall(messages, params)); an exception raised by `reply` propagates."""

    backend, supports_json_schema = "fake", False

    def __init__(self, reply: Callable[[list[dict], SamplingParams], str] | str = "Answer: 0", model: str = "fake",
                 max_concurrency: int = 8, latency_s: float = 0.0):
        self.reply, self.model, self.max_concurrency, self.latency_s = reply, model, max_concurrency, latency_s
        self.calls: list[FakeCall] = []
        self._lock = threading.Lock()

    def chat(self, messages: list[dict], params: SamplingParams) -> Completion:
        with self._lock:
            self.calls.append(FakeCall([dict(m) for m in messages], params))
        text = self.reply(messages, params) if callable(self.reply) else self.reply
        if self.latency_s:
            time.sleep(self.latency_s)
        n_prompt = sum(len(str(m.get("content") or "").split()) for m in messages)
        return Completion(text, n_prompt, len(text.split()), self.latency_s, self.model, self.backend, "stop")

    def close(self) -> None:
        pass


BACKENDS = {"llama_cpp": LlamaCppBackend, "openai": OpenAIBackend, "transformers": TransformersBackend, "fake": FakeBackend}


@dataclass
class WorkerPool:
    """Capacity level -> backend + default sampling params. Several capacities may share one backend instance."""

    backends: dict[str, Backend]
    params: dict[str, SamplingParams] = field(default_factory=dict)

    def __post_init__(self):
        if set(self.params) - set(self.backends):
            raise UnknownCapacityError(f"params for capacities without a backend: {sorted(set(self.params) - set(self.backends))}")
        self.params = {cap: self.params.get(cap) or SamplingParams(max_tokens=DEFAULT_MAX_TOKENS.get(cap, 256))
                       for cap in self.backends}

    def _backend(self, capacity: str) -> Backend:
        if capacity not in self.backends:
            raise UnknownCapacityError(f"unknown capacity {capacity!r}; valid: {list(self.backends)}")
        return self.backends[capacity]

    def chat(self, capacity: str, messages: list[dict], **overrides) -> Completion:
        b, names = self._backend(capacity), [f.name for f in dataclasses.fields(SamplingParams)]
        if set(overrides) - set(names):
            raise TypeError(f"unknown sampling overrides {sorted(set(overrides) - set(names))}; valid: {names}")
        return b.chat(messages, dataclasses.replace(self.params[capacity], **overrides))

    def model_of(self, capacity: str) -> str:
        return self._backend(capacity).model

    def describe(self) -> dict:
        return {cap: {"backend": getattr(b, "backend", type(b).__name__), "model": b.model,
                      "params": dataclasses.asdict(self.params[cap]),
                      **({"n_threads": b.n_threads} if getattr(b, "n_threads", None) else {})} for cap, b in self.backends.items()}

    def close(self) -> None:
        for b in {id(b): b for b in self.backends.values()}.values():  # a shared backend is closed once
            b.close()

    @classmethod
    def embedded_default(cls, ladder: dict[str, str] | None = None, *, max_tokens: dict[str, int] | None = None,
                         n_ctx: int = 4096) -> "WorkerPool":
        return cls.from_config({**{cap: {"backend": "llama_cpp", "model": name, "n_ctx": n_ctx}
                                   for cap, name in (ladder or DEFAULT_LADDER).items()}, "max_tokens": max_tokens or {}})

    @classmethod
    def from_config(cls, cfg: dict) -> "WorkerPool":
        """cfg: {capacity: {"backend": name, "model": ..., other constructor kwargs}, "max_tokens": {capacity: n}}.
        Identical entries share one backend instance (one copy of the weights in memory)."""
        if not isinstance(cfg, dict):
            raise ValueError(f"worker config must be a mapping, got {type(cfg).__name__}")
        cfg = dict(cfg)
        max_tokens = cfg.pop("max_tokens", None) or {}
        if not cfg:
            raise ValueError("worker config names no capacities")
        if set(max_tokens) - set(cfg):
            raise ValueError(f"max_tokens for capacities not in the config: {sorted(set(max_tokens) - set(cfg))}")
        shared: dict[str, Backend] = {}
        backends = {}
        cpu_lock = threading.Lock()  # every in-process llama.cpp decode uses all cores: one at a time (LlamaCppBackend)
        try:
            for cap, entry in cfg.items():
                if not isinstance(entry, dict) or "backend" not in entry or "model" not in entry:
                    raise ValueError(f"worker config for {cap!r} must be a mapping with 'backend' and 'model'")
                if entry["backend"] not in BACKENDS:
                    raise ValueError(f"unknown backend {entry['backend']!r} for {cap!r}; valid: {list(BACKENDS)}")
                k = json.dumps(entry, sort_keys=True, default=str)
                backends[cap] = shared[k] = shared.get(k) or _make_backend(dict(entry), cpu_lock)
        except BaseException:
            for b in shared.values():  # do not leak already-loaded weights when a later entry is bad
                b.close()
            raise
        return cls(backends, {cap: SamplingParams(max_tokens=int(max_tokens.get(cap, DEFAULT_MAX_TOKENS.get(cap, 256))))
                              for cap in backends})


def _make_backend(entry: dict, cpu_lock: threading.Lock | None = None) -> Backend:
    kind, model = entry.pop("backend"), entry.pop("model")
    if kind == "llama_cpp":
        entry.setdefault("cpu_lock", cpu_lock)
        if model in SHIPPED:
            return LlamaCppBackend.shipped(model, **entry)
        if Path(model).is_file():
            return LlamaCppBackend(model, entry.pop("name", Path(model).stem), **entry)
        raise ValueError(f"llama_cpp model {model!r} is neither a shipped model ({list(SHIPPED)}) nor a GGUF file")
    if kind == "openai":
        if "base_url" not in entry:
            raise ValueError(f"openai backend for {model!r} needs base_url")
        return OpenAIBackend(entry.pop("base_url"), model, **entry)
    if kind == "transformers":
        return TransformersBackend(model, entry.pop("name", str(model)), **entry)
    return FakeBackend(model=model, **entry)


class TokenMeter:
    """Thread-safe token accounting per capacity and per model. Cached calls count their tokens too (the cost metric must
    not depend on how warm the cache was) and are also counted as `cached_calls`."""

    _FIELDS = ("calls", "cached_calls", "prompt_tokens", "completion_tokens")

    def __init__(self):
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self._by = {k: defaultdict(lambda: dict.fromkeys(self._FIELDS, 0)) for k in ("capacity", "model")}

    def add(self, capacity: str, c: Completion, cached: bool = False) -> None:
        with self._lock:
            for row in (self._by["capacity"][capacity], self._by["model"][c.model]):
                for f, v in zip(self._FIELDS, (1, int(cached), c.prompt_tokens, c.completion_tokens)):
                    row[f] += v

    def totals(self) -> dict:
        """{"by_capacity": {cap: row}, "by_model": {model: row}, "total": row}; a row has calls, cached_calls,
        prompt_tokens, completion_tokens and total_tokens."""
        with self._lock:
            by_cap, by_model = ({k: dict(v) for k, v in self._by[g].items()} for g in ("capacity", "model"))
        total = {f: sum(r[f] for r in by_cap.values()) for f in self._FIELDS}
        for row in (*by_cap.values(), *by_model.values(), total):
            row["total_tokens"] = row["prompt_tokens"] + row["completion_tokens"]
        return {"by_capacity": by_cap, "by_model": by_model, "total": total}
