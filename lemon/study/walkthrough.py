"""One CF-GRPO step of the study's trainer taken apart on REAL objects, for notebooks/02_train_grpo_lora.ipynb (its
cells call these functions; each returns what the cell displays).

The policy after its SFT warm start, the study's worker pool, and the trainer's own parts: grammar sampling
(lemon.policy.rollout.sample_specs), the scorer with its node cache (lemon.train.scoring.SpecScorer: execute, reward,
one counterfactual edit per rollout), the edits (lemon.train.edits), the span map (lemon.train.spanmap), the advantages
from the one function lemon.train.grpo.CFGRPOMixin calls (lemon.train.cf.rollout_advantages: step_advantages, then
grammar-forced tokens zeroed), and one AdamW step on TRL's loss at its on-policy point (ratio 1, beta 0):
    loss = -(1/N) sum_i sum_t exp(logp_{i,t} - sg(logp_{i,t})) A_{i,t},   N = completion tokens of the batch ("dapo").
Unlike a TRL step: one question (G rollouts), the walk-through's own sampling seed, an fp32 loss (no bf16 autocast),
one prompt forward shared by the G rollouts, and no dynamic resampling of a flat group. It works on its own copy of the
policy and an in-memory node cache: nothing it does reaches the training run that follows it in the notebook.
"""
from __future__ import annotations

import difflib
import gc
import html
import random
from dataclasses import dataclass, field

import pandas as pd
import torch
from matplotlib.figure import Figure

from lemon import benchmarks as B
from lemon.eval.orchestrator import orchestrator_messages
from lemon.policy.dtype import merged_copy
from lemon.policy.model import load_policy
from lemon.policy.rollout import GrammarConstraint, sample_specs
from lemon.run.executor import ExecutorCaps, NodeCache, Trace, build_messages, execute
from lemon.report import advantage_heatmaps, tokens_html as report_tokens_html
from lemon.spec import parse_spec
from lemon.train.cf import advantage_parts, note_forced
from lemon.train.config import TrainConfig
from lemon.train.edits import REGISTRY, Edit, EditError, FamilySampler, apply_edit, eligible_sites, sample_edit
from lemon.train.pipeline import sample_dtype_for, training_examples
from lemon.train.rewards import compute_reward
from lemon.train.scoring import SpecScorer, edit_seed
from lemon.train.spanmap import span_positions

ADAM = dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)  # the HF Trainer's AdamW defaults (TRL passes them on)
MAX_GRAD_NORM = 1.0  # the HF Trainer's default clip


@dataclass
class Walk:
    """One question's CF-GRPO step: config, pool, policy, question, the trainer's scorer, and what each stage filled."""

    cfg: TrainConfig
    prompts: object
    pool: object
    model: object
    tok: object
    example: object  # lemon.benchmarks.Example, from a TRAIN pool
    messages: list[dict]
    scorer: SpecScorer
    step: int = 0
    samples: list = field(default_factory=list)  # lemon.policy.rollout.Sample, G of them
    recs: list = field(default_factory=list)  # lemon.train.scoring.Rollout, one per sample
    traces: list = field(default_factory=list)  # lemon.run.executor.Trace per rollout (None: invalid spec)
    edits: list = field(default_factory=list)  # the Edit the scorer applied to each rollout (None: none)

    @property
    def bench(self):
        return B.get_benchmark(self.example.benchmark)

    def decode(self, ids) -> str:
        """Exactly how the trainer decodes sampled ids (SpecRollouts.decode)."""
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def spec(self, i: int):
        """Sample i parsed (SpecError when it does not parse, e.g. cut at max_completion_length)."""
        return parse_spec(self.samples[i].text, base_roles=self.prompts.roles_for(self.bench.domain),
                          max_agents=self.cfg.max_agents)


def setup(cfg: TrainConfig, prompts, pool, adapter: str | None, question: int = 0) -> Walk:
    """The policy (base + `adapter`, e.g. the SFT warm start) and the training run's `question`-th TRAIN-pool question,
    with a SpecScorer built as lemon.train.pipeline._train builds it (node cache in memory)."""
    model, tok = load_policy(cfg.policy, adapter=adapter, seed=cfg.seed)
    ex = training_examples(cfg)[question]
    caps = ExecutorCaps(max_agents=cfg.max_agents, max_tokens=dict(cfg.worker_max_tokens),
                        task_token_budget=cfg.task_token_budget)
    scorer = SpecScorer(pool, prompts, {ex.id: ex}, {b: B.get_benchmark(b) for b in B.BENCHMARKS}, reward=cfg.reward,
                        caps=caps, cache=NodeCache(), sampler=FamilySampler(floor=cfg.family_floor),
                        cf_lambda=cfg.cf_lambda, families=cfg.cf_families, max_agents=cfg.max_agents, seed=cfg.seed,
                        concurrency=cfg.rollout_concurrency, worker_seed_per_step=cfg.worker_seed_per_step)
    msgs = orchestrator_messages(ex.question, B.get_benchmark(ex.benchmark).domain, prompts, cfg.max_agents)
    return Walk(cfg, prompts, pool, model, tok, ex, msgs, scorer)


def prompt_text(walk: Walk, head: int = 1500, tail: int = 400) -> str:
    """The orchestrator prompt as the policy reads it (chat template applied), its middle cut when long."""
    t = walk.tok.apply_chat_template(walk.messages, add_generation_prompt=True, tokenize=False)
    return t if len(t) <= head + tail else f"{t[:head]}\n[... {len(t) - head - tail} characters ...]\n{t[-tail:]}"


def sample(walk: Walk, seed: int | None = None) -> pd.DataFrame:
    """G = num_generations specs for the question in one batched call, under the training grammar when the config
    samples constrained, in the dtype the trainer samples in (a bf16 choice: a merged bf16 copy of the policy);
    fills walk.samples. One row per sample."""
    c, model, dtype = walk.cfg, walk.model, sample_dtype_for(walk.cfg)
    if dtype.startswith("bf16_"):  # SpecRollouts' bf16_merged / bf16_copy: the same weights in bf16
        model, dtype = merged_copy(model, torch.bfloat16), "model"
    con = GrammarConstraint(c.grammar(walk.prompts, walk.bench.domain)) if c.constrained else None
    walk.samples = sample_specs(model, walk.tok, [walk.messages], n=c.num_generations, temperature=c.temperature,
                                max_new_tokens=c.max_completion_length, seed=c.seed if seed is None else seed,
                                constraint=con, dtype=dtype)
    return pd.DataFrame([{"tokens": s.n_tokens, "forced": sum(s.forced), "finished": s.finished,
                          "agents": s.text.count("- id:")} for s in walk.samples]).rename_axis("i")


def score(walk: Walk) -> pd.DataFrame:
    """SpecScorer.score, as the trainer's rollout function calls it: parse, execute with the worker pool through the
    node cache, reward; fills walk.recs (with the grammar-forced positions: lemon.train.cf.note_forced) and
    walk.traces (each spec read again through the cache: every agent a hit, the very outputs that were scored)."""
    s0 = walk.scorer.cache.stats()
    walk.recs = walk.scorer.score([(walk.example.id, s.text, s.token_ids, 0, 0) for s in walk.samples], walk.step)
    note_forced(walk.recs, walk.samples)
    sc = walk.scorer
    walk.traces = [execute(walk.spec(i), walk.example, walk.bench, walk.pool, prompts=walk.prompts, cache=sc.cache,
                           caps=sc.caps, seed=sc.exec_seed(walk.step)) if r.valid else None
                   for i, r in enumerate(walk.recs)]
    s1 = walk.scorer.cache.stats()
    print(f"worker calls {s1['misses'] - s0['misses']:.0f}, node-cache hits while scoring and replaying "
          f"{s1['hits'] - s0['hits']:.0f}")
    return reward_table(walk)


def reward_table(walk: Walk) -> pd.DataFrame:
    """Per rollout: the answer, its score s and the reward's parts as the scorer recorded them, and `recomputed`:
    compute_reward called again on the parsed spec and its trace (it must equal `reward`)."""
    rows = []
    for i, (r, tr) in enumerate(zip(walk.recs, walk.traces)):
        again = (compute_reward(walk.spec(i), tr.score, tr.nominal_tokens, walk.cfg.reward,
                                errored=tr.error is not None) if tr is not None
                 else compute_reward(None, 0.0, 0, walk.cfg.reward)).total
        rows.append({"valid": r.valid, "agents": r.agents, "edges": r.edges, "answer": tr.answer if tr else None,
                     "gold": walk.example.gold, "s": r.reward.success, "worker tokens": r.reward.worker_tokens,
                     "eff": r.reward.token_efficiency, "g": r.reward.graph_cost, "reward": r.total,
                     "recomputed": again})
    return pd.DataFrame(rows).rename_axis("i")


def agent_io_html(walk: Walk, i: int, chars: int = 1200) -> str:
    """Rollout i's execution, agent by agent in spec order: the chat messages the executor built for it
    (lemon.run.executor.build_messages, from its parents' recorded outputs) and the worker's reply."""
    spec, tr, out = walk.spec(i), walk.traces[i], []
    outputs = {a.id: a.output for a in tr.agents if not a.skipped}
    cut = lambda s: html.escape(s if len(s) <= chars else s[:chars] + f" [... {len(s) - chars} characters]")  # noqa: E731
    for a, at in zip(spec.agents, tr.agents):
        head = (f"<b>{a.id}</b> ({a.base_role}, {a.capacity} = {at.model}, level {at.level}, depends on "
                f"{list(a.depends_on) or 'nothing'}{', FINAL' if a.id == spec.final else ''})")
        if at.skipped:
            out.append(f"<p>{head}: skipped ({at.skip_reason})</p>")
            continue
        parents = [(d, spec.agent(d).role, outputs[d]) for d in a.depends_on]
        msgs = build_messages(a, parents, walk.example.question, walk.prompts,
                              answer_convention=walk.bench.answer_convention if a.id == spec.final else None,
                              max_context_chars=walk.scorer.caps.max_context_chars)
        body = "".join(f"<i>{m['role']}</i>:\n{cut(m['content'])}\n" for m in msgs)
        out.append(f"<p>{head}: {at.prompt_tokens} prompt + {at.completion_tokens} completion tokens</p><pre style="
                   f'"white-space:pre-wrap;font-size:11px">{body}<i>reply</i>:\n<b>{cut(at.output)}</b></pre>')
    return (f"<p><b>rollout {i}</b>: answer {tr.answer!r} (gold {walk.example.gold!r}), score {tr.score}, "
            f"{tr.nominal_tokens} worker tokens, error {tr.error}</p>" + "".join(out))


def counterfactuals(walk: Walk) -> pd.DataFrame:
    """SpecScorer.add_counterfactuals, exactly as in training: per valid rollout a family from the adaptive sampler,
    a site uniformly, y' executed through the node cache, delta = r(y) - r(y'), S_i mapped onto the sampled tokens.
    Fills walk.edits (each edit drawn again with the scorer's RNG, to show its site); one row per rollout."""
    sc = walk.scorer
    probs = sc.sampler.probs()  # read before add_counterfactuals updates it: what the edits were drawn with
    sc.add_counterfactuals(walk.recs, walk.step, walk.decode)
    walk.edits, rows = [], []
    for i, r in enumerate(walk.recs):
        e = sample_edit(walk.spec(i), walk.prompts, random.Random(edit_seed(sc.seed, walk.step, i)), probs,
                        families=sc.families) if r.family else None
        if e is not None and e.family != r.family:
            raise RuntimeError(f"rollout {i}: re-drawn edit {e.family} differs from the scorer's {r.family}")
        walk.edits.append(e)
        rows.append({"status": r.cf_status, "family": REGISTRY[e.family].label if e else None,
                     "p(family)": probs[e.family] if e else None,
                     "site": REGISTRY[e.family].describe(walk.spec(i), e.site) if e else "",
                     "edited value": r.text[e.span[0]:e.span[1]] if e else "", "r(y)": r.total,
                     "r(y')": r.total - r.delta if r.delta is not None else None, "delta": r.delta,
                     "|S_i|": len(r.span_positions), "cf tokens spent": r.cf_tokens_spent,
                     "cf tokens nominal": r.cf_tokens_nominal})
    return pd.DataFrame(rows).rename_axis("i")


def pick(walk: Walk) -> int:
    """The rollout to look at: the first with a non-zero contrast, else the first with an edit, else the first valid."""
    return next((i for i, r in enumerate(walk.recs) if r.delta), next(
        (i for i, e in enumerate(walk.edits) if e), next((i for i, r in enumerate(walk.recs) if r.valid), 0)))


@dataclass
class FamilyCF:
    """One family's counterfactual of one rollout: the edit, y' executed, delta and the edited tokens S_i."""

    family: str
    site: tuple | None
    edit: Edit | None
    trace: Trace | None
    reward: float | None  # r(y')
    delta: float | None  # r(y) - r(y')
    positions: tuple[int, ...] = ()  # S_i
    note: str = ""

    def diff(self, original: str) -> str:
        """The unified diff y_i -> y_i' (no context lines)."""
        return "".join(difflib.unified_diff(original.splitlines(True), self.edit.text.splitlines(True), "y_i", "y_i'",
                                            n=0)) if self.edit else ""


def family_edits(walk: Walk, i: int) -> list[FamilyCF]:
    """Every allowed family's edit of rollout i (the scorer's site for the family it drew, the first eligible site for
    the others), each executed by the scorer through the node cache (agents not downstream of the edit are hits)."""
    r, drawn, out = walk.recs[i], walk.edits[i] if walk.edits else None, []
    if not r.valid or r.errored:  # no counterfactual in training either
        return out
    spec = walk.spec(i)
    for f in walk.scorer.families:
        sites = eligible_sites(spec, f, walk.prompts)
        site = drawn.site if drawn is not None and drawn.family == f else sites[0] if sites else None
        e, note = None, "no eligible site"
        try:
            e = apply_edit(spec, f, site, walk.prompts) if site else None
        except EditError as err:  # the scorer's status "edit_error"
            note = f"edit error: {err}"
        if e is None:
            out.append(FamilyCF(f, site, None, None, None, None, note=note))
            continue
        tr, rw = walk.scorer._execute(e.spec, walk.example, walk.step)  # the scorer's own execute + reward
        m = span_positions(list(r.ids), walk.decode, r.text, e.span)
        delta = None if rw.errored else r.total - rw.total
        out.append(FamilyCF(f, site, e, tr, rw.total, delta, tuple(m.positions),
                            "drawn by the trainer (y' already cached)" if drawn is not None and drawn.family == f
                            else m.dropped or ""))
    return out


def family_table(walk: Walk, i: int, fcs: list[FamilyCF]) -> pd.DataFrame:
    """One row per family: site, edited value, r(y'), delta, |S_i|, and how many agents the node cache reused."""
    r, cols = walk.recs[i], ["family", "site", "edited value", "r(y)", "r(y')", "delta", "|S_i|", "agents reused",
                             "tokens spent", "note"]
    return pd.DataFrame([[REGISTRY[c.family].label, REGISTRY[c.family].describe(walk.spec(i), c.site) if c.edit else "",
                          r.text[c.edit.span[0]:c.edit.span[1]] if c.edit else "", r.total, c.reward, c.delta,
                          len(c.positions), f"{c.trace.cache_hits}/{sum(not a.skipped for a in c.trace.agents)}"
                          if c.trace else "", c.trace.tokens if c.trace else None, c.note] for c in fcs],
                        columns=cols).set_index("family")


def tokens_html(tok, ids, highlight=(), forced=(), title: str = "") -> str:
    """Sampled tokens one box each: `highlight` positions (S_i) orange and bold, `forced` positions grey; `title` is
    plain text (lemon.report.tokens_html)."""
    return report_tokens_html(tok, ids, highlight, forced, html.escape(title))


def advantages(walk: Walk) -> dict[str, torch.Tensor]:
    """The trainer's (G, T) advantages: lemon.train.cf.rollout_advantages on the rollout records with the config's
    lambda, scale, std floor, forced-token mask and CF baseline, as CFGRPOMixin._generate_and_score_completions calls
    it; the global part (the same call with lambda 0), the CF part (the rest), and the masks they were built from."""
    recs, c = walk.recs, walk.cfg
    T = max(len(r.ids) for r in recs)
    cmask = torch.tensor([[1] * len(r.ids) + [0] * (T - len(r.ids)) for r in recs])  # (G, T), TRL's completion mask
    return advantage_parts(recs, cmask, lam=c.cf_lambda, scale=c.scale_rewards, std_floor=c.std_floor,
                           mask_forced=c.mask_forced_tokens and c.constrained, cf_baseline=c.cf_baseline)


def advantage_table(walk: Walk, adv: dict[str, torch.Tensor]) -> pd.DataFrame:
    """Per rollout: reward, delta, the mean global part on its free tokens and CF part on S_i, and token counts."""
    free = (adv["completion"] * (1 - adv["forced"])).bool()  # (G, T)
    mean = lambda a, m: ((a * m).sum(1) / m.sum(1).clamp(min=1)).tolist()  # noqa: E731
    return pd.DataFrame({"reward": [r.total for r in walk.recs], "delta": [r.delta for r in walk.recs],
                         "global part": mean(adv["global"], free),
                         "CF part on S_i": mean(adv["cf"], adv["span"] * free),
                         "tokens": adv["completion"].sum(1).tolist(), "forced": adv["forced"].sum(1).tolist(),
                         "|S_i|": adv["span"].sum(1).tolist()}).rename_axis("i")


def plot_advantages(adv: dict[str, torch.Tensor]) -> Figure:
    """Heat maps of the (G, T) global part, CF part and total (lemon.report.advantage_heatmaps)."""
    return advantage_heatmaps(adv)


def completion_logprobs(walk: Walk) -> torch.Tensor:
    """(G, T) log pi(y_{i,t} | x, y_{i,<t}) of every rollout's sampled tokens (0 on padding) under the UNMASKED policy
    at the sampling temperature (what TRL's loss reads), differentiable in the LoRA weights. The prompt, the same for
    all G, runs once and its KV cache is repeated for the G right-padded completions (TRL runs G full sequences: the
    same numbers up to rounding, for ~1/G of the prompt's compute); a model whose cache cannot be repeated (Unsloth's
    tuples) runs each completion after its own copy of the prompt."""
    dev, recs = walk.model.device, walk.recs
    p = torch.tensor([list(walk.tok.apply_chat_template(walk.messages, add_generation_prompt=True, tokenize=True,
                                                        return_dict=True)["input_ids"])], device=dev)  # (1, P)
    G, P, T = len(recs), p.shape[1], max(len(r.ids) for r in recs)
    pad = walk.tok.pad_token_id if walk.tok.pad_token_id is not None else 0
    ids = torch.tensor([list(r.ids) + [pad] * (T - len(r.ids)) for r in recs], device=dev)  # (G, T) right-padded
    real = torch.tensor([[1] * len(r.ids) + [0] * (T - len(r.ids)) for r in recs], device=dev)  # (G, T)
    first = walk.model(input_ids=p, use_cache=True, logits_to_keep=1)  # logits (1, 1, V): predicts y_0
    logits, cache = [first.logits.expand(G, -1, -1)], first.past_key_values
    if T > 1 and hasattr(cache, "batch_repeat_interleave"):  # y_1.. read after the prompt's cache, repeated G times
        cache.batch_repeat_interleave(G)
        logits.append(walk.model(input_ids=ids[:, :-1], past_key_values=cache, attention_mask=torch.cat(
            [torch.ones(G, P, dtype=real.dtype, device=dev), real[:, :-1]], 1),
            position_ids=torch.arange(P, P + T - 1, device=dev).expand(G, -1)).logits)  # (G, T - 1, V)
    elif T > 1:
        logits += [walk.model(input_ids=torch.cat([p, ids[i:i + 1, :-1]], 1), logits_to_keep=T - 1).logits
                   for i in range(G)]  # G x (1, T - 1, V)
        logits = [logits[0], torch.cat(logits[1:])]
    logits = torch.cat(logits, 1).float() / walk.cfg.temperature  # (G, T, V)
    return torch.log_softmax(logits, -1).gather(-1, ids[..., None]).squeeze(-1) * real  # (G, T)


def span_logprobs(walk: Walk, lp: torch.Tensor | None = None) -> list[float]:
    """log pi(S_i) = sum over t in S_i of log pi(y_{i,t}) per rollout (NaN without S_i), from `lp` (G, T) or under
    the current weights."""
    if lp is None:
        with torch.no_grad():
            lp = completion_logprobs(walk)  # (G, T)
    return [float(lp[i, list(r.span_positions)].detach().sum()) if r.span_positions else float("nan")
            for i, r in enumerate(walk.recs)]


def optimizer_step(walk: Walk, adv: dict[str, torch.Tensor]) -> dict:
    """TRL's loss at ratio 1, -(1/N) sum_i sum_t exp(lp - sg(lp)) A_{i,t} over the N completion tokens of the kept
    rollouts, then one clipped AdamW step (the config's learning rate) on the LoRA weights. `before`: log pi(S_i)
    per rollout from the same forward."""
    params = [p for p in walk.model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=walk.cfg.learning_rate, **ADAM)
    lp = completion_logprobs(walk)  # (G, T)
    mask = adv["completion"].to(lp)  # (G, T): padding and errored rollouts out
    n = mask.sum().clamp(min=1)
    loss = -(torch.exp(lp - lp.detach()) * adv["total"].to(lp) * mask).sum() / n
    opt.zero_grad()
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
    opt.step()
    return {"loss": float(loss.detach()) + 0.0, "grad_norm": float(norm), "tokens N": int(n),
            "learning_rate": walk.cfg.learning_rate, "before": span_logprobs(walk, lp)}


def span_table(walk: Walk, adv: dict[str, torch.Tensor], before: list[float], after: list[float]) -> pd.DataFrame:
    """Per rollout with S_i: delta, the mean advantage on its S_i tokens, and log pi(S_i) before and after the step."""
    return pd.DataFrame([[i, r.delta, float(adv["total"][i, list(r.span_positions)].mean()), b, a, a - b]
                         for i, (r, b, a) in enumerate(zip(walk.recs, before, after)) if r.span_positions],
                        columns=["i", "delta", "A on S_i", "log pi(S_i) before", "after", "change"]).set_index("i")


def release(walk: Walk) -> None:
    """Drop the walk-through's copy of the policy (the training loop loads its own from the warm start)."""
    walk.model = None
    gc.collect()
