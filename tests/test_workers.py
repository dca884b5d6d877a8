"""Worker backends and pool: the real 135M model through llama.cpp (in-process and behind its OpenAI-compatible server,
killed mid-run), a stub HTTP server for the OpenAI error paths, transformers, the fake double, the pool and the meter."""
import dataclasses
import http.server
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from lemon.run.models import get_model
from lemon.run.workers import (BackendError, BackendUnavailableError, Completion, FakeBackend, LlamaCppBackend,
                           ModelUnavailableError, OpenAIBackend, SamplingParams, TokenMeter, TransformersBackend,
                           UnknownCapacityError, WorkerPool)

SMALL = "smollm2-135m"  # never the 1.5B here: tests must stay fast on 2 cores
MSGS = [{"role": "user", "content": "What is 2 + 3? Reply with one short sentence."}]


@pytest.fixture(scope="module")
def small():
    b = LlamaCppBackend.shipped(SMALL, n_ctx=2048)
    yield b
    b.close()


# ---------------------------------------------------------------- SamplingParams / Completion

def test_sampling_params_validate_and_key():
    p = SamplingParams(stop=["\n", "END"], json_schema={"type": "object"})
    assert p.stop == ("\n", "END") and hash(p) == hash(SamplingParams(stop=("\n", "END"), json_schema={"type": "object"}))
    assert json.loads(p.key())["stop"] == ["\n", "END"] and p.key() == dataclasses.replace(p).key()
    assert SamplingParams(seed=1).key() != SamplingParams(seed=2).key()
    for bad in (dict(max_tokens=0), dict(max_tokens=1.5), dict(temperature=-0.1), dict(temperature=2.5),
                dict(top_p=0), dict(top_p=1.2), dict(seed=-1), dict(stop="\n"), dict(stop=("",)), dict(json_schema="{}")):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    assert Completion("x", 3, 4, 0.1, "m", "fake").total_tokens == 7


# ---------------------------------------------------------------- llama.cpp in-process, real 135M model

@pytest.mark.slow
def test_llama_chat_usage_and_determinism(small):
    p = SamplingParams(max_tokens=24)
    c = small.chat(MSGS, p)
    assert c.text.strip() and c.backend == "llama_cpp" and c.model == SMALL and c.finish_reason in ("stop", "length")
    assert 0 < c.completion_tokens <= 24 and c.latency_s > 0
    # usage is the backend's own count: the prompt is the chat-templated messages, the completion retokenizes to it
    llm = small._llm
    assert c.prompt_tokens > len(llm.tokenize(MSGS[0]["content"].encode(), add_bos=False))
    assert abs(c.completion_tokens - len(llm.tokenize(c.text.encode(), add_bos=False))) <= 1
    longer = small.chat([{**MSGS[0], "content": MSGS[0]["content"] + " Be brief."}], p)
    assert longer.prompt_tokens - c.prompt_tokens == len(llm.tokenize(b" Be brief.", add_bos=False))
    again = small.chat(MSGS, p)
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
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}, "reason": {"type": "string", "maxLength": 40}},
              "required": ["answer", "reason"], "additionalProperties": False}
    c = small.chat([{"role": "user", "content": "What is 2 + 3? Reply in JSON."}],
                   SamplingParams(max_tokens=64, json_schema=schema))
    obj = json.loads(c.text)
    assert set(obj) == {"answer", "reason"} and isinstance(obj["answer"], int) and isinstance(obj["reason"], str)


@pytest.mark.slow
def test_llama_threads_are_serialized(small):
    p = SamplingParams(max_tokens=16)
    prompts = [[{"role": "user", "content": f"Name a colour. ({i})"}] for i in range(4)]
    want = [small.chat(m, p).text for m in prompts]
    got, errors = [None] * 4, []

    def work(i):
        try:
            got[i] = small.chat(prompts[i], p).text
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)
    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and got == want


@pytest.mark.slow
def test_llama_unavailable(tmp_path):
    with pytest.raises(BackendUnavailableError, match="does not exist"):
        LlamaCppBackend(tmp_path / "nope.gguf", "nope")
    b = LlamaCppBackend.shipped(SMALL, n_ctx=512)
    b.close()
    with pytest.raises(BackendUnavailableError, match="closed"):
        b.chat(MSGS, SamplingParams(max_tokens=4))
    assert issubclass(ModelUnavailableError, BackendUnavailableError)


@pytest.mark.slow
def test_llama_prompt_too_long_is_backend_error():
    b = LlamaCppBackend.shipped(SMALL, n_ctx=256)
    try:
        with pytest.raises(BackendError, match="exceed context window") as ei:
            b.chat([{"role": "user", "content": "word " * 1000}], SamplingParams(max_tokens=4))
        assert not isinstance(ei.value, BackendUnavailableError)
    finally:
        b.close()


@pytest.mark.slow
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
    bad = [({"small": {"backend": "vllm", "model": "x"}}, r"valid: \['llama_cpp', 'openai', 'transformers', 'fake'\]"),
           ({"small": {"backend": "openai", "model": "x"}}, "base_url"),
           ({"small": {"model": "x"}}, "'backend'"),
           ({"small": "llama_cpp"}, "mapping"),
           ({"small": {"backend": "llama_cpp", "model": "no-such-model"}}, "neither a shipped model"),
           ({"small": {"backend": "fake", "model": "a"}, "max_tokens": {"large": 3}}, "not in the config"),
           ({}, "no capacities"), ([], "mapping")]
    for cfg, msg in bad:
        with pytest.raises(ValueError, match=msg):
            WorkerPool.from_config(cfg)


@pytest.mark.slow
def test_embedded_default_shares_backends_for_repeated_models():
    pool = WorkerPool.embedded_default({"small": SMALL, "medium": SMALL}, max_tokens={"medium": 12}, n_ctx=1024)
    try:
        assert pool.backends["small"] is pool.backends["medium"]
        assert pool.params["small"].max_tokens == 256 and pool.params["medium"].max_tokens == 12
        assert pool.describe()["medium"]["backend"] == "llama_cpp" and pool.model_of("medium") == SMALL
        c = pool.chat("medium", MSGS)
        assert c.text and c.completion_tokens <= 12
    finally:
        pool.close()


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

class _Stub(http.server.BaseHTTPRequestHandler):
    script: list = []  # (status, body) per request, consumed in order

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        status, body = self.script.pop(0)
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

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


# ---------------------------------------------------------------- OpenAI-compatible: llama.cpp's real server, killed

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def llama_server(tmp_path):
    pytest.importorskip("llama_cpp.server.app", reason="llama-cpp-python[server] extra not installed")
    port, log = _free_port(), open(tmp_path / "server.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", str(get_model(SMALL)),
                             "--model_alias", SMALL, "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "2048"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while True:  # bounded readiness poll
            if proc.poll() is not None:
                pytest.fail(f"llama_cpp.server exited: {(tmp_path / 'server.log').read_text()[-2000:]}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2).read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail("llama_cpp.server not ready after 90 s")
                time.sleep(0.5)
        yield proc, f"http://127.0.0.1:{port}/v1"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        log.close()


@pytest.mark.slow
def test_openai_real_server_killed_mid_run(llama_server):
    proc, url = llama_server
    retries, meter, results = [], TokenMeter(), []
    be = OpenAIBackend(url, SMALL, timeout_s=60, max_retries=3, backoff_s=0.2, json_mode="json_object",
                       on_retry=lambda attempt, e, delay: retries.append((attempt, type(e).__name__, delay)))
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    c = be.chat([{"role": "user", "content": "What is 2 + 3? Reply in JSON."}], SamplingParams(max_tokens=32, json_schema=schema))
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
    # A tiny random Llama over the real tokenizer: exercises templating, generation and counting in a second, not minutes.
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


@pytest.mark.slow
def test_embedded_pool_uses_every_core_and_one_cpu_lock():
    """llama-cpp-python defaults to cpu_count // 2 threads (1 on a 2-core box); the pool uses all usable cores and
    serializes in-process decodes of different models on one lock so they never oversubscribe the CPU."""
    from lemon.run.backends import usable_cores
    pool = WorkerPool.from_config({"small": {"backend": "llama_cpp", "model": "smollm2-135m"},
                                   "large": {"backend": "llama_cpp", "model": "smollm2-135m", "n_ctx": 2048}})
    try:
        s, l = pool.backends["small"], pool.backends["large"]
        assert s is not l  # two handles (different n_ctx) ...
        assert s._lock is l._lock  # ... one CPU lock
        assert s.n_threads == l.n_threads == usable_cores() == pool.describe()["small"]["n_threads"]
    finally:
        pool.close()
