"""Worker backends and pool: the real 135M model behind a managed llama-server (usage, stop, length, constrained output,
concurrency, a server killed mid-run), a stub HTTP server for the OpenAI error paths, retry and recovery, transformers,
the fake double, the pool and the meter. Server lifecycle (crash/restart, orphans) is in test_servers.py."""
import dataclasses
import http.server
import json
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from lemon.run.models import get_model
from lemon.run.servers import ServerConfig, ServerManager
from lemon.run.workers import (BackendError, BackendUnavailableError, Completion, FakeBackend, OpenAIBackend,
                               SamplingParams, TokenMeter, TransformersBackend, UnknownCapacityError, WorkerPool)

SMALL = "smollm2-135m"  # never the 1.5B here: tests must stay fast on 2 cores
MSGS = [{"role": "user", "content": "What is 2 + 3? Reply with one short sentence."}]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """The 135M model behind a managed llama-server (4 slots, 2048 tokens each)."""
    m = ServerManager(tmp_path_factory.mktemp("servers"))
    m.add_shipped(SMALL, ServerConfig(slots=4, ctx_per_slot=2048))
    m.start()
    b = m.backend(SMALL)
    yield b
    b.close()
    m.close()


def _tokens(backend, text: str) -> int:
    req = urllib.request.Request(backend.base_url.removesuffix("/v1") + "/tokenize",
                                 json.dumps({"content": text, "add_special": False}).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return len(json.loads(r.read())["tokens"])


# ---------------------------------------------------------------- SamplingParams / Completion

def test_sampling_params_validate_and_key():
    p = SamplingParams(stop=["\n", "END"], json_schema={"type": "object"})
    assert p.stop == ("\n", "END") and hash(p) == hash(SamplingParams(stop=("\n", "END"),
                                                                      json_schema={"type": "object"}))
    assert json.loads(p.key())["stop"] == ["\n", "END"] and p.key() == dataclasses.replace(p).key()
    assert SamplingParams(seed=1).key() != SamplingParams(seed=2).key()
    for bad in (dict(max_tokens=0), dict(max_tokens=1.5), dict(temperature=-0.1), dict(temperature=2.5),
                dict(top_p=0), dict(top_p=1.2), dict(seed=-1), dict(stop="\n"), dict(stop=("",)),
                dict(json_schema="{}")):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    assert Completion("x", 3, 4, 0.1, "m", "fake").total_tokens == 7


# ---------------------------------------------------------------- llama-server, real 135M model

@pytest.mark.slow
def test_llama_chat_usage_and_determinism(small):
    p = SamplingParams(max_tokens=24)
    c = small.chat(MSGS, p)
    assert c.text.strip() and c.backend == "llama_server" and c.model == SMALL and c.finish_reason in ("stop", "length")
    assert 0 < c.completion_tokens <= 24 and c.latency_s > 0
    # usage is the server's own count: the prompt is the chat-templated messages, the completion retokenizes to it
    assert c.prompt_tokens > _tokens(small, MSGS[0]["content"])
    assert abs(c.completion_tokens - _tokens(small, c.text)) <= 1
    longer = small.chat([{**MSGS[0], "content": MSGS[0]["content"] + " Be brief."}], p)
    assert longer.prompt_tokens - c.prompt_tokens == _tokens(small, " Be brief.")
    again = small.chat(MSGS, p)  # the prompt now comes from the slot's cache: still counted in full
    assert (again.text, again.prompt_tokens, again.completion_tokens) == (c.text, c.prompt_tokens, c.completion_tokens)
    hot = SamplingParams(max_tokens=24, temperature=0.9, seed=7)
    assert small.chat(MSGS, hot).text == small.chat(MSGS, hot).text


@pytest.mark.slow
def test_llama_stop_and_length(small):
    c = small.chat([{"role": "user", "content": "Count from 1 to 20, separated by commas."}],
                   SamplingParams(max_tokens=8))
    assert c.finish_reason == "length" and c.completion_tokens == 8
    c = small.chat([{"role": "user", "content": "Count from 1 to 20, one number per line."}],
                   SamplingParams(max_tokens=40, stop=("\n",)))
    assert c.text.strip() and "\n" not in c.text and c.finish_reason == "stop" and c.completion_tokens < 40


@pytest.mark.slow
def test_llama_json_schema(small):
    schema = {"type": "object",
              "properties": {"answer": {"type": "integer"}, "reason": {"type": "string", "maxLength": 40}},
              "required": ["answer", "reason"], "additionalProperties": False}
    c = small.chat([{"role": "user", "content": "What is 2 + 3? Reply in JSON."}],
                   SamplingParams(max_tokens=64, json_schema=schema))
    obj = json.loads(c.text)
    assert set(obj) == {"answer", "reason"} and isinstance(obj["answer"], int) and isinstance(obj["reason"], str)


@pytest.mark.slow
def test_llama_concurrent_requests_batch_and_match_sequential(small):
    """Four requests at once share the server's slots (continuous batching) and give the greedy answers they give alone
    (observed on this build for the 135M model; llama.cpp does not promise batch invariance in general)."""
    p = SamplingParams(max_tokens=32)
    prompts = [[{"role": "user", "content": f"Name a colour and say why. ({i})"}] for i in range(4)]
    want = [small.chat(m, p) for m in prompts]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(4) as tp:
        got = list(tp.map(lambda m: small.chat(m, p), prompts))
    wall = time.perf_counter() - t0
    assert [g.text for g in got] == [w.text for w in want]
    assert [g.prompt_tokens for g in got] == [w.prompt_tokens for w in want]
    assert wall < sum(g.latency_s for g in got)  # they overlapped


@pytest.mark.slow
def test_llama_prompt_too_long_is_backend_error(tmp_path):
    with ServerManager(tmp_path) as m:
        m.add_shipped(SMALL, ServerConfig(slots=1, ctx_per_slot=512))
        b = m.start().backend(SMALL)
        with pytest.raises(BackendError, match="context") as ei:
            b.chat([{"role": "user", "content": "word " * 1000}], SamplingParams(max_tokens=4))
        assert not isinstance(ei.value, BackendUnavailableError) and m.server(SMALL).restarts == 0


# ---------------------------------------------------------------- WorkerPool, TokenMeter, FakeBackend

def test_fake_backend_counts_and_records():
    f = FakeBackend(lambda m, p: f"echo {m[-1]['content']} {p.seed}", model="echo")
    c = f.chat([{"role": "system", "content": "be nice"}, {"role": "user", "content": "a b c"}], SamplingParams(seed=5))
    assert c.text == "echo a b c 5" and (c.prompt_tokens, c.completion_tokens) == (5, 5) and c.backend == "fake"
    assert f.calls[0].messages[1]["content"] == "a b c" and f.calls[0].params.seed == 5
    msgs, params = f.calls[0]
    assert params.seed == 5
    g = FakeBackend()
    threads = [threading.Thread(target=g.chat, args=(MSGS, SamplingParams())) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(g.calls) == 16 and g.chat(MSGS, SamplingParams()).text == "Answer: 0"


def test_pool_capacities_overrides_describe():
    f_small, f_large = FakeBackend(lambda m, p: f"{p.max_tokens} {p.temperature}", model="s"), FakeBackend(model="l")
    pool = WorkerPool({"small": f_small, "large": f_large}, {"small": SamplingParams(max_tokens=100)})
    assert pool.chat("small", MSGS).text == "100 0.0"
    assert pool.chat("small", MSGS, max_tokens=7, temperature=0.5).text == "7 0.5"
    assert pool.params["small"].max_tokens == 100  # overrides do not stick
    assert pool.params["large"].max_tokens == 512 and pool.model_of("large") == "l"
    with pytest.raises(UnknownCapacityError, match=r"valid: \['small', 'large'\]") as ei:
        pool.chat("medium", MSGS)
    assert isinstance(ei.value, ValueError)
    with pytest.raises(UnknownCapacityError):
        pool.model_of("huge")
    with pytest.raises(TypeError, match="max_tokens"):
        pool.chat("small", MSGS, max_token=3)
    with pytest.raises(ValueError):
        pool.chat("small", MSGS, temperature=9)
    d = pool.describe()
    assert d["small"] == {"backend": "fake", "model": "s", "params": dataclasses.asdict(SamplingParams(max_tokens=100))}
    json.dumps(d)


def test_from_config_sharing_and_errors():
    pool = WorkerPool.from_config({"small": {"backend": "fake", "model": "a", "reply": "x"},
                                   "medium": {"backend": "fake", "model": "a", "reply": "x"},
                                   "large": {"backend": "fake", "model": "b"}, "max_tokens": {"large": 9}})
    assert pool.backends["small"] is pool.backends["medium"] is not pool.backends["large"]
    assert pool.params["large"].max_tokens == 9 and pool.params["medium"].max_tokens == 384
    bad = [({"small": {"backend": "vllm", "model": "x"}},
            r"valid: \['llama_server', 'llama_cpp', 'openai', 'transformers', 'fake'\]"),
           ({"small": {"backend": "openai", "model": "x"}}, "base_url"),
           ({"small": {"model": "x"}}, "'backend'"),
           ({"small": "llama_cpp"}, "mapping"),
           ({"small": {"backend": "llama_cpp", "model": "no-such-model"}}, "neither a shipped model"),
           ({"small": {"backend": "llama_server", "model": SMALL, "n_ctx": 512}}, "unknown keys"),
           ({"small": {"backend": "fake", "model": "a"}, "max_tokens": {"large": 3}}, "not in the config"),
           ({}, "no capacities"), ([], "mapping")]
    for cfg, msg in bad:
        with pytest.raises(ValueError, match=msg):
            WorkerPool.from_config(cfg)


def test_token_meter():
    m = TokenMeter()
    a, b = Completion("x", 10, 2, 0.1, "m1", "fake"), Completion("y", 5, 1, 0.1, "m2", "fake")
    threads = [threading.Thread(target=m.add, args=("small", a)) for _ in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    m.add("large", b, cached=True)
    m.add("small", b)
    t = m.totals()
    assert t["by_capacity"]["small"] == {"calls": 51, "cached_calls": 0, "prompt_tokens": 505, "completion_tokens": 101,
                                         "total_tokens": 606}
    assert t["by_model"]["m2"]["calls"] == 2 and t["by_model"]["m2"]["cached_calls"] == 1
    assert t["total"]["calls"] == 52 and t["total"]["total_tokens"] == 606 + 6
    m.reset()
    assert m.totals()["total"]["calls"] == 0


# ---------------------------------------------------------------- OpenAI-compatible: stub server for error paths

def _send_json(handler, status: int, body) -> None:
    data = json.dumps(body).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


class _Stub(http.server.BaseHTTPRequestHandler):
    script: list = []  # (status, body) per request, consumed in order

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        status, body = self.script.pop(0)
        _send_json(self, status, body)

    def log_message(self, *a):
        pass


def _answer(usage=True):
    body = {"id": "x", "object": "chat.completion", "created": 0, "model": "stub",
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "hi there"}}]}
    if usage:
        body["usage"] = {"prompt_tokens": 11, "completion_tokens": 2, "total_tokens": 13}
    return body


@pytest.fixture
def stub():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()


def test_openai_stub_retries_then_succeeds_and_errors(stub):
    url, err = f"http://127.0.0.1:{stub.server_address[1]}/v1", {"error": {"message": "boom"}}
    seen = []
    be = OpenAIBackend(url, "stub", backoff_s=0.01, on_retry=lambda a, e, d: seen.append(a))
    _Stub.script[:] = [(500, err), (503, err), (200, _answer())]
    c = be.chat(MSGS, SamplingParams())
    assert (c.text, c.prompt_tokens, c.completion_tokens, c.backend) == ("hi there", 11, 2, "openai") and seen == [1, 2]
    _Stub.script[:] = [(200, _answer(usage=False))]
    with pytest.raises(BackendError, match="no token usage"):
        be.chat(MSGS, SamplingParams())
    _Stub.script[:] = [(400, err)]
    with pytest.raises(BackendError) as ei:
        be.chat(MSGS, SamplingParams())
    assert not isinstance(ei.value, BackendUnavailableError) and be.retries == 2  # 4xx is not retried
    _Stub.script[:] = [(500, err)] * 4
    with pytest.raises(BackendUnavailableError, match="4 attempts"):
        be.chat(MSGS, SamplingParams())
    be.close()


class _Slow(http.server.BaseHTTPRequestHandler):
    """Answers after 0.2 s and records the most requests it ever held at once."""
    lock, now, peak = threading.Lock(), 0, 0

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        with _Slow.lock:
            _Slow.now += 1
            _Slow.peak = max(_Slow.peak, _Slow.now)
        time.sleep(0.2)
        with _Slow.lock:
            _Slow.now -= 1
        _send_json(self, 200, _answer())

    def log_message(self, *a):
        pass


def test_openai_bounds_in_flight_requests_and_recovers_a_moved_server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Slow)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}/v1"
    try:
        be = OpenAIBackend(url, "stub", max_concurrency=2)
        with ThreadPoolExecutor(6) as tp:
            out = list(tp.map(lambda _: be.chat(MSGS, SamplingParams()), range(6)))
        assert _Slow.peak == 2 and all(c.prompt_tokens == 11 for c in out)  # never more than max_concurrency in flight
        # a "restarted" server on another port: recover() names it, the request is re-sent there
        with socket_closed_port() as dead:
            calls = []
            be2 = OpenAIBackend(dead, "stub", backoff_s=0.01, recover=lambda: calls.append(1) or url)
            c = be2.chat(MSGS, SamplingParams())
            assert c.text == "hi there" and calls == [1] and be2.base_url == url and be2.recoveries == 1
    finally:
        srv.shutdown()
        srv.server_close()
    with pytest.raises(ValueError, match="max_concurrency"):
        OpenAIBackend(url, "stub", max_concurrency=0)


class socket_closed_port:
    """A base URL on a port nothing listens on (bound, then closed)."""

    def __enter__(self):
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return f"http://127.0.0.1:{s.getsockname()[1]}/v1"

    def __exit__(self, *exc):
        pass


# ---------------------------------------------------------------- OpenAI-compatible: llama.cpp's real server, killed

@pytest.fixture
def llama_server(tmp_path):
    """A llama-server that nobody restarts (the backend below gets no `recover`): an external server as in
    workers.yaml."""
    m = ServerManager(tmp_path)
    m.add_shipped(SMALL, ServerConfig(slots=1, ctx_per_slot=2048))
    m.start()
    yield m.server(SMALL).proc, m.server(SMALL).url
    m.close()


@pytest.mark.slow
def test_openai_real_server_killed_mid_run(llama_server):
    proc, url = llama_server
    retries, meter, results = [], TokenMeter(), []
    be = OpenAIBackend(url, SMALL, timeout_s=60, max_retries=3, backoff_s=0.2,
                       on_retry=lambda attempt, e, delay: retries.append((attempt, type(e).__name__, delay)))
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    c = be.chat([{"role": "user", "content": "What is 2 + 3? Reply in JSON."}],
                SamplingParams(max_tokens=32, json_schema=schema))
    assert isinstance(json.loads(c.text)["answer"], int) and c.prompt_tokens > 0 and c.backend == "openai"
    killer = threading.Timer(0.5, proc.kill)  # the server dies while the 3rd of 5 requests is generating
    t_fail = None
    with pytest.raises(BackendUnavailableError) as ei:
        for i in range(5):
            if i == 2:
                killer.start()
            t_fail = time.perf_counter()
            c = be.chat([{"role": "user", "content": f"Write a long poem about the number {i}."}],
                        SamplingParams(max_tokens=16 if i < 2 else 400, seed=i))
            meter.add("small", c)
            results.append(c)
    killer.join()
    elapsed = time.perf_counter() - t_fail
    assert 2 <= len(results) <= 3  # earlier completions are kept; the 3rd may have finished just before the kill
    for c in results[:2]:
        assert c.text and c.prompt_tokens > 0 and 0 < c.completion_tokens <= 16 and c.model == SMALL
    assert meter.totals()["by_capacity"]["small"]["calls"] == len(results)
    assert [a for a, _, _ in retries] == [1, 2, 3] and be.retries == 3
    delays = [d for _, _, d in retries]
    assert all(0.2 * 2 ** k <= d <= 0.2 * 2 ** k * 1.1 for k, d in enumerate(delays))  # exponential backoff
    assert elapsed >= sum(delays)
    assert url in str(ei.value) and "4 attempts" in str(ei.value)
    print(f"\nserver killed after {len(results)} completions; retries {retries}; failing call took {elapsed:.2f}s")
    be.close()


# ---------------------------------------------------------------- transformers

@pytest.mark.slow
def test_transformers_backend_counts_tokens(tmp_path):
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    import torch
    gguf = get_model(SMALL)
    tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # A tiny random Llama over the real tokenizer: exercises templating, generation and counting in a second, not
    # minutes.
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, eos_token_id=tok.eos_token_id,
                                   bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id)
    be = TransformersBackend(transformers.LlamaForCausalLM(cfg), "tiny-llama", tokenizer=tok, device="cpu")
    c = be.chat(MSGS, SamplingParams(max_tokens=12))
    prompt_ids = tok.apply_chat_template(MSGS, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert c.prompt_tokens == len(prompt_ids) and 0 < c.completion_tokens <= 12 and c.backend == "transformers"
    assert c.text == be.chat(MSGS, SamplingParams(max_tokens=12)).text
    assert c.text.strip() and c.finish_reason in ("stop", "length")
    hot = SamplingParams(max_tokens=12, temperature=1.0, seed=3)
    assert be.chat(MSGS, hot).text == be.chat(MSGS, hot).text
    stopped = be.chat(MSGS, SamplingParams(max_tokens=12, stop=(c.text.strip()[:3],)))
    assert stopped.finish_reason == "stop" and c.text.strip()[:3] not in stopped.text
    # the same model loaded from a directory (the path branch used by configs and policy checkpoints)
    be._model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    from_disk = TransformersBackend(tmp_path, "tiny-llama-disk", device="cpu")
    assert from_disk.chat(MSGS, SamplingParams(max_tokens=12)).text == c.text
    be.close()
    with pytest.raises(BackendUnavailableError):
        be.chat(MSGS, SamplingParams(max_tokens=2))


def test_paper_profile_pool_gets_the_yaml_client_settings(tmp_path):
    """Issue 29, finding 7: the pool the trainer builds for the paper profile (pipeline.build_pool) has
    configs/workers-paper.yaml's timeout_s / max_concurrency / max_retries / backoff_s / max_tokens, not the client's
    defaults (60 s, 4 in flight). OpenAI clients only: nothing connects until a request."""
    import inspect
    from pathlib import Path
    import yaml
    from lemon.train.config import train_preset
    from lemon.train.pipeline import build_pool
    y = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs" / "workers-paper.yaml").read_text())
    defaults = inspect.signature(OpenAIBackend).parameters
    assert y["small"]["timeout_s"] == 600 != defaults["timeout_s"].default
    assert y["small"]["max_concurrency"] == 32 != defaults["max_concurrency"].default
    pool = build_pool(train_preset("paper"))
    try:
        for cap in ("small", "medium", "large"):
            b, e = pool.backends[cap], y[cap]
            assert isinstance(b, OpenAIBackend) and (b.base_url, b.model) == (e["base_url"], e["model"])
            assert (b._timeout_s, b._client.timeout, b.max_concurrency, b.max_retries, b.backoff_s) == \
                (e["timeout_s"], e["timeout_s"], e["max_concurrency"], e["max_retries"], e["backoff_s"])
            assert pool.params[cap].max_tokens == y["max_tokens"][cap]
    finally:
        pool.close()


def test_load_worker_config_refuses_what_from_config_cannot_take(tmp_path):
    from lemon.run.workers import load_worker_config
    for bad in ("- a\n- b\n", "", "small: {backend: fake, model: f}\nmax_tokens: 5\n"):
        (tmp_path / "w.yaml").write_text(bad)
        with pytest.raises(ValueError, match="worker config|max_tokens"):
            load_worker_config(tmp_path / "w.yaml")
