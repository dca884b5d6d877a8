"""Executor: level order, concurrency, caps, skips, failures, node cache; one real-model end-to-end run (slow)."""
import hashlib
import json
import re
import threading
import time

import pytest

from lemon.benchmarks import Example, get_benchmark
from lemon.run.executor import ExecutorCaps, NodeCache, Trace, agent_seed, build_messages, execute, truncate
from lemon.prompts import default_prompts
from lemon.spec import spec_from_dict
from lemon.run.workers import BackendUnavailableError, FakeBackend, SamplingParams, TokenMeter, WorkerPool

P = default_prompts()
GSM = get_benchmark("gsm8k")
EX = Example("t/0", "gsm8k", "test", "Tom has 3 apples and buys 4 more. How many apples?", "7")


def A(aid, deps=(), cap="small", base="solver", role=None, duty="Do it."):
    return {"id": aid, "base_role": base, "role": role or f"Role {aid}", "duty": duty, "capacity": cap,
            "depends_on": list(deps)}


def spec(*agents, final=None):
    return spec_from_dict({"agents": list(agents), "final": final or agents[-1]["id"]})


def who(messages):
    """The agent id, read back from the system prompt ('You are Role <id>, ...')."""
    return re.match(r"You are Role (\S+?),", messages[0]["content"]).group(1)


def echo(messages, params):
    """Deterministic reply that depends on the whole prompt, so any upstream change changes it."""
    digest = hashlib.sha256(messages[1]["content"].encode()).hexdigest()[:8]
    return f"{who(messages)} read {digest}. Answer: 7"


def echo_by(model):
    """Like echo, but the text also names the model: a capacity change changes the output."""
    return FakeBackend(lambda m, p: f"[{model}] " + echo(m, p), model=model)


def pool_of(small, large=None, **params):
    b = {"small": small, "medium": small, "large": large or small}
    return WorkerPool(b, {c: SamplingParams(**params) for c in b})


DIAMOND = spec(A("plan"), A("a", ["plan"]), A("b", ["plan"]), A("fin", ["b", "a"], base="decider"))


def test_levels_order_context_and_answer():
    order = []

    def reply(messages, params):
        order.append(who(messages))
        return f"OUT[{who(messages)}]" + (" Answer: 7" if who(messages) == "fin" else "")

    fake = FakeBackend(reply)
    tr = execute(DIAMOND, EX, GSM, pool_of(fake), prompts=P)
    assert order[0] == "plan" and set(order[1:3]) == {"a", "b"} and order[3] == "fin"
    user = {who(c.messages): c.messages[1]["content"] for c in fake.calls}
    assert "OUT[" not in user["plan"] and EX.question in user["plan"]
    assert user["a"].index("Output of plan") >= 0 and "OUT[plan]" in user["a"]
    assert user["fin"].index("OUT[b]") < user["fin"].index("OUT[a]")  # depends_on order
    assert GSM.answer_convention in user["fin"] and GSM.answer_convention not in user["a"]
    assert tr.answer == "7" and tr.score == 1.0 and tr.error is None and not tr.budget_exceeded
    assert [a.level for a in tr.agents] == [0, 1, 1, 2]
    assert tr.tokens == tr.nominal_tokens == sum(a.prompt_tokens + a.completion_tokens for a in tr.agents) > 0
    json.dumps(tr.to_dict())


def test_messages_come_from_prompts_file():
    s = DIAMOND
    msgs = build_messages(s.agent("fin"), [("b", "Role b", "x"), ("a", "Role a", "y")], "T?", P,
                          answer_convention="CONV")
    assert msgs[0]["content"] == P.worker["system"].format(role="Role fin", base_role="decider",
                                                           base_duty=P.default_duty("decider"))
    assert "Your duty: Do it." in msgs[1]["content"] and msgs[1]["content"].endswith("CONV")


def _overlap_backend(max_concurrency, model="fake", sleep=0.15):
    state = {"active": 0, "peak": 0}
    lock = threading.Lock()

    def reply(messages, params):
        with lock:
            state["active"] += 1
            state["peak"] = max(state["peak"], state["active"])
        time.sleep(sleep)
        with lock:
            state["active"] -= 1
        return "Answer: 7"
    return FakeBackend(reply, model=model, max_concurrency=max_concurrency), state


WIDE = spec(A("w1"), A("w2"), A("w3"), A("w4", cap="large"), A("fin", ["w1", "w2", "w3", "w4"], base="decider"))


def test_level_runs_concurrently():
    fake, st = _overlap_backend(8)
    t0 = time.perf_counter()
    tr = execute(WIDE, EX, GSM, pool_of(fake), prompts=P)
    wall = time.perf_counter() - t0
    assert st["peak"] == 4 and tr.score == 1.0
    assert wall < 0.15 * 5 * 0.8  # well below the serial sum of 5 calls


def test_single_slot_backend_serializes_but_models_overlap():
    small, s1 = _overlap_backend(1, "s")
    large, s2 = _overlap_backend(1, "l")
    execute(WIDE, EX, GSM, pool_of(small, large), prompts=P)
    assert s1["peak"] == 1 and s2["peak"] == 1  # never two calls on one single-slot handle
    # ... but the small and the large model ran at the same time: the level took < serial time
    small2, _ = _overlap_backend(1, "s", sleep=0.3)
    large2, _ = _overlap_backend(1, "l", sleep=0.3)
    two = spec(A("x"), A("y", cap="large"), A("fin", ["x", "y"], base="decider"))
    t0 = time.perf_counter()
    execute(two, EX, GSM, pool_of(small2, large2), prompts=P)
    assert time.perf_counter() - t0 < 0.3 * 3 - 0.15


def test_budget_cap_stops_run():
    fake = FakeBackend("word " * 60 + "Answer: 7")
    s = spec(A("a"), A("b", ["a"]), A("fin", ["b"], base="decider"))
    tr = execute(s, EX, GSM, pool_of(fake), prompts=P, caps=ExecutorCaps(task_token_budget=50))
    assert tr.budget_exceeded and tr.answer is None and tr.score == 0.0 and tr.output == ""
    assert [a.skipped for a in tr.agents] == [False, True, True]
    assert tr.agents[1].skip_reason == "budget" and len(fake.calls) == 1
    # the final agent ran but the total is over budget: still a failure (cost counts, not just the last call)
    tr = execute(spec(A("fin", base="decider")), EX, GSM, pool_of(fake), prompts=P,
                 caps=ExecutorCaps(task_token_budget=50))
    assert tr.budget_exceeded and tr.score == 0.0 and not tr.agents[0].skipped


def test_unreachable_agents_are_skipped():
    fake = FakeBackend(echo)
    s = spec(A("a"), A("lost", ["a"]), A("fin", ["a"], base="decider"))
    tr = execute(s, EX, GSM, pool_of(fake), prompts=P)
    lost = tr.agents[1]
    assert lost.skipped and lost.skip_reason == "unreachable" and lost.prompt_tokens == 0
    assert {who(c.messages) for c in fake.calls} == {"a", "fin"} and tr.score == 1.0


def test_backend_exception_is_recorded_not_raised():
    def reply(messages, params):
        if who(messages) == "b":
            raise RuntimeError("boom")
        return "Answer: 7"
    tr = execute(DIAMOND, EX, GSM, pool_of(FakeBackend(reply)), prompts=P)
    assert "'b'" in tr.error and "RuntimeError: boom" in tr.error and tr.score == 0.0 and tr.answer is None
    by = {a.id: a for a in tr.agents}
    assert not by["a"].skipped and by["b"].skip_reason == "error" and by["fin"].skip_reason == "error"


def test_backend_unavailable_propagates():
    def reply(messages, params):
        raise BackendUnavailableError("server is dead")
    with pytest.raises(BackendUnavailableError, match="dead"):
        execute(DIAMOND, EX, GSM, pool_of(FakeBackend(reply)), prompts=P)


def test_caps_clip_tokens_seeds_and_context():
    fake = FakeBackend(lambda m, p: "x" * 5000 if who(m) == "a" else "Answer: 7")
    s = spec(A("a"), A("fin", ["a"], base="decider"))
    caps = ExecutorCaps(max_tokens={"small": 10}, max_context_chars=300)
    meter = TokenMeter()
    tr = execute(s, EX, GSM, pool_of(fake, max_tokens=256), prompts=P, caps=caps, seed=3, meter=meter)
    assert all(c.params.max_tokens == 10 for c in fake.calls)
    assert [c.params.seed for c in fake.calls] == [agent_seed(3, "a"), agent_seed(3, "fin")]
    assert agent_seed(3, "a") != agent_seed(4, "a") != agent_seed(3, "fin")
    fin_user = fake.calls[1].messages[1]["content"]
    assert "characters cut" in fin_user and "x" * 301 not in fin_user
    assert meter.totals()["total"]["total_tokens"] == tr.nominal_tokens and caps.max_tokens["large"] == 512
    assert len(truncate("y" * 1000, 300)) <= 300


def test_caps_validation_and_too_many_agents():
    for bad in ({"max_agents": 0}, {"max_agents": 9}, {"max_tokens": {"huge": 5}}, {"max_tokens": {"small": 0}},
                {"task_token_budget": 0}, {"max_context_chars": 10}):
        with pytest.raises(ValueError):
            ExecutorCaps(**bad)
    hash(ExecutorCaps())
    fake = FakeBackend()
    tr = execute(DIAMOND, EX, GSM, pool_of(fake), prompts=P, caps=ExecutorCaps(max_agents=3))
    assert "max_agents=3" in tr.error and tr.score == 0 and not fake.calls
    assert Trace.empty(error="invalid spec").to_dict()["error"] == "invalid spec"


# ---- node cache ------------------------------------------------------------------------------------------------------
CHAIN = [A("a"), A("b", ["a"]), A("c", ["a", "b"]), A("fin", ["c"], base="decider")]


def _ran(fake_s, fake_l, start_s=0, start_l=0):
    return sorted(who(c.messages) for c in fake_s.calls[start_s:] + fake_l.calls[start_l:])


def test_cache_unchanged_spec_is_free():
    fake = FakeBackend(echo)
    cache = NodeCache()
    s = spec(*CHAIN)
    t1 = execute(s, EX, GSM, pool_of(fake), prompts=P, cache=cache)
    t2 = execute(s, EX, GSM, pool_of(fake), prompts=P, cache=cache)
    assert len(fake.calls) == 4 and t2.cache_hits == 4 and t2.tokens == 0 and t2.worker_latency_s == 0
    assert t2.nominal_tokens == t1.nominal_tokens == t1.tokens and t2.output == t1.output and t2.score == t1.score
    assert cache.stats() == {"hits": 4, "misses": 4, "hit_rate": 0.5, "entries": 4, "evictions": 0}
    t3 = execute(s, EX, GSM, pool_of(fake), prompts=P, cache=cache, seed=1)  # another seed is another sample
    assert t3.cache_hits == 0


def test_cache_capacity_edit_reruns_only_that_agent_and_descendants():
    small, large = echo_by("s"), echo_by("l")
    cache = NodeCache()
    base = spec(*CHAIN)
    execute(base, EX, GSM, pool_of(small, large), prompts=P, cache=cache)
    n = len(small.calls)
    # final agent upgraded: only it re-runs
    edited = spec(*CHAIN[:3], {**CHAIN[3], "capacity": "large"})
    tr = execute(edited, EX, GSM, pool_of(small, large), prompts=P, cache=cache)
    assert _ran(small, large, n, 0) == ["fin"] and tr.cache_hits == 3
    assert tr.tokens == tr.agents[3].prompt_tokens + tr.agents[3].completion_tokens
    # leaf b (feeds c) upgraded: b re-runs on the large model, then c and fin (their context changed)
    n, m = len(small.calls), len(large.calls)
    edited = spec(CHAIN[0], {**CHAIN[1], "capacity": "large"}, *CHAIN[2:])
    tr = execute(edited, EX, GSM, pool_of(small, large), prompts=P, cache=cache)
    assert (_ran(small, large, n, m) == ["b", "c", "fin"]
            and [a.cache_hit for a in tr.agents] == [True, False, False, False])
    # keys are content-addressed: if the re-run agent writes the same text as before, its descendants still hit
    s2, l2, cache = FakeBackend(echo, model="s"), FakeBackend(echo, model="l"), NodeCache()
    execute(base, EX, GSM, pool_of(s2, l2), prompts=P, cache=cache)
    tr = execute(edited, EX, GSM, pool_of(s2, l2), prompts=P, cache=cache)
    assert [who(c.messages) for c in l2.calls] == ["b"] and tr.cache_hits == 3


def test_cache_dropped_edge_reruns_only_k_and_descendants():
    fake = FakeBackend(echo)
    cache = NodeCache()
    execute(spec(*CHAIN), EX, GSM, pool_of(fake), prompts=P, cache=cache)
    n = len(fake.calls)
    edited = spec(CHAIN[0], CHAIN[1], {**CHAIN[2], "depends_on": ["b"]}, CHAIN[3])  # drop a -> c
    tr = execute(edited, EX, GSM, pool_of(fake), prompts=P, cache=cache)
    assert sorted(who(c.messages) for c in fake.calls[n:]) == ["c", "fin"]
    assert [a.cache_hit for a in tr.agents] == [True, True, False, False]
    assert tr.nominal_tokens > tr.tokens > 0


def test_disk_cache_survives_new_instance(tmp_path):
    path = tmp_path / "sub" / "cache.jsonl"
    fake = FakeBackend(echo)
    s = spec(*CHAIN)
    t1 = execute(s, EX, GSM, pool_of(fake), prompts=P, cache=NodeCache(path=path))
    with open(path, "a") as f:
        f.write('{"v": 1, "key": "torn')  # a writer killed mid-line
    cache = NodeCache(path=path)
    t2 = execute(s, EX, GSM, pool_of(fake), prompts=P, cache=cache)
    assert len(fake.calls) == 4 and t2.cache_hits == 4 and t2.tokens == 0 and t2.nominal_tokens == t1.nominal_tokens
    assert t2.agents[0].latency_s == t1.agents[0].latency_s
    execute(spec(*CHAIN[:3], {**CHAIN[3], "duty": "Decide."}), EX, GSM, pool_of(fake), prompts=P, cache=cache)
    assert len(NodeCache(path=path)) == 5  # the entry appended after the torn line is readable


# ---- real model ------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_real_model_cot_and_chain_end_to_end():
    from lemon.eval.baselines import baseline_spec
    from lemon.benchmarks import load
    caps = ("small", "medium", "large")  # one managed llama-server shared by all capacities (identical entries)
    pool = WorkerPool.from_config({**{c: {"backend": "llama_server", "model": "smollm2-135m", "slots": 2,
                                          "ctx_per_slot": 2048}
                                      for c in caps}, "max_tokens": {c: 64 for c in caps}})
    cache = NodeCache()
    try:
        for ex in load("gsm8k", "test", limit=2):
            for s in (baseline_spec("cot", "math"), baseline_spec("chain", "math", n_agents=3)):
                tr = execute(s, ex, GSM, pool, prompts=P, cache=cache)
                assert tr.error is None and not tr.budget_exceeded, tr.error
                assert all(a.prompt_tokens > 0 and a.completion_tokens > 0 and a.model == "smollm2-135m"
                           for a in tr.agents)
                assert tr.tokens == tr.nominal_tokens > 0 and tr.score in (0.0, 1.0)
                assert tr.answer is None or re.fullmatch(r"-?[\d.]+", tr.answer)
                again = execute(s, ex, GSM, pool, prompts=P, cache=cache)
                assert again.cache_hits == len(s.agents) and again.tokens == 0
                assert again.nominal_tokens == tr.nominal_tokens and again.output == tr.output
    finally:
        pool.close()


def test_node_cache_is_bounded_in_memory_and_on_disk(tmp_path):
    """Issue 11 defect 10: LRU eviction past max_entries, the file compacted at 2 x max_entries lines, reload keeps the
    newest."""
    from lemon.run.workers import Completion
    path = tmp_path / "cache.jsonl"
    c = NodeCache(path=path, max_entries=3)
    comp = lambda i: Completion(f"out{i}", 1, 1, 0.0, "m", "fake")  # noqa: E731
    for i in range(4):
        c.put(f"k{i}", comp(i))
    assert len(c) == 3 and c.get("k0") is None and c.get("k3").text == "out3" and c.stats()["evictions"] == 1
    assert c.get("k1").text == "out1"  # k1 becomes the most recently used: k2 is evicted next
    c.put("k4", comp(4))
    assert c.get("k2") is None and c.get("k1") is not None
    for i in range(5, 9):  # 5 lines so far; the 7th line triggers a compaction to the live entries
        c.put(f"k{i}", comp(i))
    lines = path.read_text().splitlines()
    assert len(lines) <= 2 * 3
    again = NodeCache(path=path, max_entries=3)
    assert sorted(again._mem) == sorted(c._mem) and again.get("k8").text == "out8"
    st = c.stats()
    assert st["hit_rate"] == st["hits"] / (st["hits"] + st["misses"])
    with pytest.raises(ValueError, match="max_entries"):
        NodeCache(max_entries=0)
