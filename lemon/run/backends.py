"""The worker backends behind a capacity level, and the types they share (paper §3: small / medium / large workers).

Two real implementations of one `Backend` protocol: any OpenAI-compatible server (the embedded default's managed
llama-servers from lemon.run.servers, vLLM, Ollama, hosted APIs) and HF transformers (GPU, or a policy checkpoint used
as a worker). There is no in-process llama.cpp backend: managed llama-servers batch concurrent requests
(LOG.md, 2026-12-01; bench/server_bench.py), and one worker path is simpler.
Real calls report the backend's OWN token counts: the paper's cost axis is tokens, so a backend that cannot say how many
it used raises instead of counting 0. The pool, the fake backend and the token meter are in lemon.run.workers.
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

from lemon.run.models import ModelNotInstalledError


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    """Decoding settings of one call; frozen so one object can be shared by threads and used in cache keys."""

    max_tokens: int = 256
    """Upper bound on generated tokens (finish_reason "length" when hit)."""
    temperature: float = 0.0
    """0 = greedy; at most 2 (the OpenAI API's range)."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]."""
    seed: int = 0
    """Per-call sampling seed: a sampled run is reproducible call by call, not only from process start."""
    stop: tuple[str, ...] = ()
    """Stop strings; the returned text excludes them."""
    json_schema: dict | None = None
    """JSON schema for constrained decoding where the backend supports it (`backend.supports_json_schema`)."""

    def __post_init__(self):
        if isinstance(self.stop, str) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a sequence of non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(self.stop))  # lists from YAML/JSON become tuples
        checks = [(_is_int(self.max_tokens) and self.max_tokens > 0, "max_tokens must be a positive int"),
                  (0.0 <= self.temperature <= 2.0, "temperature must be in [0, 2]"),
                  (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
                  (_is_int(self.seed) and self.seed >= 0, "seed must be a non-negative int"),
                  (self.json_schema is None or isinstance(self.json_schema, dict),
                   "json_schema must be a dict or None")]
        for ok, msg in checks:
            if not ok:
                raise ValueError(f"{msg}; got {self}")

    def key(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"))

    def __hash__(self):  # the generated hash would fail on the json_schema dict
        return hash(self.key())


@dataclass(frozen=True)
class Completion:
    """One chat answer with the backend's own usage counts."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    latency_s: float
    model: str
    backend: str
    finish_reason: str = ""

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class BackendError(RuntimeError):
    """A call failed for a reason other than the backend being unreachable (bad request, missing usage, ...)."""


class BackendUnavailableError(BackendError):
    """The backend cannot serve at all: dead server after bounded retries, missing or closed model."""


class ModelUnavailableError(BackendUnavailableError, ModelNotInstalledError):
    """A shipped model is not installed; catchable as either parent. The message names the pip command."""


class UnknownCapacityError(ValueError):
    """A capacity level the pool has no worker for; the message lists the valid ones."""


class Backend(Protocol):
    backend: str  # kind, in manifests and node-cache keys
    model: str
    max_concurrency: int  # calls it serves at once (the executor bounds a DAG level's threads by it)
    supports_json_schema: bool

    def chat(self, messages: list[dict], params: SamplingParams) -> Completion: ...
    def close(self) -> None: ...


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class OpenAIBackend:
    """Any OpenAI-compatible chat endpoint (vLLM, llama-server, Ollama, hosted APIs). Retries are ours (the client's are
    off) so they are bounded and observable.

    Retry policy: connection errors (timeouts included), 429 and 5xx are retried up to `max_retries` times with
    exponential backoff; then BackendUnavailableError (the executor stops the run: a dead server is never scored as a
    wrong answer). With `recover` (a managed server: lemon.run.servers), a connection error first calls recover(), which
    restarts a dead server and returns its base URL, and the request is sent again: in-flight requests survive a crash.
    At most `max_concurrency` requests are in flight per backend (a semaphore): callers beyond it wait here, so the
    request timeout covers the server's work, not the queue.
    json_mode: how `json_schema` is sent: "json_schema" is the OpenAI standard (vLLM, llama-server, Ollama, hosted
    APIs), "json_object" is llama-cpp-python's server ({"type": "json_object", "schema": ...}).
    extra_body: extra request fields (e.g. llama-server's top_k / min_p); kind: the name in manifests and node-cache
    keys. on_retry(attempt, error, delay_s) is called before each backoff sleep; `retries` counts them all."""

    supports_json_schema = True

    def __init__(self, base_url: str, model: str, *, api_key: str = "EMPTY", timeout_s: float = 60,
                 max_retries: int = 3, backoff_s: float = 0.5, max_concurrency: int = 4, json_mode: str = "json_schema",
                 on_retry: Callable[[int, Exception, float], None] | None = None,
                 recover: Callable[[], str] | None = None, extra_body: dict | None = None, kind: str = "openai",
                 info: Callable[[], dict] | None = None):
        if json_mode not in ("json_schema", "json_object"):
            raise ValueError(f"json_mode must be 'json_schema' or 'json_object', got {json_mode!r}")
        if not _is_int(max_concurrency) or max_concurrency < 1:
            raise ValueError(f"max_concurrency must be a positive int, got {max_concurrency!r}")
        import openai  # lazy: only needed when a server is configured
        self._openai, self.base_url, self.model, self.max_concurrency = openai, base_url, model, max_concurrency
        self.max_retries, self.backoff_s, self.json_mode, self.on_retry = max_retries, backoff_s, json_mode, on_retry
        self.backend, self.recover, self.extra_body, self.info = kind, recover, dict(extra_body or {}), info
        self.retries, self.recoveries, self._lock = 0, 0, threading.Lock()
        self._slots = threading.BoundedSemaphore(max_concurrency)
        self._api_key, self._timeout_s = api_key, timeout_s
        self._client = openai.OpenAI(base_url=base_url, api_key=api_key, timeout=timeout_s, max_retries=0)

    def _retryable(self, e: Exception) -> bool:
        o = self._openai  # connection errors include timeouts; 429 and 5xx are transient on a loaded server
        return isinstance(e, (o.APIConnectionError, o.RateLimitError)) or (
            isinstance(e, o.APIStatusError) and e.status_code >= 500)

    def _recover(self, e: Exception) -> None:
        """A managed server: restart it if it died (shared by every caller that saw the crash), follow a port change."""
        if self.recover is None or not isinstance(e, self._openai.APIConnectionError):
            return
        url = self.recover()  # raises BackendUnavailableError when the server cannot be brought back
        with self._lock:
            self.recoveries += 1
            if url != self.base_url:
                old, self.base_url = self._client, url
                self._client = self._openai.OpenAI(base_url=url, api_key=self._api_key, timeout=self._timeout_s,
                                                   max_retries=0)
                old.close()

    def chat(self, messages: list[dict], params: SamplingParams) -> Completion:
        kw, where = {}, f"{self.backend} {self.base_url} ({self.model})"
        if params.json_schema is not None:
            kw["response_format"] = {"type": "json_object", "schema": params.json_schema} \
                if self.json_mode == "json_object" \
                else {"type": "json_schema", "json_schema": {"name": "answer", "schema": params.json_schema,
                                                             "strict": True}}
        if self.extra_body:
            kw["extra_body"] = self.extra_body
        last = None
        with self._slots:
            t0 = time.perf_counter()
            for attempt in range(self.max_retries + 1):
                if attempt:
                    delay = self.backoff_s * 2 ** (attempt - 1) * (1 + 0.1 * random.random())  # jitter de-syncs threads
                    with self._lock:
                        self.retries += 1
                    if self.on_retry:
                        self.on_retry(attempt, last, delay)
                    time.sleep(delay)
                    self._recover(last)
                try:
                    r = self._client.chat.completions.create(
                        model=self.model, messages=messages, max_tokens=params.max_tokens,
                        temperature=params.temperature, top_p=params.top_p, seed=params.seed,
                        stop=list(params.stop) or None, **kw)
                    break
                except Exception as e:
                    if not self._retryable(e):
                        raise BackendError(f"{where}: {type(e).__name__}: {e}") from e
                    last = e
            else:
                raise BackendUnavailableError(
                    f"{where}: unavailable after {self.max_retries + 1} attempts (exponential backoff from "
                    f"{self.backoff_s}s); last error {type(last).__name__}: {last}") from last
            dt = time.perf_counter() - t0
        if not r.choices or r.choices[0].message.content is None:  # never hand back a silent empty answer
            raise BackendError(f"{where}: response has no message content: {r!r:.300}")
        if r.usage is None or not r.usage.prompt_tokens or r.usage.completion_tokens is None:
            raise BackendError(f"{where}: server reported no token usage; refusing to count 0")
        ch = r.choices[0]
        return Completion(ch.message.content, int(r.usage.prompt_tokens), int(r.usage.completion_tokens), dt,
                          self.model, self.backend, ch.finish_reason or "")

    def describe(self) -> dict:
        """What a manifest records about this worker besides its model (the server's build and flags when managed)."""
        return {"base_url": self.base_url, "max_concurrency": self.max_concurrency, "retries": self.retries,
                **({"server": self.info()} if self.info else {})}

    def close(self) -> None:
        self._client.close()


class TransformersBackend:
    """HF transformers generate(). No constrained decoding: `json_schema` is ignored (supports_json_schema=False).
    `model_or_path` is a loaded model (pass tokenizer=) or a path; extra kwargs go to from_pretrained (e.g.
    gguf_file)."""

    backend, max_concurrency, supports_json_schema = "transformers", 1, False  # 1: per-call torch seeding is global

    def __init__(self, model_or_path, model: str, *, tokenizer=None, device: str | None = None, dtype=None, **load_kw):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        self.model, self._torch, self._lock = model, torch, threading.Lock()
        if isinstance(model_or_path, (str, Path)):
            self._model = AutoModelForCausalLM.from_pretrained(str(model_or_path), **load_kw,
                                                               **({"dtype": dtype} if dtype is not None else {}))
            tokenizer = tokenizer or AutoTokenizer.from_pretrained(str(model_or_path), **load_kw)
        elif tokenizer is None:
            raise ValueError("TransformersBackend: pass tokenizer= with an in-memory model")
        else:
            self._model = model_or_path if dtype is None else model_or_path.to(dtype)
        self._tok, self.device = tokenizer, device or ("cuda" if torch.cuda.is_available() else "cpu")
        self._model.to(self.device).eval()
        eos = self._model.generation_config.eos_token_id
        self._eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [tokenizer.eos_token_id])

    def chat(self, messages: list[dict], params: SamplingParams) -> Completion:
        tok = self._tok
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        ids = {k: v.to(self.device) for k, v in ids.items()}
        n_prompt = ids["input_ids"].shape[1]
        gen = dict(max_new_tokens=params.max_tokens, do_sample=params.temperature > 0,
                   pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
        if params.temperature > 0:  # top_k=0: no hidden top-k from the checkpoint's generation_config
            gen.update(temperature=params.temperature, top_p=params.top_p, top_k=0)
        if params.stop:
            gen.update(stop_strings=list(params.stop), tokenizer=tok)
        with self._lock:
            if self._model is None:
                raise BackendUnavailableError(f"transformers: backend for {self.model!r} is closed")
            t0 = time.perf_counter()
            self._torch.manual_seed(params.seed)
            with self._torch.no_grad():
                out = self._model.generate(**ids, **gen)
            dt = time.perf_counter() - t0
        new = out[0, n_prompt:].tolist()
        cut = next((i + 1 for i, t in enumerate(new) if t in self._eos), None)  # the EOS was generated: it counts
        text = tok.decode(new[:cut], skip_special_tokens=True)
        finish = "length" if cut is None else "stop"
        for s in params.stop:
            if s in text:
                text, finish = text[:text.index(s)], "stop"
        return Completion(text, n_prompt, len(new[:cut]), dt, self.model, self.backend, finish)

    def close(self) -> None:
        with self._lock:
            self._model = None
