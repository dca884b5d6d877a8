"""One CF-GRPO step taken apart on a simulated world, for notebooks/00_method.ipynb (its cells call these functions).

The trainer's own path (lemon.train.grpo) without TRL: specs sampled under the grammar (lemon.policy.rollout), scored
and edited once each by the trainer's scorer with the world's EXACT expected reward (lemon.testbed.exact, built by
lemon.testbed.credit.Measure), turned into (B, T) advantages by the trainer's own call,
lemon.train.cf.rollout_advantages (scale "none", forced tokens zeroed), then one AdamW step on the LoRA weights for
    loss = -(1/N) sum_i sum_t A_{i,t} log pi(y_{i,t}),    N = completion tokens of the batch (TRL's default "dapo"),
which is TRL's clipped-ratio loss at its on-policy point (ratio 1, beta 0): the same value and gradient. Unlike a TRL
run: a constant learning rate (TRL decays it linearly) and the questions taken in turn rather than shuffled.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import pandas as pd
import torch
from matplotlib.figure import Figure

from lemon.eval.orchestrator import orchestrator_messages
from lemon.policy.model import load_policy
from lemon.policy.rollout import sample_specs
from lemon.prompts import default_prompts
from lemon.report import advantage_heatmaps, tokens_html as report_tokens_html
from lemon.spec import parse_spec
from lemon.testbed.credit import CreditConfig, Measure
from lemon.testbed.experiment import ExperimentConfig, make_world, optimum_rows, run_caps, split_examples, train_config
from lemon.train.cf import advantage_parts, note_forced
from lemon.train.edits import REGISTRY, sample_edit
from lemon.train.scoring import edit_seed

# the testbed's pilot shape (experiments/grad_cosine.py): 12-character roles, 16-character duties, ~100-token specs
PILOT = {"resample": 0, "role_chars": 12, "duty_chars": 16, "curriculum": False, "stratify": True}
MAX_GRAD_NORM = 1.0  # the HF Trainer's default clip, which the real trainer runs with


@dataclass
class Bench:
    """World, trainer config, policy + questions (Measure), one scorer for the whole run (its adaptive family sampler
    learns across steps, as in training), the optimiser, and one held-out question per task type."""

    world: object
    prompts: object
    tcfg: object
    measure: Measure
    scorer: object
    optimizer: torch.optim.Optimizer
    heldout: list


@dataclass
class Batch:
    """One step's rollouts, G per question, prompt-major; recs / edits are filled by score / counterfactuals."""

    step: int
    questions: list[int]  # indices into bench.measure.examples, one group each
    samples: list  # lemon.policy.rollout.Sample
    recs: list  # lemon.train.scoring.Rollout
    edits: list  # the Edit each counterfactual applied (None: no counterfactual)


def setup(world: str = "duty", seed: int = 0, group: int = 4, cf_lambda: float = 1.0, learning_rate: float = 2e-2,
          questions: int = 8, per_step: int = 1) -> Bench:
    """The random-tiny-bpe policy with fresh LoRA, the world, `questions` training questions balanced over task types,
    `per_step` of them per step (rounded up to a multiple of the number of types)."""
    prompts = default_prompts()
    w = make_world(world, prompts)
    k = len(w.config.types)
    over = {**PILOT, "num_generations": group, "batch_size": group * k * -(-per_step // k),
            "learning_rate": learning_rate, "cf_lambda": cf_lambda}
    exp = ExperimentConfig(world=world, base="random-tiny-bpe", profile="smoke", train_questions=questions,
                           heldout_questions=k, train_overrides=over, seeds=(seed,), arms=("cf",))
    tcfg = train_config("cf", seed, exp, w)
    train_ex, heldout = split_examples(w, questions, k, exp.data_seed)
    model, tok = load_policy(tcfg.policy, seed=seed)
    m = Measure(model, tok, w, train_ex, prompts, tcfg, run_caps(tcfg),
                CreditConfig(group=group, cf_lambda=cf_lambda, seed=seed, temperature=tcfg.temperature))
    opt = torch.optim.AdamW(m.params, lr=learning_rate, weight_decay=0.0)  # the HF Trainer's defaults but the rate
    return Bench(w, prompts, tcfg, m, m.scorer(), opt, heldout)


def optima(bench: Bench) -> pd.DataFrame:
    """The optimum spec of each task type (exhaustive search, lemon.testbed.search)."""
    return pd.DataFrame(optimum_rows(bench.world, bench.tcfg.reward, bench.tcfg.max_agents, bench.measure.caps))


def prompt_text(bench: Bench, q: int, head: int = 900, tail: int = 300) -> str:
    """Question q's orchestrator prompt as the policy reads it (chat template applied), its middle cut out."""
    t = bench.measure.tok.decode(bench.measure.prompt_ids[q])
    return t if len(t) <= head + tail else f"{t[:head]}\n[... {len(t) - head - tail} characters ...]\n{t[-tail:]}"


def step_questions(bench: Bench, step: int) -> list[int]:
    """The step's batch_size / G questions: split_examples alternates task types, so a consecutive block is balanced."""
    k, n = bench.tcfg.batch_size // bench.tcfg.num_generations, len(bench.measure.examples)
    return [(step * k + j) % n for j in range(k)]


def sample(bench: Bench, questions: list[int], step: int) -> Batch:
    """G specs per question under the training grammar, seeded by the step."""
    m, tc = bench.measure, bench.tcfg
    samples = sample_specs(m.model, m.tok, [m.msgs[q] for q in questions], n=m.cfg.group, temperature=tc.temperature,
                           max_new_tokens=tc.max_completion_length, seed=m.cfg.seed * 100_003 + step,
                           constraint=m.constraint)
    return Batch(step, list(questions), samples, [], [])


def _regret(bench: Bench, batch: Batch, r) -> float:
    ex, tc = bench.measure.examples[batch.questions[r.group]], bench.tcfg
    return bench.world.regret(r.text, ex, tc.reward, tc.max_agents, bench.measure.caps)


def score(bench: Bench, batch: Batch) -> pd.DataFrame:
    """Exact reward of each rollout (no worker call); fills batch.recs; the reward's parts and the regret."""
    m = bench.measure
    batch.recs = bench.scorer.score([(m.examples[batch.questions[s.prompt_index]].id, s.text, s.token_ids,
                                      s.prompt_index, 0) for s in batch.samples], batch.step)
    note_forced(batch.recs, batch.samples)  # as the trainer's rollout function does
    batch.edits = [None] * len(batch.recs)
    return pd.DataFrame([{"question": batch.questions[r.group], "valid": r.valid,
                          "success": r.reward.success, "token_eff": r.reward.token_efficiency,
                          "graph_cost": r.reward.graph_cost, "reward": r.total, "regret": _regret(bench, batch, r)}
                         for r in batch.recs])


def counterfactuals(bench: Bench, batch: Batch) -> pd.DataFrame:
    """SpecScorer.add_counterfactuals (family from the adaptive sampler, a site uniformly, y' scored exactly,
    delta = r(y) - r(y')): fills each rollout's family, delta and span and batch.edits; one row per rollout."""
    probs = bench.scorer.sampler.probs()  # read before add_counterfactuals updates it: what the edits were drawn with
    tok = bench.measure.tok
    decode = lambda ids: tok.decode(list(ids), skip_special_tokens=True)  # noqa: E731
    bench.scorer.add_counterfactuals(batch.recs, batch.step, decode)
    batch.edits = [_edit_of(bench, r, i, batch.step, probs) for i, r in enumerate(batch.recs)]
    rows = []
    for r, e in zip(batch.recs, batch.edits):
        fam = REGISTRY[e.family] if e else None
        rows.append({"family": fam.label if e else r.cf_status, "p(family)": probs[e.family] if e else None,
                     "edit": fam.describe(parse_spec(r.text, base_roles=bench.prompts.roles_for("math")), e.site) if e
                     else "", "edited value": r.text[e.span[0]:e.span[1]] if e else "", "reward(y)": r.total,
                     "reward(y')": r.total - r.delta if e else None, "delta": r.delta, "|S_i|": len(r.span_positions)})
    return pd.DataFrame(rows)


def _edit_of(bench: Bench, r, i: int, step: int, probs: dict):
    """The Edit the scorer applied to rollout i, drawn again with its RNG and probabilities (a Rollout keeps only the
    family, delta and span); a different draw raises rather than show another edit than the one trained on."""
    if r.cf_status != "ok":
        return None
    sc = bench.scorer
    spec = parse_spec(r.text, base_roles=bench.prompts.roles_for("math"), max_agents=bench.tcfg.max_agents)
    e = sample_edit(spec, bench.prompts, random.Random(edit_seed(sc.seed, step, i)), probs, families=sc.families)
    if e is None or e.family != r.family:
        raise RuntimeError(f"rollout {i}: re-drawn edit {e and e.family} differs from the scorer's {r.family}")
    return e


def pick(batch: Batch) -> int:
    """The rollout to look at: the first with a non-zero contrast, else the first with an edit, else 0."""
    return next((i for i, r in enumerate(batch.recs) if r.delta), next((i for i, e in enumerate(batch.edits) if e), 0))


def tokens_html(bench: Bench, batch: Batch, i: int) -> str:
    """Rollout i's sampled tokens: S_i (the edited value's tokens) in orange, forced tokens in grey."""
    r = batch.recs[i]
    return report_tokens_html(bench.measure.tok, batch.samples[i].token_ids, r.span_positions, r.forced_positions,
                              f"<b>rollout {i}</b>:")


def advantages(batch: Batch, cf_lambda: float) -> dict[str, torch.Tensor]:
    """The trainer's (B, T) advantages (rollout_advantages, scale "none", forced tokens zeroed), its global part (the
    same call with lambda 0) and CF part (the rest), and the masks they were built from."""
    recs, T = batch.recs, max(s.n_tokens for s in batch.samples)
    cmask = torch.tensor([[1] * s.n_tokens + [0] * (T - s.n_tokens) for s in batch.samples])  # (B, T)
    return advantage_parts(recs, cmask, lam=cf_lambda, scale="none", mask_forced=True)


def advantage_table(batch: Batch, adv: dict[str, torch.Tensor], cf_lambda: float) -> pd.DataFrame:
    """Per rollout: r_i - mean_group r, lambda * delta_i, token counts, and the largest |A| on a forced token."""
    free = (adv["completion"] * (1 - adv["forced"])).bool()  # (B, T)
    return pd.DataFrame({"reward": [r.total for r in batch.recs],
                         "r_i - mean": ((adv["global"] * free).sum(1) / free.sum(1).clamp(min=1)).tolist(),
                         "lambda*delta_i": [cf_lambda * (r.delta or 0.0) for r in batch.recs],
                         "tokens": adv["completion"].sum(1).tolist(), "forced": adv["forced"].sum(1).tolist(),
                         "|S_i|": adv["span"].sum(1).tolist(),
                         "max |A| on forced": (adv["total"] * adv["forced"]).abs().amax(1).tolist()})


def plot_advantages(adv: dict[str, torch.Tensor]) -> Figure:
    """Heat maps of the (B, T) global part, CF part and total (lemon.report.advantage_heatmaps)."""
    return advantage_heatmaps(adv)


def token_logprobs(bench: Bench, batch: Batch) -> list[torch.Tensor]:
    """Each rollout's (L,) log-probs of its tokens under the UNMASKED policy at the sampling temperature (what TRL's
    loss reads), differentiable in the LoRA weights; one left-padded forward of the batch (credit.Measure.logprobs)."""
    m = bench.measure
    return m.logprobs([(batch.questions[s.prompt_index], s, False) for s in batch.samples])


def optimizer_step(bench: Bench, batch: Batch, adv: dict[str, torch.Tensor]) -> dict:
    """loss = -(1/N) sum_i sum_t A_{i,t} log pi(y_{i,t}), then one clipped AdamW step on the LoRA weights."""
    lps = token_logprobs(bench, batch)
    n = adv["completion"].sum().clamp(min=1)
    loss = -sum((adv["total"][i, :len(lp)] * lp).sum() for i, lp in enumerate(lps)) / n
    bench.optimizer.zero_grad()
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(bench.measure.params, MAX_GRAD_NORM)
    bench.optimizer.step()
    return {"loss": float(loss.detach()), "grad_norm": float(norm), "tokens": int(n)}


def span_logprobs(bench: Bench, batch: Batch) -> list[float]:
    """log pi(S_i) = sum_{t in S_i} log pi(y_{i,t}) per rollout under the current weights (NaN without an edit)."""
    with torch.no_grad():
        lps = token_logprobs(bench, batch)
    return [float(lp[list(r.span_positions)].sum()) if r.span_positions else float("nan")
            for r, lp in zip(batch.recs, lps)]


def span_table(batch: Batch, adv: dict[str, torch.Tensor], before: list[float], after: list[float]) -> pd.DataFrame:
    """Per rollout with an edit: delta, the advantage on its S_i tokens, and log pi(S_i) before and after the step."""
    return pd.DataFrame([{"i": i, "delta": r.delta, "A on S_i": float(adv["total"][i, list(r.span_positions)].mean()),
                          "log pi(S_i) before": b, "after": a, "change": a - b}
                         for i, (r, b, a) in enumerate(zip(batch.recs, before, after)) if r.span_positions],
                        columns=["i", "delta", "A on S_i", "log pi(S_i) before", "after", "change"]).set_index("i")


def train_step(bench: Bench, step: int) -> dict:
    """The whole CF-GRPO step on the step's questions; what the curve plots."""
    batch = sample(bench, step_questions(bench, step), step)
    score(bench, batch)
    counterfactuals(bench, batch)
    info = optimizer_step(bench, batch, advantages(batch, bench.measure.cfg.cf_lambda))
    regret = [_regret(bench, batch, r) for r in batch.recs]
    return {"step": step, "reward": sum(r.total for r in batch.recs) / len(batch.recs),
            "regret": sum(regret) / len(regret), "deltas": sum(bool(r.delta) for r in batch.recs), **info}


def curve(rows: list[dict]) -> Figure:
    """Mean exact reward and regret of each step's rollouts (train_step's rows) with a 5-step running mean."""
    df, fig = pd.DataFrame(rows, columns=["step", "reward", "regret"]).set_index("step"), Figure(figsize=(10, 3))
    for ax, col in zip(fig.subplots(1, 2), ("reward", "regret")):
        ax.plot(df.index, df[col], ".", color="#999999", label="step mean")
        ax.plot(df.index, df[col].rolling(5, min_periods=1).mean(), color="#D55E00", label="5-step running mean")
        ax.set(xlabel="step", title=f"mean exact {col} of the step's rollouts")
    ax.legend(fontsize=8)
    return fig


def greedy_vs_optimum(bench: Bench) -> pd.DataFrame:
    """The greedy (temperature 0) spec on one held-out question per task type, its exact reward and the optimum's."""
    m, tc = bench.measure, bench.tcfg
    msgs = [orchestrator_messages(e.question, "math", bench.prompts, tc.max_agents) for e in bench.heldout]
    texts = [s.text for s in sample_specs(m.model, m.tok, msgs, n=1, temperature=0.0, seed=0, constraint=m.constraint,
                                          max_new_tokens=tc.max_completion_length)]
    rows = []
    for e, text in zip(bench.heldout, texts):
        sc = bench.world.score_text(text, e, tc.reward, tc.max_agents, m.caps)
        opt = bench.world.optimum(e, tc.reward, tc.max_agents, m.caps)
        rows.append({"type": bench.world.type_of(e), "greedy reward": sc.expected_reward, "optimum reward":
                     opt.expected_reward, "regret": sc.regret, "greedy spec": text, "optimum spec": opt.spec.to_yaml()})
    return pd.DataFrame(rows).set_index("type")
