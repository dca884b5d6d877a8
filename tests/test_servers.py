"""Managed llama-servers (lemon.run.servers) on the real 135M model: lifecycle, usage, constrained output, a crash with
requests in flight, no orphans however lemon ends, the embedded-default pool, and the paper profile's
one-server-per-capacity configuration (configs/workers-paper.yaml) with llama-server stand-ins, one of them killed
mid-run."""
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from lemon.benchmarks import Example, get_benchmark
from lemon.eval.baselines import baseline_spec
from lemon.prompts import default_prompts
from lemon.run.executor import execute
from lemon.run.models import get_model
from lemon.run.servers import (ModelUnavailableError, PortInUseError, ServerBinaryNotFoundError, ServerConfig,
                               ServerCrashedError, ServerManager, find_binary)
from lemon.run.workers import BackendUnavailableError, SamplingParams, TokenMeter, WorkerPool

ROOT = Path(__file__).resolve().parents[1]
SMALL = "smollm2-135m"  # the only model these tests start: a server loads it in ~1 s
MSGS = [{"role": "user", "content": "What is 2 + 3? Reply with one short sentence."}]
CFG = ServerConfig(slots=4, ctx_per_slot=1024, threads=1)


def _post(url: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(url.removesuffix("/v1") + path, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def _gone(pid: int, within_s: float = 15.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:  # a zombie child of ours counts as gone once reaped
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return True
        except ChildProcessError:
            pass
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def manager(tmp_path_factory):
    m = ServerManager(tmp_path_factory.mktemp("servers"))
    m.add_shipped(SMALL, CFG)
    m.start()
    yield m
    m.close()


def test_missing_binary_model_and_port_are_named_errors(tmp_path):
    with pytest.raises(ServerBinaryNotFoundError, match="scripts/setup.sh"):
        ServerManager(tmp_path, binary=tmp_path / "no-llama-server")
    find_binary()  # setup.sh built it: the suite needs it
    m = ServerManager(tmp_path)
    try:
        with pytest.raises(ModelUnavailableError, match="does not exist"):
            m.add("ghost", tmp_path / "ghost.gguf")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            s.listen()
            with pytest.raises(PortInUseError, match="in use"):
                m.add(SMALL, get_model(SMALL), ServerConfig(port=s.getsockname()[1]))
        assert isinstance(PortInUseError("x"), BackendUnavailableError)  # the executor stops on it, never scores 0
    finally:
        m.close()
    with pytest.raises(ValueError, match="slots"):
        ServerConfig(slots=0)


@pytest.mark.slow
def test_health_usage_json_schema_and_logs(manager):
    b = manager.backend(SMALL)
    assert b.max_concurrency == CFG.slots and b.backend == "llama_server"
    with urllib.request.urlopen(b.base_url.removesuffix("/v1") + "/health", timeout=5) as r:
        assert json.loads(r.read())["status"] == "ok"
    p = SamplingParams(max_tokens=24)
    c = b.chat(MSGS, p)
    assert (c.text.strip() and 0 < c.completion_tokens <= 24 and c.model == SMALL
            and c.finish_reason in ("stop", "length"))
    # usage is the server's own count of the chat-templated prompt, also when the prompt came from the slot's cache
    templated = _post(b.base_url, "/apply-template", {"messages": MSGS})["prompt"]
    n_prompt = len(_post(b.base_url, "/tokenize", {"content": templated, "add_special": True})["tokens"])
    again = b.chat(MSGS, p)
    assert c.prompt_tokens == again.prompt_tokens == n_prompt and again.text == c.text  # greedy: same text
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    j = b.chat([{"role": "user", "content": "What is 2 + 3? Reply in JSON."}],
               SamplingParams(max_tokens=32, json_schema=schema))
    assert isinstance(json.loads(j.text)["answer"], int)
    d = manager.describe()[SMALL]
    assert d["config"]["slots"] == CFG.slots and "sdist_sha256=" in d["build"] and d["restarts"] == 0
    assert "--parallel 4" in Path(d["log"]).read_text()  # the log holds our command line and the server's own output
    b.close()


@pytest.mark.slow
def test_crash_restarts_once_and_in_flight_requests_are_retried(tmp_path):
    with ServerManager(tmp_path) as m:
        m.add_shipped(SMALL, CFG)
        m.start()
        b = m.backend(SMALL, extra_body={"top_k": 0, "min_p": 0.0, "ignore_eos": True})
        p = SamplingParams(max_tokens=160)
        want = [b.chat([{"role": "user", "content": f"Count to {i}."}], p) for i in range(4)]  # undisturbed answers
        first_pid = m.server(SMALL).proc.pid
        threading.Timer(1.0, os.kill, (first_pid, signal.SIGKILL)).start()  # dies while all four are decoding
        with ThreadPoolExecutor(4) as tp:
            got = list(tp.map(lambda i: b.chat([{"role": "user", "content": f"Count to {i}."}], p), range(4)))
        assert m.server(SMALL).restarts == 1 and m.server(SMALL).proc.pid != first_pid  # one restart for four failures
        assert b.recoveries >= 1 and b.retries >= 1
        for w, g in zip(want, got):  # every in-flight request was re-sent and counted once, with the server's usage
            assert g.prompt_tokens == w.prompt_tokens and g.completion_tokens == 160
        assert "restart 1" in (tmp_path / f"{SMALL}.log").read_text()
        new_pid = m.server(SMALL).proc.pid
    assert _gone(new_pid)


@pytest.mark.slow
def test_restart_budget_is_bounded(tmp_path):
    with ServerManager(tmp_path) as m:
        m.add_shipped(SMALL, ServerConfig(slots=1, ctx_per_slot=1024, max_restarts=0))
        m.start()
        b = m.backend(SMALL, backoff_s=0.01)
        m.server(SMALL).proc.kill()
        with pytest.raises(ServerCrashedError, match="max_restarts"):
            b.chat(MSGS, SamplingParams(max_tokens=4))


_CHILD = textwrap.dedent("""
    import signal, sys, time
    from lemon.run.servers import ServerConfig, ServerManager
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C semantics even if started with SIGINT ignored
    m = ServerManager(sys.argv[1])
    m.add_shipped("smollm2-135m", ServerConfig(slots=1, ctx_per_slot=1024))
    m.start()
    print(m.server("smollm2-135m").proc.pid, flush=True)
    if sys.argv[2] == "exit":
        sys.exit(0)
    time.sleep(600)
""")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["exit", "SIGINT", "SIGTERM", "SIGKILL"])
def test_no_orphan_server_however_lemon_ends(tmp_path, how):
    """Normal exit (atexit), Ctrl-C (KeyboardInterrupt), SIGTERM and SIGKILL of lemon (PR_SET_PDEATHSIG) all take the
    server with them."""
    p = subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path), how], cwd=ROOT, stdout=subprocess.PIPE,
                         text=True)
    pid = int(p.stdout.readline())
    if how != "exit":
        os.kill(p.pid, getattr(signal, how))
    p.wait(timeout=60)
    assert _gone(pid), f"llama-server {pid} outlived lemon ({how})"


@pytest.mark.slow
def test_embedded_default_pool_owns_one_server_per_model(tmp_path):
    pool = WorkerPool.embedded_default({"small": SMALL, "medium": SMALL}, max_tokens={"medium": 12}, server=CFG,
                                       log_dir=tmp_path)
    try:
        assert pool.backends["small"] is pool.backends["medium"] and list(pool.servers.servers) == [SMALL]
        d = pool.describe()["medium"]
        assert d["backend"] == "llama_server" and d["model"] == SMALL and d["server"]["log"].startswith(str(tmp_path))
        c = pool.chat("medium", MSGS)
        assert c.text and c.completion_tokens <= 12
        pid = pool.servers.server(SMALL).proc.pid
    finally:
        pool.close()
    assert _gone(pid)
    with pytest.raises(ValueError, match="unknown keys"):
        WorkerPool.from_config({"small": {"backend": "llama_server", "model": SMALL, "n_threads": 2}})


@pytest.mark.slow
def test_paper_profile_one_server_per_capacity_one_killed(tmp_path):
    """configs/workers-paper.yaml as shipped (three openai entries, one base_url per capacity), pointed at three
    llama-server stand-ins serving the 135M model under the paper's model names; concurrent agents on all three; then
    one server dies: its capacity raises BackendUnavailableError (after the documented retries), the others keep
    answering."""
    cfg = yaml.safe_load((ROOT / "configs" / "workers-paper.yaml").read_text())
    caps = ("small", "medium", "large")
    assert {cfg[c]["backend"] for c in caps} == {"openai"} and len({cfg[c]["base_url"] for c in caps}) == 3
    with ServerManager(tmp_path) as m:
        for c in caps:
            m.add(cfg[c]["model"], get_model(SMALL), CFG)
        m.start()
        for c in caps:
            cfg[c] = {**cfg[c], "base_url": m.server(cfg[c]["model"]).url, "max_retries": 2, "backoff_s": 0.05}
        cfg["max_tokens"] = {c: 24 for c in caps}  # the paper's 1024-token replies would only cost time here
        pool = WorkerPool.from_config(cfg)
        try:
            assert [pool.model_of(c) for c in caps] == [cfg[c]["model"] for c in caps]
            ex, bench, P = Example("t/0", "gsm8k", "test", "Tom has 3 apples and buys 4 more. How many?", "7"), \
                get_benchmark("gsm8k"), default_prompts()
            d = baseline_spec("tree", "math", n_agents=4, capacity="small").to_dict()
            for i, ag in enumerate(d["agents"]):  # leaves on small / medium / large: three servers at once
                ag["capacity"] = caps[i % 3]
            from lemon.spec import spec_from_dict
            spec, meter = spec_from_dict(d), TokenMeter()
            with ThreadPoolExecutor(3) as tp:  # three questions at once, as `lemon eval --concurrency 3` runs them
                traces = list(tp.map(lambda s: execute(spec, ex, bench, pool, prompts=P, seed=s, meter=meter),
                                     range(3)))
            assert all(t.error is None and t.tokens > 0 for t in traces)
            assert meter.totals()["total"]["total_tokens"] == sum(t.tokens for t in traces)
            assert {c for c in caps if meter.totals()["by_capacity"].get(c, {}).get("calls")} == set(caps)
            m.server(cfg["large"]["model"]).proc.kill()  # nobody restarts an external server: lemon must not score it
            m.server(cfg["large"]["model"]).proc.wait()
            with pytest.raises(BackendUnavailableError, match="3 attempts"):
                execute(spec, ex, bench, pool, prompts=P, seed=9)
            assert pool.chat("small", MSGS, max_tokens=8).completion_tokens > 0
        finally:
            pool.close()


@pytest.mark.slow
def test_deterministic_workers_reply_alike_whatever_is_in_flight():
    """TrainConfig.deterministic_workers (issue 30) end to end on the real server: the pool the trainer builds sends one
    request at a time with the prompt cache off, and a greedy request repeated among 8 concurrent callers (other
    questions interleaved) gets the reply it gets alone, every time. The non-deterministic rate this removes is
    measured, not asserted (bench/flip_rate.py: 11 of 20 flipped at 8 in flight on the 0.5B, LOG.md 2026-12-05): it
    depends on the CPU."""
    from lemon.train.config import train_preset
    from lemon.train.pipeline import build_pool
    with pytest.raises(ValueError, match="llama-server workers"):
        build_pool(train_preset("smoke", deterministic_workers=True,
                                workers={c: {"backend": "openai", "model": "m", "base_url": "http://127.0.0.1:9/v1"}
                                         for c in ("small", "medium", "large")}))
    cfg = train_preset("smoke", deterministic_workers=True)
    with build_pool(cfg) as pool:
        b = pool.backends["small"]
        assert b.max_concurrency == 1 and b.extra_body.get("cache_prompt") is False
        params = SamplingParams(max_tokens=48, temperature=0.0, seed=0)
        ask = lambda q: b.chat([{"role": "user", "content": q}], params).text  # noqa: E731
        gsm = [e.question for e in get_benchmark("gsm8k").load("train", limit=7)]
        alone = ask(gsm[0])
        jobs = [q for i in range(6) for q in (gsm[0], gsm[1 + i])]
        with ThreadPoolExecutor(max_workers=8) as ex:
            replies = list(ex.map(ask, jobs))
    assert replies[0::2] == [alone] * 6
