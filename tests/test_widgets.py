"""Spec inspector, headless: build it, drive the controls programmatically, check what it renders and keeps."""
import hashlib
import io
import warnings

import pytest
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure

from lemon.benchmarks import Example, get_benchmark
from lemon.train.edits import eligible_sites
from lemon.run.executor import NodeCache, execute
from lemon.prompts import CAPACITIES, default_prompts
from lemon.spec import Agent, Spec, spec_from_dict
from lemon.study.widgets import CAPACITY_COLORS, SpecInspector, agents_table, draw_spec
from lemon.run.workers import FakeBackend, SamplingParams, WorkerPool

P = default_prompts()
GSM = get_benchmark("gsm8k")
EX = Example("t/0", "gsm8k", "test", "Tom has 2 apples and gets 3 more. How many apples?", "5")
SPEC = spec_from_dict({"agents": [
    {"id": "plan", "base_role": "planner", "role": "Planner", "duty": "Plan it.", "capacity": "small"},
    {"id": "solve", "base_role": "solver", "role": "Solver", "duty": "Add them up.", "capacity": "medium",
     "depends_on": ["plan"]},
    {"id": "fin", "base_role": "decider", "role": "Decider", "duty": "Give the answer.", "capacity": "large",
     "depends_on": ["plan", "solve"]}], "final": "fin"})


def fake_pool():
    """One fake per capacity, named after it; replies hash the whole prompt, so any upstream change changes them."""
    def backend(cap):
        def reply(messages, params):
            h = hashlib.sha256(repr(messages).encode()).hexdigest()[:8]
            final = GSM.answer_convention in messages[1]["content"]
            return f"[{cap}] {h} " + ("so the total is five. Answer: 5" if final else "some work")
        return FakeBackend(reply, model=f"fake-{cap}")
    b = {c: backend(c) for c in CAPACITIES}
    return WorkerPool(b, {c: SamplingParams(max_tokens=64) for c in b})


def inspector(spec=SPEC, **kw):
    return SpecInspector(spec, EX, GSM, fake_pool(), prompts=P, **kw)


def n_calls(insp):
    return sum(len(b.calls) for b in insp.pool.backends.values())


def fields(spec):
    return {(a.id, f): getattr(a, f) for a in spec.agents
            for f in ("base_role", "role", "duty", "capacity", "depends_on")}


def changed(a, b):
    fa, fb = fields(a), fields(b)
    return {k for k in fa if fa[k] != fb[k]}


def test_builds_headless_and_renders():
    insp = inspector()
    assert insp.current == insp.original == SPEC and insp.widget.children
    assert insp.family.options == ("edge", "role", "capacity")
    assert [v for _, v in insp.site.options] == eligible_sites(SPEC, "edge", P) and insp.site.value == ("solve", "plan")
    for out, key in ((insp.graph_out, "graph"), (insp.table_out, "table"), (insp.result_out, "result")):
        assert out.outputs[0]["data"]["text/html"] == insp.last_html[key]
    assert insp.last_html["graph"].startswith("<img src='data:image/png;base64,")
    assert all(f">{a}" in insp.last_html["table"] for a in ("plan", "solve", "fin (final)"))
    assert isinstance(insp.last_figure, Figure) and n_calls(insp) == 0  # nothing runs before Run


def test_site_dropdown_refreshes_on_family_change():
    insp = inspector()
    insp.family.value = "role"
    assert [v for _, v in insp.site.options] == [("plan",), ("solve",), ("fin",)] and insp.target.disabled
    insp.family.value = "capacity"  # any level may be set, so small agents are sites too
    assert [v for _, v in insp.site.options] == [("plan",), ("solve",), ("fin",)] and not insp.target.disabled
    assert insp.site.value == ("plan",) and insp.target.options == ("medium", "large") and insp.target.value == "medium"
    insp.site.value = ("fin",)  # large: default is m_L, one level lower
    assert insp.target.options == ("small", "medium") and insp.target.value == "medium"
    insp.family.value = "edge"
    assert [v for _, v in insp.site.options] == [("solve", "plan"), ("fin", "plan"), ("fin", "solve")]
    assert insp.target.disabled


def test_edge_edit_changes_exactly_that_field_then_run_hits_cache():
    insp = inspector()
    insp.family.value, insp.site.value = "edge", ("fin", "plan")
    insp.apply_button.click()
    assert insp.last_error is None and changed(insp.original, insp.current) == {("fin", "depends_on")}
    assert (insp.current.agent("fin").depends_on == ("solve",)
            and insp.original.agent("fin").depends_on == ("plan", "solve"))
    assert ("fin", "plan") not in [v for _, v in insp.site.options]  # sites follow the current spec
    assert "background:#fff3b0" in insp.last_html["table"] and "edge: drop plan → fin" in insp.last_html["result"]
    insp.run_button.click()
    s = insp.last_summary
    assert insp.last_error is None and s["cache_hit_ids"] == ["plan", "solve"] and s["recomputed_ids"] == ["fin"]
    assert n_calls(insp) == 4  # the original's 3 agents, then only the edited one
    assert s["answer"] == "5" and s["score"] == 1.0 and s["original"]["answer"] == "5"
    o, c = insp.orig_trace, insp.cur_trace
    assert s["delta_tokens"] == c.nominal_tokens - o.nominal_tokens < 0  # fin no longer reads plan's output
    assert s["tokens"] == c.agents[2].total_tokens and s["reward"] > s["original"]["reward"]
    assert s["delta_reward"] == pytest.approx(s["reward"] - s["original"]["reward"])
    res = insp.last_html["result"]
    assert f"{s['delta_tokens']:+d}" in res and "cache hits 2: plan, solve" in res and "Answer: 5" in res
    assert ("hit" in insp.last_html["table"]
            and "cached" in " ".join(t.get_text() for t in insp.last_figure.axes[0].texts))


def test_capacity_edit_any_level_and_role_edit():
    insp = inspector()
    insp.family.value = "capacity"
    insp.site.value, insp.target.value = ("plan",), "large"  # raising is allowed, not only m_L
    insp.apply_button.click()
    assert changed(insp.original,
                   insp.current) == {("plan", "capacity")} and insp.current.agent("plan").capacity == "large"
    s = insp.run()
    assert s["cache_hits"] == 0 and s["recomputed_ids"] == ["plan", "solve", "fin"]  # the root changed: all downstream
    assert insp.cur_trace.agents[0].model == "fake-large" and "large" in insp.cur_trace.agents[0].output
    insp.reset_button.click()
    insp.family.value, insp.site.value = "role", ("solve",)
    insp.apply_button.click()
    assert changed(insp.original, insp.current) == {("solve", "duty")}
    assert insp.current.agent("solve").duty == P.default_duty("solver")
    s = insp.run()
    assert s["cache_hit_ids"] == ["plan"] and s["recomputed_ids"] == ["solve", "fin"]


def test_reset_returns_to_original_and_rerun_is_free():
    insp = inspector()
    insp.family.value, insp.site.value = "edge", ("solve", "plan")
    insp.apply_button.click()
    insp.run_button.click()
    insp.reset_button.click()
    assert insp.current == insp.original and insp.cur_trace is None and insp.last_summary is None and not insp.edits
    assert [v for _, v in insp.site.options] == eligible_sites(SPEC, "edge", P)
    calls = n_calls(insp)
    s = insp.run()
    assert n_calls(insp) == calls and s["cache_hits"] == 3 and s["tokens"] == 0
    assert s["delta_tokens"] == 0 and s["delta_reward"] == 0 and s["nominal_tokens"] == insp.orig_trace.nominal_tokens


def test_shared_cache_passed_in_and_code_built_spec():
    cache = NodeCache()
    pool = fake_pool()
    execute(SPEC, EX, GSM, pool, prompts=P, cache=cache)  # warm the cache outside the inspector
    bare = Spec(SPEC.agents, SPEC.final)  # no text / spans: the inspector parses its canonical YAML
    insp = SpecInspector(bare, EX, GSM, pool, prompts=P, cache=cache, seed=0)
    assert insp.original.text is not None and insp.original == SPEC
    assert insp.run()["cache_hits"] == 3 and insp.orig_trace.tokens == 0


def test_errors_in_callbacks_are_shown_not_raised():
    one = spec_from_dict({"agents": [{"id": "solo", "base_role": "solver", "role": "Solo", "duty": "Solve it.",
                                      "capacity": "small"}]})
    insp = inspector(one)
    assert insp.site.options == () and insp.site.value is None
    insp.apply_button.click()  # no edge to drop
    assert isinstance(insp.last_error, ValueError) and "no edge edit" in insp.last_html["result"]
    assert insp.result_out.outputs[0]["data"]["text/html"] == insp.last_html["result"]
    with pytest.raises(ValueError):
        insp.apply_edit()  # called directly, it raises


def test_draw_spec_a_lone_agent_is_a_box_not_a_sliver():
    """A trained policy that writes one agent (the cpu main job's) was drawn as a tall sliver with its label spilling
    out, and constrained layout gave up ('axes sizes collapsed to zero'): the figure is legend-wide and the aspect
    equal."""
    one = spec_from_dict({"agents": [{"id": "a1", "base_role": "solver", "role": "Solving the problem step by step",
                                      "duty": "Solve it.", "capacity": "large"}]})
    fig = draw_spec(one)
    fig.suptitle("lemon · multiarith multiarith/test/173 · correct=True · 240 tok", fontsize=9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fig.savefig(io.BytesIO(), format="png")
    box = next(p for p in fig.axes[0].patches if p.get_gid() == "agent:a1").get_window_extent()
    assert box.width > 2 * box.height  # BOX_W / BOX_H = 1.5 / 0.62 in data units


def test_draw_spec_one_node_per_agent_coloured_by_capacity():
    s = spec_from_dict({"agents": [
        {"id": "a", "base_role": "planner", "role": "A", "duty": "x", "capacity": "small"},
        {"id": "idle", "base_role": "critic", "role": "Idle", "duty": "x", "capacity": "medium", "depends_on": ["a"]},
        {"id": "b", "base_role": "solver", "role": "B", "duty": "x", "capacity": "medium", "depends_on": ["a"]},
        {"id": "c", "base_role": "decider", "role": "C", "duty": "x", "capacity": "large", "depends_on": ["a", "b"]}],
        "final": "c"})
    fig = draw_spec(s)
    ax = fig.axes[0]
    nodes = {p.get_gid()[6:]: p for p in ax.patches if (p.get_gid() or "").startswith("agent:")}
    assert set(nodes) == {"a", "idle", "b", "c"} and len(ax.patches) == len(nodes) + len(s.edges())
    for a in s.agents:
        assert nodes[a.id].get_facecolor()[:3] == pytest.approx(to_rgba(CAPACITY_COLORS[a.capacity])[:3])
    assert nodes["idle"].get_facecolor()[3] < 1 and nodes["idle"].get_linestyle() == "--"  # unreachable: faded, dashed
    assert nodes["c"].get_linewidth() > nodes["b"].get_linewidth()  # final outlined
    assert {t.get_text() for t in ax.get_legend().get_texts()} >= set(CAPACITIES)
    assert nodes["a"].get_x() < nodes["b"].get_x() < nodes["c"].get_x()  # x = level
    tr = execute(s, EX, GSM, fake_pool(), prompts=P)
    fig2 = draw_spec(s, ax=Figure().add_subplot(), trace=tr)
    texts = [t.get_text() for t in fig2.axes[0].texts]
    assert "skipped (unreachable)" in texts and sum(t.endswith(" tok") for t in texts) == 3


def test_agents_table_escapes_html():
    evil = "<script>alert(1)</script> & <b>"
    s = Spec((Agent("x", "solver", "R<1>", evil, "small"),), "x")
    h = agents_table(s)
    assert "<script>" not in h and "&lt;script&gt;alert(1)&lt;/script&gt; &amp; &lt;b&gt;" in h and "R&lt;1&gt;" in h
    s2 = spec_from_dict({"agents": [{"id": "x", "base_role": "solver", "role": "R", "duty": "d", "capacity": "small"}]})
    tr = execute(s2, EX, GSM, WorkerPool({c: FakeBackend(evil + " Answer: 5") for c in CAPACITIES}), prompts=P)
    h = agents_table(s2, tr)
    assert "<script>" not in h and "&lt;script&gt;" in h and ">miss<" in h


@pytest.mark.slow
def test_real_model_inspector_run():
    from lemon.benchmarks import load
    # one managed llama-server for every capacity (identical entries share it)
    pool = WorkerPool.from_config({**{c: {"backend": "llama_server", "model": "smollm2-135m", "slots": 2,
                                          "ctx_per_slot": 2048}
                                      for c in CAPACITIES}, "max_tokens": {c: 24 for c in CAPACITIES}})
    try:
        insp = SpecInspector(SPEC, load("gsm8k", "test")[0], GSM, pool, prompts=P)
        insp.family.value, insp.site.value = "edge", ("fin", "plan")
        insp.apply_button.click()
        insp.run_button.click()
        s = insp.last_summary
        assert insp.last_error is None and s["error"] is None, insp.last_html["result"]
        assert s["cache_hit_ids"] == ["plan", "solve"] and s["recomputed_ids"] == ["fin"]
        assert all(a.model == "smollm2-135m" and a.completion_tokens > 0 for a in insp.cur_trace.agents)
        assert s["tokens"] == insp.cur_trace.agents[2].total_tokens > 0
        assert insp.cur_trace.agents[2].prompt_tokens < insp.orig_trace.agents[2].prompt_tokens  # plan's output is gone
        assert f"{s['delta_tokens']:+d}" in insp.last_html["result"]
    finally:
        pool.close()
