"""Spec inspector: one spec on one question, drawn, tabulated, edited one field at a time and re-executed with the node
cache.

`draw_spec` and `agents_table` are plain functions (a matplotlib Figure, an HTML string) so notebooks and reports can
use them without widgets. `SpecInspector` wires them to ipywidgets. Everything it renders is also kept on the object
(`last_html`, `last_figure`, `last_summary`), and its Output widgets are filled by assigning `Output.outputs` directly
rather than with `with out: display(...)`: that works headless (tests, scripts) without an IPython kernel, where
`display` would print instead.
"""
from __future__ import annotations

import base64
import html
import io

import ipywidgets as W
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Patch

from lemon.train.edits import FAMILIES, REGISTRY, apply_edit as _apply_edit, eligible_sites
from lemon.run.executor import ExecutorCaps, NodeCache, Trace, execute
from lemon.prompts import CAPACITIES, Prompts
from lemon.train.rewards import RewardConfig, compute_reward
from lemon.spec import MAX_AGENTS, Spec, parse_spec

# Okabe-Ito colours (colour-blind safe), cheap -> strong reads light blue -> orange -> red.
CAPACITY_COLORS = {"small": "#56B4E9", "medium": "#E69F00", "large": "#D55E00"}
UNKNOWN_COLOR = "#999999"
DEAD_ALPHA = 0.3  # face alpha of unreachable agents: they are never executed
BOX_W, BOX_H, DX = 1.5, 0.62, 2.3  # node box size and level spacing, in data units


def _short(s: str, n: int) -> str:
    return s if len(s) <= n else s[:n - 1] + "…"


def draw_spec(spec: Spec, ax=None, trace: Trace | None = None) -> Figure:
    """Draw the DAG left to right by topological level. Node boxes carry gid "agent:<id>" (one per agent, so callers and
    tests can find them among the arrows); face colour = capacity, thick outline = final, faded + dashed = unreachable.
    With a trace, each node is annotated with its tokens and cache hit. Uses a bare Figure (not pyplot) so no global
    figure registry leaks."""
    levels = spec.levels()
    if ax is None:
        # at least legend-wide (5 entries); equal aspect below keeps a lone box from being squeezed into a sliver
        fig = Figure(figsize=(max(4.8, 1.0 + 2.2 * len(levels)), 1.3 + 0.95 * max(map(len, levels))),
                     layout="constrained")
        ax = fig.add_subplot()
    fig = ax.figure
    pos = {aid: (x * DX, (len(lvl) - 1) / 2 - i) for x, lvl in enumerate(levels) for i, aid in enumerate(lvl)}
    dead, runs = set(spec.unreachable()), {t.id: t for t in (trace.agents if trace else [])}
    boxes = {}
    for a in spec.agents:
        (x, y), is_dead, is_final = pos[a.id], a.id in dead, a.id == spec.final
        box = FancyBboxPatch((x - BOX_W / 2, y - BOX_H / 2), BOX_W, BOX_H, boxstyle="round,pad=0.03",
                             facecolor=to_rgba(CAPACITY_COLORS.get(a.capacity, UNKNOWN_COLOR),
                                               DEAD_ALPHA if is_dead else 1),
                             edgecolor="black" if is_final else "#555555", linewidth=2.8 if is_final else 1.0,
                             linestyle="--" if is_dead else "-", zorder=2)
        box.set_gid(f"agent:{a.id}")
        ax.add_patch(box)
        boxes[a.id] = box
        ax.text(x, y, f"{a.id}\n{_short(a.role, 20)}", ha="center", va="center", fontsize=8, zorder=3,
                color="#777777" if is_dead else "black")
        t = runs.get(a.id)
        if t is not None:
            note = (f"skipped ({t.skip_reason})" if t.skipped
                    else f"{t.total_tokens} tok" + (" · cached" if t.cache_hit else ""))
            ax.text(x, y - BOX_H / 2 - 0.06, note, ha="center", va="top", fontsize=7, zorder=3)
    lvl_of = {aid: x for x, lvl in enumerate(levels) for aid in lvl}
    for parent, child in spec.edges():
        far = lvl_of[child] - lvl_of[parent] > 1  # bend edges that skip a level so they do not run through boxes
        ax.add_patch(FancyArrowPatch(pos[parent], pos[child], patchA=boxes[parent], patchB=boxes[child],
                                     arrowstyle="-|>", mutation_scale=11,
                                     color="#aaaaaa" if child in dead else "#333333", zorder=1,
                                     connectionstyle=f"arc3,rad={0.25 if far else 0}"))
    ax.set_xlim(-BOX_W / 2 - 0.2, (len(levels) - 1) * DX + BOX_W / 2 + 0.2)
    top = (max(map(len, levels)) - 1) / 2
    ax.set_ylim(-top - BOX_H / 2 - 0.35, top + BOX_H / 2 + 0.1)
    ax.set_aspect("equal", adjustable="box")
    ax.axis("off")
    handles = [Patch(facecolor=CAPACITY_COLORS[c], edgecolor="#555555", label=c) for c in CAPACITIES]
    handles += [Patch(facecolor="white", edgecolor="black", linewidth=2.8, label="final"),
                Patch(facecolor="white", edgecolor="#555555", linestyle="--", label="unreachable")]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0), ncol=5, fontsize=7, frameon=False)
    if trace is not None:
        ax.set_title(f"answer {trace.answer} · score {trace.score:g} · {trace.nominal_tokens} tok "
                     f"({trace.tokens} spent, {trace.cache_hits} cache hits)", fontsize=8)
    return fig


def agents_table(spec: Spec, trace: Trace | None = None, base: Spec | None = None, excerpt: int = 160) -> str:
    """HTML table of the agents (every value escaped: duties and outputs are model-written text). With `trace`: tokens,
    cache hit and an output excerpt per agent. With `base` (the original spec): cells that differ from it are
    highlighted."""
    e = html.escape
    runs = {t.id: t for t in (trace.agents if trace else [])}
    orig = {a.id: a for a in (base.agents if base else [])}
    dead = set(spec.unreachable())
    cols = (["id", "base_role", "role", "duty", "capacity", "depends_on"]
            + (["tokens", "cache", "output"] if trace else []))
    rows = ["<table class='lemon-agents' style='border-collapse:collapse;font-size:90%'>",
            "<tr>" + "".join(f"<th style='text-align:left;padding:2px 6px'>{c}</th>" for c in cols) + "</tr>"]
    for a in spec.agents:
        cells = []
        for f in cols[:6]:
            v = getattr(a, f)
            shown = ", ".join(v) or "—" if f == "depends_on" else v
            if f == "id":
                shown += " (final)" if a.id == spec.final else " (unreachable)" if a.id in dead else ""
            was = getattr(orig[a.id], f) if a.id in orig else v
            mark = f" style='background:#fff3b0' title='was: {e(', '.join(was) if f == 'depends_on' else was)}'" \
                if was != v else ""
            cells.append(f"<td{mark}>{e(shown)}</td>")
        if trace:
            t = runs.get(a.id)
            if t is None or t.skipped:
                cells += [f"<td>skipped{e(f' ({t.skip_reason})') if t else ''}</td>", "<td>—</td>", "<td></td>"]
            else:
                cells += [f"<td>{t.total_tokens}</td>", f"<td>{'hit' if t.cache_hit else 'miss'}</td>",
                          f"<td>{e(_short(t.output.strip(), excerpt))}</td>"]
        rows.append("<tr style='border-top:1px solid #ddd;vertical-align:top'>" + "".join(cells) + "</tr>")
    return "\n".join(rows + ["</table>"])


def _figure_html(fig: Figure) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    return f"<img src='data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}'/>"


def _show(out: W.Output, html_text: str) -> None:
    # Replacing `outputs` is what `clear_output` + `display` amount to, minus the need for a running kernel.
    out.outputs = ({"output_type": "display_data", "data": {"text/html": html_text, "text/plain": "[html]"},
                    "metadata": {}},)


class SpecInspector:
    """Inspect `spec` on `example`: apply single-field edits to `.current`, Run to execute original and current with one
    NodeCache (unchanged agents hit the cache), compare answer / reward / tokens. Edits accumulate until `reset()`; each
    one is a single-field change of the spec it was applied to, so the first edit after a reset is exactly one paper
    edit."""

    def __init__(self, spec: Spec, example, benchmark, pool, *, prompts: Prompts, cache: NodeCache | None = None,
                 caps: ExecutorCaps | None = None, reward_cfg: RewardConfig | None = None, seed: int = 0):
        self.prompts, self.example, self.benchmark, self.pool, self.seed = prompts, example, benchmark, pool, seed
        # Edits rewrite the spec's text at its spans; a spec built in code gets its canonical text first.
        has_text = spec.text is not None and spec.spans is not None
        self.original = spec if has_text else self._parse(spec.to_yaml(), len(spec.agents))
        self.current = self.original
        self.cache = cache if cache is not None else NodeCache()
        self.caps, self.reward_cfg = caps or ExecutorCaps(), reward_cfg or RewardConfig()
        self.orig_trace: Trace | None = None
        self.cur_trace: Trace | None = None
        self.orig_reward = None
        self.edits: list[str] = []  # descriptions of the edits applied since the last reset
        self.last_summary: dict | None = None
        self.last_error: Exception | None = None
        self.last_html = {"graph": "", "table": "", "result": ""}
        self.last_figure: Figure | None = None
        self.family = W.Dropdown(options=list(FAMILIES), value=FAMILIES[0], description="edit")
        self.site = W.Dropdown(options=[], description="site")
        self.target = W.Dropdown(options=[], description="set to", disabled=True)  # a family's target value
        self.apply_button = W.Button(description="Apply edit", button_style="warning")
        self.reset_button = W.Button(description="Reset")
        self.run_button = W.Button(description="Run", button_style="primary")
        self.graph_out, self.table_out, self.result_out = W.Output(), W.Output(), W.Output()
        self.family.observe(lambda _: self._refresh_sites(), names="value")
        self.site.observe(lambda _: self._refresh_target(), names="value")
        self.apply_button.on_click(lambda _: self._guard(self.apply_edit))
        self.reset_button.on_click(lambda _: self._guard(self.reset))
        self.run_button.on_click(lambda _: self._guard(self.run))
        q = html.escape(_short(example.question, 400))
        header = W.HTML(f"<b>{html.escape(benchmark.name)} · {html.escape(example.id)}</b>: {q}")
        self.widget = W.VBox([header, W.HBox([self.family, self.site, self.target]),
                              W.HBox([self.apply_button, self.reset_button, self.run_button]),
                              self.graph_out, self.table_out, self.result_out])
        self._refresh_sites()
        self._render("Original spec. Choose an edit, or press Run.")

    # ---- edits -------------------------------------------------------------------------------------------------------
    def _parse(self, text: str, n_agents: int) -> Spec:
        return parse_spec(text, base_roles=self.prompts.roles_for(None), max_agents=max(n_agents, MAX_AGENTS))

    def _sites(self, family: str) -> list[tuple[str, ...]]:
        if REGISTRY[family].target:  # any value may be chosen, so every executed agent is a site (m_L skips small ones)
            dead = set(self.current.unreachable())
            return [(a.id,) for a in self.current.agents if a.id not in dead]
        return eligible_sites(self.current, family, self.prompts)

    def _label(self, family: str, site: tuple[str, ...]) -> str:
        return REGISTRY[family].describe(self.current, site)

    def _refresh_sites(self) -> None:
        fam = self.family.value
        self.site.options = [(self._label(fam, s), s) for s in self._sites(fam)]
        self.site.value = self.site.options[0][1] if self.site.options else None
        self.target.disabled = not REGISTRY[fam].target
        self._refresh_target()

    def _refresh_target(self) -> None:
        f, site = REGISTRY[self.family.value], self.site.value
        if not f.target or site is None:
            return
        cur = getattr(self.current.agent(site[0]), f.target)
        self.target.options = [v for v in f.target_values if v != cur]  # a no-op choice is not offered
        if site in eligible_sites(self.current, f.name, self.prompts):  # default: the family's own edit
            self.target.value = getattr(_apply_edit(self.current, f.name, site, self.prompts).spec.agent(site[0]),
                                        f.target)
        else:
            self.target.value = self.target.options[0]

    def apply_edit(self) -> Spec:
        """Apply the edit chosen in the controls to `.current` (through lemon.train.edits; a family with a target field,
        like capacity, rewrites that value at its span, which allows any of its values). Returns the new current
        spec."""
        fam, site, cur = self.family.value, self.site.value, self.current
        if site is None:
            raise ValueError(f"no {fam} edit is possible on the current spec")
        field = REGISTRY[fam].target
        if field:
            old, new = getattr(cur.agent(site[0]), field), self.target.value
            if new == old:
                raise ValueError(f"{site[0]} already has {field} {new}")
            s0, s1 = getattr(cur.spans[cur.index(site[0])], field)
            spec = self._parse(cur.text[:s0] + new + cur.text[s1:], len(cur.agents))
            desc = f"{field} of {site[0]}: {old} → {new}"
        else:
            spec = _apply_edit(cur, fam, site, self.prompts).spec
            desc = f"{fam}: {self._label(fam, site)}"
        self.current, self.cur_trace, self.last_summary = spec, None, None
        self.edits.append(desc)
        self._refresh_sites()
        self._render(f"Applied: {desc}. Press Run to re-execute.")
        return spec

    def reset(self) -> None:
        """Back to the original spec (the cache and the original's trace are kept: rerunning it is free)."""
        self.current, self.cur_trace, self.last_summary, self.edits = self.original, None, None, []
        self._refresh_sites()
        self._render("Reset to the original spec.")

    # ---- execution ---------------------------------------------------------------------------------------------------
    def _execute(self, spec: Spec) -> Trace:
        return execute(spec, self.example, self.benchmark, self.pool, prompts=self.prompts, cache=self.cache,
                       caps=self.caps, seed=self.seed)

    def run(self) -> dict:
        """Execute the original (once; later runs reuse its trace) and the current spec with the same cache, then
        compare. Rewards use nominal tokens (as in training), so the deltas do not depend on how warm the cache was."""
        if self.orig_trace is None:
            self.orig_trace = self._execute(self.original)
            self.orig_reward = compute_reward(self.original, self.orig_trace.score, self.orig_trace.nominal_tokens,
                                              self.reward_cfg)
        tr = self.cur_trace = self._execute(self.current)
        rw = compute_reward(self.current, tr.score, tr.nominal_tokens, self.reward_cfg)
        o, orw = self.orig_trace, self.orig_reward
        self.last_summary = {
            "answer": tr.answer, "score": tr.score, "reward": rw.total, "error": tr.error,
            "reward_terms": {"success": rw.success, "token_efficiency": rw.token_efficiency,
                             "graph_cost": rw.graph_cost},
            "tokens": tr.tokens, "nominal_tokens": tr.nominal_tokens,
            "delta_reward": rw.total - orw.total, "delta_tokens": tr.nominal_tokens - o.nominal_tokens,
            "cache_hits": tr.cache_hits, "cache_hit_ids": [a.id for a in tr.agents if a.cache_hit],
            "recomputed_ids": [a.id for a in tr.agents if not a.cache_hit and not a.skipped],
            "original": {"answer": o.answer, "score": o.score, "reward": orw.total, "nominal_tokens": o.nominal_tokens},
            "edits": list(self.edits)}
        self._render()
        return self.last_summary

    # ---- rendering ---------------------------------------------------------------------------------------------------
    def _summary_html(self) -> str:
        s, e = self.last_summary, html.escape
        o = s["original"]
        rows = [("answer", o["answer"], s["answer"], ""), ("score", f"{o['score']:g}", f"{s['score']:g}", ""),
                ("reward", f"{o['reward']:.4f}", f"{s['reward']:.4f}", f"{s['delta_reward']:+.4f}"),
                ("tokens (nominal)", o["nominal_tokens"], s["nominal_tokens"], f"{s['delta_tokens']:+d}")]
        out = ["<table style='font-size:90%'><tr><th></th><th>original</th><th>current</th><th>Δ</th></tr>"]
        out += [f"<tr><td>{k}</td><td>{e(str(a))}</td><td>{e(str(b))}</td><td>{d}</td></tr>" for k, a, b, d in rows]
        out.append("</table>")
        t = s["reward_terms"]
        out.append(f"<p>reward terms: success {t['success']:g}, token efficiency "
                   f"{t['token_efficiency']:.4f}, graph cost {t['graph_cost']:.4f}. This run spent {s['tokens']} "
                   f"tokens; cache hits {s['cache_hits']}: {e(', '.join(s['cache_hit_ids']) or 'none')}; recomputed: "
                   f"{e(', '.join(s['recomputed_ids']) or 'none')}.</p>")
        if s["error"]:
            out.append(f"<p style='color:#b00'>error: {e(s['error'])}</p>")
        for a in self.cur_trace.agents:  # each agent's full output, folded
            tag = "skipped" if a.skipped else "cache hit" if a.cache_hit else f"{a.total_tokens} tok"
            out.append(f"<details><summary>{e(a.id)} ({tag})</summary><pre style='white-space:pre-wrap'>"
                       f"{e(a.output)}</pre></details>")
        return "\n".join(out)

    def _render(self, note: str = "") -> None:
        self.last_figure = draw_spec(self.current, trace=self.cur_trace)
        self.last_html["graph"] = _figure_html(self.last_figure)
        self.last_html["table"] = agents_table(self.current, self.cur_trace, base=self.original)
        parts = [f"<p><i>{html.escape(note)}</i></p>"] if note else []
        if self.edits:
            parts.append("<p>edits: " + html.escape("; ".join(self.edits)) + "</p>")
        if self.last_summary is not None:
            parts.append(self._summary_html())
        self.last_html["result"] = "\n".join(parts)
        for out, key in ((self.graph_out, "graph"), (self.table_out, "table"), (self.result_out, "result")):
            _show(out, self.last_html[key])

    def _guard(self, fn) -> None:
        # Button callbacks: ipywidgets only logs exceptions raised there, so show them in the result area instead.
        try:
            fn()
            self.last_error = None
        except Exception as exc:  # noqa: BLE001 - displayed and kept on the object
            self.last_error = exc
            self.last_html["result"] = f"<p style='color:#b00'>{html.escape(f'{type(exc).__name__}: {exc}')}</p>"
            _show(self.result_out, self.last_html["result"])

    def display(self):
        from IPython.display import display
        display(self.widget)
        return self.widget

    def _ipython_display_(self):
        self.display()
