"""The capacity-level worker pool that runs a spec's agents, a deterministic fake backend for control-flow tests, and
the token meter. The real backends (OpenAI-compatible, transformers) and the shared types are in lemon.run.backends, the
managed llama-servers of the embedded default in lemon.run.servers; both are re-exported here.
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

from lemon.run.backends import (Backend, Completion, OpenAIBackend, SamplingParams, TransformersBackend,
                                UnknownCapacityError)
# re-exported: callers catch these
from lemon.run.backends import BackendError, BackendUnavailableError, ModelUnavailableError  # noqa: F401
from lemon.run.models import DEFAULT_LADDER, SHIPPED
from lemon.run.servers import ServerConfig, ServerManager

__all__ = ["Backend", "BackendError", "BackendUnavailableError", "Completion", "FakeBackend", "ModelUnavailableError",
           "OpenAIBackend", "SamplingParams", "ServerConfig", "ServerManager", "TokenMeter", "TransformersBackend",
           "UnknownCapacityError", "WorkerPool", "load_worker_config"]

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


BACKENDS = ("llama_server", "llama_cpp", "openai", "transformers", "fake")
SERVER_BACKENDS = ("llama_server", "llama_cpp")  # "llama_cpp" (older configs' name) means a managed llama-server
SERVER_KEYS = tuple(f.name for f in dataclasses.fields(ServerConfig))


@dataclass
class WorkerPool:
    """Capacity level -> backend + default sampling params. Several capacities may share one backend instance.
    `servers`: the llama-servers this pool started (embedded default); close() stops them."""

    backends: dict[str, Backend]
    params: dict[str, SamplingParams] = field(default_factory=dict)
    servers: ServerManager | None = None

    def __post_init__(self):
        if set(self.params) - set(self.backends):
            raise UnknownCapacityError("params for capacities without a backend: "
                                       f"{sorted(set(self.params) - set(self.backends))}")
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
        out = {}
        for cap, b in self.backends.items():
            extra = b.describe() if callable(getattr(b, "describe", None)) else {}
            out[cap] = {"backend": getattr(b, "backend", type(b).__name__), "model": b.model,
                        "params": dataclasses.asdict(self.params[cap]), **extra}
        return out

    def close(self) -> None:
        try:
            for b in {id(b): b for b in self.backends.values()}.values():  # a shared backend is closed once
                b.close()
        finally:
            if self.servers is not None:
                self.servers.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @classmethod
    def embedded_default(cls, ladder: dict[str, str] | None = None, *, max_tokens: dict[str, int] | None = None,
                         server: ServerConfig | None = None, log_dir: str | Path | None = None) -> "WorkerPool":
        """The shipped models (DEFAULT_LADDER unless `ladder`), one managed llama-server per distinct model, logs in
        `log_dir` (give the run folder; default a fresh temp dir named in describe())."""
        srv = dataclasses.asdict(server or ServerConfig())
        return cls.from_config({**{cap: {"backend": "llama_server", "model": name, **srv}
                                   for cap, name in (ladder or DEFAULT_LADDER).items()},
                                "max_tokens": max_tokens or {}},
                               log_dir=log_dir)

    @classmethod
    def from_config(cls, cfg: dict, *, log_dir: str | Path | None = None) -> "WorkerPool":
        """cfg: {capacity: {"backend": name, "model": ..., other constructor kwargs}, "max_tokens": {capacity: n}}.
        Identical entries share one backend instance (one copy of the weights in memory). `llama_server` entries (alias
        `llama_cpp`) name a shipped model or a GGUF path plus optional ServerConfig fields; the pool starts one server
        per distinct entry and stops them on close(); their logs go to `log_dir`."""
        if not isinstance(cfg, dict):
            raise ValueError(f"worker config must be a mapping, got {type(cfg).__name__}")
        cfg = dict(cfg)
        max_tokens = cfg.pop("max_tokens", None) or {}
        if not cfg:
            raise ValueError("worker config names no capacities")
        if set(max_tokens) - set(cfg):
            raise ValueError(f"max_tokens for capacities not in the config: {sorted(set(max_tokens) - set(cfg))}")
        for cap, entry in cfg.items():
            if not isinstance(entry, dict) or "backend" not in entry or "model" not in entry:
                raise ValueError(f"worker config for {cap!r} must be a mapping with 'backend' and 'model'")
            if entry["backend"] not in BACKENDS:
                raise ValueError(f"unknown backend {entry['backend']!r} for {cap!r}; valid: {list(BACKENDS)}")
        shared: dict[str, Backend] = {}
        backends, manager = {}, None
        try:
            servers = _plan_servers(cfg)
            if servers:
                manager = ServerManager(log_dir)
                for alias, (model, scfg) in servers.items():
                    if model in SHIPPED:
                        manager.add_shipped(model, scfg, alias)
                    else:
                        manager.add(alias, model, scfg)
                manager.start()
            for cap, entry in cfg.items():
                k = json.dumps(entry, sort_keys=True, default=str)
                if k not in shared:
                    shared[k] = (manager.backend(_server_alias(entry, servers)) if entry["backend"] in SERVER_BACKENDS
                                 else _make_backend(dict(entry)))
                backends[cap] = shared[k]
        except BaseException:
            for b in shared.values():  # do not leak already-loaded weights or started servers when a later entry is bad
                b.close()
            if manager is not None:
                manager.close()
            raise
        return cls(backends, {cap: SamplingParams(max_tokens=int(max_tokens.get(cap, DEFAULT_MAX_TOKENS.get(cap, 256))))
                              for cap in backends}, servers=manager)


def load_worker_config(path: str | Path) -> dict:
    """A worker-pool file (YAML, or JSON: a subset of YAML) as the mapping WorkerPool.from_config takes: {capacity:
    entry, "max_tokens": {capacity: n}}. The one reader of --workers files (`lemon eval/run/train`, the paper
    preset)."""
    import yaml
    cfg = yaml.safe_load(Path(path).read_text())
    if not isinstance(cfg, dict) or not cfg:
        raise ValueError(f"worker config {path} must be a non-empty mapping of capacity -> worker, got "
                         f"{type(cfg).__name__}")
    if not isinstance(cfg.get("max_tokens") or {}, dict):
        raise ValueError(f"max_tokens in {path} must map capacity -> tokens")
    return cfg


def _plan_servers(cfg: dict) -> dict[str, tuple[str, ServerConfig]]:
    """alias -> (model, ServerConfig) for the distinct llama_server entries; the alias is the model's name (its file
    stem for a path, or `name`), suffixed when one model runs under two configurations."""
    plan, seen = {}, {}
    for cap, e in cfg.items():
        if e["backend"] not in SERVER_BACKENDS:
            continue
        model = str(e["model"])
        if model not in SHIPPED and not (model.endswith(".gguf") and Path(model).is_file()):
            raise ValueError(f"{e['backend']} model {model!r} for {cap!r} is neither a shipped model ({list(SHIPPED)}) "
                             "nor a GGUF file")
        unknown = set(e) - {"backend", "model", "name", *SERVER_KEYS}
        if unknown:
            raise ValueError(f"unknown keys {sorted(unknown)} for the {e['backend']} worker {cap!r}; valid: "
                             f"model, name, {', '.join(SERVER_KEYS)}")
        scfg = ServerConfig(**{k: v for k, v in e.items() if k in SERVER_KEYS})
        key = (model, json.dumps(dataclasses.asdict(scfg), sort_keys=True))
        if key in seen:
            continue
        base = e.get("name") or (model if model in SHIPPED else Path(model).stem)
        alias, i = base, 2
        while alias in plan:
            alias, i = f"{base}-{i}", i + 1
        plan[alias], seen[key] = (model, scfg), alias
    return plan


def _server_alias(entry: dict, plan: dict[str, tuple[str, ServerConfig]]) -> str:
    model = str(entry["model"])
    scfg = ServerConfig(**{k: v for k, v in entry.items() if k in SERVER_KEYS})
    return next(a for a, (m, c) in plan.items() if m == model and c == scfg)


def _make_backend(entry: dict) -> Backend:
    kind, model = entry.pop("backend"), entry.pop("model")
    if kind == "openai":
        if "base_url" not in entry:
            raise ValueError(f"openai backend for {model!r} needs base_url")
        return OpenAIBackend(entry.pop("base_url"), model, **entry)
    if kind == "transformers":
        return TransformersBackend(model, entry.pop("name", str(model)), **entry)
    return FakeBackend(model=model, **entry)


class TokenMeter:
    """Thread-safe token accounting per capacity and per model. Cached calls count their tokens too (the cost metric
    must not depend on how warm the cache was) and are also counted as `cached_calls`."""

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
