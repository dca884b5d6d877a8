"""Counterfactual GRPO (paper §3.3): a trl.GRPOTrainer whose rollouts are specs executed by the worker pool, plus one
counterfactual edit per valid rollout whose reward contrast lands only on the edited span's tokens.

Flow of one step: TRL samples G specs per question and calls our reward functions. `SpecRewarder` parses and executes each
spec once (node cache on), returns the reward terms (success, token efficiency, graph cost, invalid penalty; TRL logs each and
sums them with `reward_weights`), and, when cf_lambda > 0, samples one edit per valid spec (family from the adaptive sampler,
site uniform), re-executes the edited spec through the same cache, and stores delta = r(y) - r(y') with the sampled-token
positions of the edited value. `CFGRPOTrainer._generate_and_score_completions` then turns TRL's (B,) advantages into (B, T)
ones with lemon.train.cf.cf_advantages. Putting the term in the advantages (not a loss override) keeps it valid under Unsloth,
which replaces compute_loss on CUDA. With cf_lambda = 0 nothing is edited and the advantages are TRL's own: plain GRPO.
"""
from __future__ import annotations

import json
import random
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import TrainerCallback
from trl import GRPOTrainer

from lemon.train.cf import cf_advantages, span_token_mask, token_char_offsets
from lemon.train.edits import FAMILIES, FamilySampler, sample_edit
from lemon.run.executor import ExecutorCaps, NodeCache, execute
from lemon.train.rewards import RewardConfig, compute_reward
from lemon.spec import SpecError, parse_spec

CF_STATE = "cf_state.json"


@dataclass
class Rollout:
    """What became of one sampled completion."""

    text: str
    valid: bool
    error: str | None
    reward: object  # RewardBreakdown
    agents: int = 0
    edges: int = 0
    tokens_spent: int = 0
    family: str | None = None
    delta: float = 0.0
    cf_tokens_spent: int = 0
    cf_tokens_nominal: int = 0
    span_positions: tuple[int, ...] = ()


def _text(completion) -> str:
    # conversational datasets give [{"role": "assistant", "content": ...}]; plain ones give a string
    return completion[0]["content"] if isinstance(completion, list) else completion


class SpecRewarder:
    """Executes specs for TRL's reward functions and computes the counterfactual contrasts. Models, pool, prompts and
    cache are passed in explicitly; `batch` holds the records of the latest call for the trainer to pick up."""

    def __init__(self, pool, prompts, examples: dict, benchmarks: dict, tokenizer, *, reward: RewardConfig,
                 caps: ExecutorCaps, cache: NodeCache, sampler: FamilySampler, cf_lambda: float,
                 families=FAMILIES, max_agents: int = 8, seed: int = 0):
        self.pool, self.prompts, self.examples, self.benchmarks, self.tok = pool, prompts, examples, benchmarks, tokenizer
        self.reward_cfg, self.caps, self.cache, self.sampler = reward, caps, cache, sampler
        self.cf_lambda, self.families, self.max_agents = cf_lambda, tuple(families), max_agents
        self.rng = random.Random(seed)
        self.seed = seed
        self.batch: list[Rollout] = []
        self._key = None

    # TRL calls each reward function in turn with the same batch; the first call does the work, the others read it.
    def _ensure(self, completions, example_id, completion_ids, trainer_state=None) -> list[Rollout]:
        step = getattr(trainer_state, "global_step", None)  # identical completions in a later step are a new batch
        key = (step, tuple(_text(c) for c in completions), tuple(example_id))
        if key != self._key:
            self.batch = [self._one(_text(c), eid, ids) for c, eid, ids in zip(completions, example_id, completion_ids)]
            self._key = key
        return self.batch

    def _one(self, text: str, example_id: str, ids) -> Rollout:
        ex = self.examples[example_id]
        bench = self.benchmarks[ex.benchmark]
        try:
            spec = parse_spec(text, base_roles=self.prompts.roles_for(bench.domain), max_agents=self.max_agents)
        except SpecError as e:
            return Rollout(text, False, e.code, compute_reward(None, 0.0, 0, self.reward_cfg))
        tr = execute(spec, ex, bench, self.pool, prompts=self.prompts, cache=self.cache, caps=self.caps, seed=self.seed)
        r = compute_reward(spec, tr.score, tr.nominal_tokens, self.reward_cfg)
        out = Rollout(text, True, tr.error, r, len(spec.agents), len(spec.edges()), tr.tokens)
        if self.cf_lambda == 0:
            return out
        probs = {f: (p if f in self.families else 0.0) for f, p in self.sampler.probs().items()}
        edit = sample_edit(spec, self.prompts, self.rng, probs)
        if edit is None or edit.family not in self.families:
            return out  # no eligible site: this rollout gets no counterfactual term
        tr2 = execute(edit.spec, ex, bench, self.pool, prompts=self.prompts, cache=self.cache, caps=self.caps, seed=self.seed)
        r2 = compute_reward(edit.spec, tr2.score, tr2.nominal_tokens, self.reward_cfg)
        out.family, out.delta = edit.family, r.total - r2.total
        out.cf_tokens_spent, out.cf_tokens_nominal = tr2.tokens, tr2.nominal_tokens
        self.sampler.update(edit.family, out.delta)
        # map the edited value's characters onto the SAMPLED token ids (decoded exactly as TRL decoded them)
        ids = list(ids)
        decode = lambda x: self.tok.decode(x, skip_special_tokens=True)  # noqa: E731  (exactly as TRL decodes)
        shift = len(text) - len(decode(ids))  # TRL may prepend an assistant "bootstrap" prefix to the decoded ids
        if shift < 0 or not text.endswith(decode(ids)):
            out.span_positions = ()  # ids and text disagree: no safe mapping, so no CF term rather than a wrong one
            return out
        offsets = token_char_offsets(ids, decode)
        span = (edit.span[0] - shift, edit.span[1] - shift)
        out.span_positions = tuple(i for i, m in enumerate(span_token_mask(offsets, [span])) if m)
        return out

    # ---- the four reward functions (their names become TRL's log keys) ---------------------------------------------
    def functions(self):
        def success(completions, example_id, completion_ids, trainer_state=None, **kw):
            return [r.reward.success for r in self._ensure(completions, example_id, completion_ids, trainer_state)]

        def token_efficiency(completions, example_id, completion_ids, trainer_state=None, **kw):
            return [r.reward.token_efficiency for r in self._ensure(completions, example_id, completion_ids, trainer_state)]

        def graph_cost(completions, example_id, completion_ids, trainer_state=None, **kw):
            return [r.reward.graph_cost for r in self._ensure(completions, example_id, completion_ids, trainer_state)]

        def invalid(completions, example_id, completion_ids, trainer_state=None, **kw):
            return [0.0 if r.valid else r.reward.total for r in self._ensure(completions, example_id, completion_ids, trainer_state)]

        c = self.reward_cfg
        return [success, token_efficiency, graph_cost, invalid], [c.w_success, c.w_tokens, -c.w_graph, 1.0]


class CFGRPOTrainer(GRPOTrainer):
    """GRPOTrainer + the localized counterfactual advantage."""

    def __init__(self, *args, rewarder: SpecRewarder, **kw):
        super().__init__(*args, **kw)
        self.rewarder = rewarder

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        recs = self.rewarder.batch
        adv, cmask = out["advantages"], out["completion_mask"]  # (B,), (B, T)
        if len(recs) != adv.shape[0]:
            raise RuntimeError(f"rewarder holds {len(recs)} rollouts for a batch of {adv.shape[0]}; "
                               "CF-GRPO supports a single process with one generation batch per step")
        span = torch.zeros_like(cmask)  # (B, T)
        for i, r in enumerate(recs):
            for t in r.span_positions:
                if t < span.shape[1]:
                    span[i, t] = 1
        delta = torch.tensor([r.delta for r in recs], dtype=adv.dtype, device=adv.device)  # (B,)
        if self.rewarder.cf_lambda > 0:
            out["advantages"] = cf_advantages(adv, cmask, span, delta, self.rewarder.cf_lambda)  # (B, T)
        self._log_rollouts(recs)
        return out

    def _log_rollouts(self, recs):
        m = self._metrics["train"]
        valid = [r for r in recs if r.valid]
        m["spec/valid_rate"].append(len(valid) / max(1, len(recs)))
        m["spec/agents"].append(sum(r.agents for r in valid) / max(1, len(valid)))
        m["spec/edges"].append(sum(r.edges for r in valid) / max(1, len(valid)))
        m["tokens/worker_nominal"].append(sum(r.reward.worker_tokens for r in valid) / max(1, len(valid)))
        m["tokens/worker_spent"].append(sum(r.tokens_spent for r in recs))
        m["tokens/cf_spent"].append(sum(r.cf_tokens_spent for r in recs))
        m["tokens/cf_nominal"].append(sum(r.cf_tokens_nominal for r in recs))
        m["cf/edits"].append(sum(1 for r in recs if r.family))
        # rollouts whose CF term reaches the loss: an edit with delta != 0 and a mapped span (lambda > 0)
        m["cf/active"].append(sum(1 for r in recs if r.family and r.delta and r.span_positions) * (self.rewarder.cf_lambda > 0))
        for code, k in Counter(r.error for r in recs if not r.valid).items():  # why rollouts were invalid
            m[f"spec/invalid_{code}"].append(k / len(recs))
        per = defaultdict(list)
        for r in recs:
            if r.family:
                per[r.family].append(r.delta)
        for f in FAMILIES:
            m[f"cf/prob_{f}"].append(self.rewarder.sampler.probs()[f])
            if per[f]:
                m[f"cf/delta_{f}"].append(sum(per[f]) / len(per[f]))
        stats = self.rewarder.cache.stats()  # cumulative counters -> this step's hits and misses
        prev = getattr(self, "_cache_prev", {"hits": 0, "misses": 0})
        m["cache/hits"].append(stats.get("hits", 0) - prev["hits"])
        m["cache/misses"].append(stats.get("misses", 0) - prev["misses"])
        self._cache_prev = {"hits": stats.get("hits", 0), "misses": stats.get("misses", 0)}


class CFStateCallback(TrainerCallback):
    """Saves the family sampler (and the edit RNG) with every checkpoint; the step clock and JSONL metrics too."""

    def __init__(self, rewarder: SpecRewarder, metrics_path: Path, verbose: bool = False):
        self.rewarder, self.metrics_path, self._t, self.verbose = rewarder, Path(metrics_path), None, verbose

    def on_step_begin(self, args, state, control, **kw):
        self._t = time.perf_counter()

    def on_log(self, args, state, control, logs=None, **kw):
        if logs is not None:
            if self._t is not None:
                logs["time/step_s"] = time.perf_counter() - self._t
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps({"step": state.global_step, **logs}) + "\n")
            if self.verbose and "reward" in logs:  # one line per step: the headless console's progress (lemon.progress)
                g = lambda k: logs.get(k, float("nan"))  # noqa: E731
                print(f"[cf-grpo] step {state.global_step}/{state.max_steps}  reward {g('reward'):+.3f}  "
                      f"valid {g('spec/valid_rate'):.2f}  cf edits {g('cf/edits'):.0f}  worker tok {g('tokens/worker_spent'):.0f}"
                      f" (+cf {g('tokens/cf_spent'):.0f})  {g('time/step_s'):.0f} s", file=sys.stderr, flush=True)

    def on_save(self, args, state, control, **kw):
        d = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        d.mkdir(parents=True, exist_ok=True)
        (d / CF_STATE).write_text(json.dumps({"sampler": self.rewarder.sampler.state_dict(),
                                              "rng": self.rewarder.rng.getstate()}, default=list))


def load_cf_state(rewarder: SpecRewarder, checkpoint: Path) -> bool:
    p = Path(checkpoint) / CF_STATE
    if not p.exists():
        return False
    st = json.loads(p.read_text())
    rewarder.sampler = FamilySampler.from_state(st["sampler"])
    v, internal, g = st["rng"]
    rewarder.rng.setstate((v, tuple(internal), g))
    return True
