"""The rollout side of one CF-GRPO step: TRL's `rollout_func`. Given the step's prompts (Q questions x G copies, in
TRL's order), sample G specs per question with the policy, score them, resample groups without reward spread, add the
counterfactual edits, and hand TRL the token ids; the scored records stay in `self.batch` for the reward functions and
the advantage computation (lemon.train.grpo).

Dynamic sampling (DAPO, Yu et al. 2025, §3.2 "dynamic sampling"): a group whose rewards are all equal gives no global
GRPO gradient. Such a group is resampled — new specs for the SAME question, up to `resample` more attempts — and the
last attempt is kept whatever it gave (a group that stays flat still carries its counterfactual terms, which is where
CF-GRPO can learn when GRPO cannot). The rule depends on rewards only, so CF and global-GRPO runs resample alike.

Curriculum (`QuestionLabels`): every scored group labels its question (times seen, whether its rewards had spread, its
success rate) from executions we pay for anyway; the curriculum sampler of lemon.train.grpo prefers questions that are
unseen or had spread (some specs solve them and some do not) over ones that every spec solves or fails.
"""
from __future__ import annotations

import hashlib
import json
import random
import time
from pathlib import Path

from torch.utils.data import Sampler

from lemon.train.cf import note_forced
from lemon.train.edits import FamilySampler
from lemon.policy.dtype import SamplingCopy, merged_copy
from lemon.policy.rollout import GrammarConstraint, sample_specs
from lemon.train.scoring import Rollout, SpecScorer


def _seed(*parts) -> int:
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:4], "big") & 0x7FFFFFFF


def prompt_key(messages) -> str:
    """How a prompt (chat messages) is recognised when TRL hands it back to the rollout function."""
    return json.dumps(messages, sort_keys=True, ensure_ascii=False)


def has_spread(rs: list[Rollout]) -> bool:
    vals = [r.total for r in rs if not r.errored]
    return len(vals) >= 2 and max(vals) - min(vals) > 1e-9


class QuestionLabels:
    """Per-question labels from training executions: {example_id: {"seen", "spread", "success"}} (JSON-able)."""

    def __init__(self, labels: dict | None = None):
        self.labels = dict(labels or {})

    def update(self, eid: str, group: list[Rollout]) -> None:
        ok = [r for r in group if not r.errored]
        old = self.labels.get(eid, {"seen": 0})
        self.labels[eid] = {"seen": old["seen"] + 1, "spread": has_spread(group),
                            "success": sum(r.reward.success for r in ok) / max(1, len(ok))}

    def weight(self, eid: str) -> float:
        lab = self.labels.get(eid)
        if lab is None:
            return 1.0  # unseen: explore
        return 2.0 if lab["spread"] else 0.25  # discriminative questions first; never zero (labels go stale)


class CurriculumSampler(Sampler):
    """TRL's RepeatSampler layout (each chosen question G times in a row, each block of Q questions repeated `repeat`
    times for gradient accumulation), but the questions of each block are drawn by QuestionLabels weights, without
    replacement within the block. Its length is the epoch TRL expects; draws happen lazily as TRL iterates.

    `strata` (one label per example id, e.g. its benchmark = the testbed's task type) stratifies every block: its Q
    slots go round-robin over the strata, starting one stratum further at each block, so a step with Q >= #strata sees
    every stratum and consecutive steps cover them all when Q < #strata. Without stratification a step of 2 questions
    from two task types saw only one type about half the time, and a policy cannot learn to tell types apart from such
    steps. `weighted=False` draws uniformly (stratification without the curriculum)."""

    def __init__(self, example_ids: list[str], labels: QuestionLabels, *, questions: int, generations: int, repeat: int,
                 seed: int, strata: list[str] | None = None, weighted: bool = True):
        self.ids, self.labels, self.q, self.g = example_ids, labels, questions, generations
        self.repeat, self.seed = repeat, seed
        if strata is not None and len(strata) != len(example_ids):
            raise ValueError(f"{len(strata)} strata labels for {len(example_ids)} example ids")
        self.strata, self.weighted = strata, weighted
        self.epoch = 0

    def __len__(self) -> int:
        return (len(self.ids) // self.q) * self.q * self.g * self.repeat

    def _weight(self, i: int) -> float:
        return self.labels.weight(self.ids[i]) if self.weighted else 1.0

    def __iter__(self):
        rng = random.Random(_seed("curriculum", self.seed, self.epoch))
        self.epoch += 1
        names = sorted(set(self.strata)) if self.strata is not None else [None]
        for b in range(len(self.ids) // self.q):
            idx = list(range(len(self.ids)))
            block = []
            for k in range(self.q):  # weighted draw without replacement, from the slot's stratum when stratified
                want = names[(b * self.q + k) % len(names)]
                pool = [j for j, i in enumerate(idx) if want is None or self.strata[i] == want] or list(range(len(idx)))
                j = rng.choices(pool, weights=[self._weight(idx[j]) for j in pool])[0]
                block.append(idx.pop(j))
            for _ in range(self.repeat):
                for i in block:
                    yield from [i] * self.g


class SpecRollouts:
    """TRL rollout_func: sampling, scoring, dynamic resampling, counterfactuals, rollouts.jsonl. Everything it needs is
    passed in (scorer, tokenizer, grammar constraint factory); `batch` holds the latest step's records in TRL's
    order."""

    def __init__(self, scorer: SpecScorer, tokenizer, examples_by_prompt: dict[str, str], *, num_generations: int,
                 temperature: float, max_new_tokens: int, grammars: dict | None = None, grammar_cache=None,
                 resample: int = 0, seed: int = 0,
                 scale_rewards: str = "none", std_floor: float = 0.1, rollouts_path: Path | None = None,
                 labels: QuestionLabels | None = None, sample_dtype: str = "model",
                 curriculum_ids: list[str] | None = None, strata: list[str] | None = None, weighted: bool = True,
                 mask_forced: bool = False, cf_baseline: str = "none"):
        self.scorer, self.tok, self.by_prompt = scorer, tokenizer, examples_by_prompt
        self.g, self.temperature, self.max_new_tokens = num_generations, temperature, max_new_tokens
        self.grammars, self.grammar_cache = grammars, grammar_cache  # example id -> SpecGrammar; None = unconstrained
        self.resample, self.seed, self.scale_rewards, self.std_floor = resample, seed, scale_rewards, std_floor
        self.rollouts_path, self.labels, self.sample_dtype = rollouts_path, labels or QuestionLabels(), sample_dtype
        # the dataset's example ids in row order; None = TRL's own shuffled sampler
        self.curriculum_ids = curriculum_ids
        self.strata, self.weighted = strata, weighted  # CurriculumSampler's stratification and weighting
        self.mask_forced = mask_forced  # grammar-forced tokens get advantage 0 (lemon.train.cf.rollout_advantages)
        self.cf_baseline = cf_baseline  # lemon.train.cf.baselined_deltas
        self.batch: list[Rollout] = []
        self.last_stats: dict = {}
        self._shadow = None  # SamplingCopy, made at the first rollout when sample_dtype == 'bf16_copy'
        self._merged = None  # merged bf16 copy when sample_dtype == 'bf16_merged': made per step, freed before the loss

    @property
    def cf_lambda(self) -> float:
        return self.scorer.cf_lambda

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)  # exactly how sample_specs decodes Sample.text

    def _sample(self, model, prompts: list, eids: list, step: int, attempt: int):
        constraint = None
        if self.grammars is not None:  # one grammar per prompt: its domain's base roles
            constraint = GrammarConstraint(tuple(self.grammars[e] for e in eids), self.grammar_cache)
        dtype = self.sample_dtype
        # sample a bf16 copy kept in step with the trained (fp32) LoRA weights: lemon.policy.dtype
        if dtype == "bf16_copy":
            if self._shadow is None:
                import torch
                self._shadow = SamplingCopy(model, torch.bfloat16)
            model, dtype = self._shadow.sync(model), "model"
        elif dtype == "bf16_merged":  # a merged bf16 copy: no LoRA overhead per decoding step (lemon.policy.dtype)
            if self._merged is None:  # once per step: a resampling attempt reuses it (__call__ frees it)
                import torch
                self._merged = merged_copy(model, torch.bfloat16)
            model, dtype = self._merged, "model"
        return sample_specs(model, self.tok, prompts, n=self.g, temperature=self.temperature,
                            max_new_tokens=self.max_new_tokens, seed=_seed("sample", self.seed, step, attempt),
                            constraint=constraint, dtype=dtype)

    def __call__(self, prompts: list, trainer) -> dict:
        step = trainer.state.global_step
        if len(prompts) % self.g:
            raise RuntimeError(f"{len(prompts)} prompts is not a multiple of num_generations={self.g}")
        uniq = [prompts[i] for i in range(0, len(prompts), self.g)]
        for q, p in enumerate(uniq):
            if any(prompt_key(prompts[q * self.g + k]) != prompt_key(p) for k in range(self.g)):
                raise RuntimeError("TRL did not hand the rollout function each prompt num_generations times in a row")
        eids = []
        for p in uniq:
            k = prompt_key(p)
            if k not in self.by_prompt:
                raise KeyError("a prompt from TRL matches no training question (was the dataset built by lemon.train?)")
            eids.append(self.by_prompt[k])
        model = trainer.model
        stats = {"groups": len(uniq), "resampled_groups": 0, "resample_attempts": 0, "sample_s": 0.0, "score_s": 0.0}
        groups = self._attempt(model, uniq, eids, list(range(len(uniq))), step, 0, stats)
        stats["zero_spread_groups"] = sum(not has_spread(g) for g in groups)
        discarded: list[Rollout] = []
        for attempt in range(1, self.resample + 1):
            flat = [q for q, g in enumerate(groups) if not has_spread(g)]
            if not flat:
                break
            stats["resample_attempts"] += 1
            stats["resampled_groups"] += len(flat)
            new = self._attempt(model, [uniq[q] for q in flat], [eids[q] for q in flat], flat, step, attempt, stats)
            for q, g in zip(flat, new):
                discarded.extend(groups[q])  # logged as kept=false: nothing sampled disappears from rollouts.jsonl
                groups[q] = g  # the newest attempt is kept, flat or not
        self._merged = None  # stale after this step's update; not held (~1 GB for the 0.5B) through loss and backward
        batch = [r for g in groups for r in g]
        for q, g in enumerate(groups):
            self.labels.update(eids[q], g)
        t0 = time.perf_counter()
        self.scorer.add_counterfactuals(batch, step, self.decode)
        stats["cf_s"] = time.perf_counter() - t0
        self.batch, self.last_stats = batch, stats
        if self.rollouts_path is not None:
            with open(self.rollouts_path, "a") as f:  # step + 1: the optimizer step these rollouts train
                for r, kept in [(r, True) for r in batch] + [(r, False) for r in discarded]:
                    f.write(json.dumps({**r.to_row(step + 1), "kept": kept}) + "\n")
        prompt_ids = [self._prompt_ids(p) for p in uniq]
        return {"prompt_ids": [prompt_ids[q] for q in range(len(uniq)) for _ in range(self.g)],
                "completion_ids": [list(r.ids) for r in batch], "logprobs": None,
                "rollout_index": list(range(len(batch)))}

    def _prompt_ids(self, messages) -> list[int]:
        enc = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        return list(enc["input_ids"])

    def _attempt(self, model, prompts, eids, group_ids, step, attempt, stats) -> list[list[Rollout]]:
        t0 = time.perf_counter()
        was_training = model.training
        model.eval()
        try:
            samples = self._sample(model, prompts, eids, step, attempt)
        finally:
            model.train(was_training)
        stats["sample_s"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        items = [(eids[s.prompt_index], s.text, s.token_ids, group_ids[s.prompt_index], attempt) for s in samples]
        scored = self.scorer.score(items, step)
        stats["score_s"] += time.perf_counter() - t0
        out: list[list[Rollout]] = [[] for _ in prompts]
        note_forced(scored, samples)  # what lemon.train.cf.forced_mask reads
        for s, r in zip(samples, scored):
            out[s.prompt_index].append(r)
        if any(len(g) != self.g for g in out):
            raise RuntimeError(f"sample_specs returned {[len(g) for g in out]} samples per prompt, expected {self.g}")
        return out

    def state_dict(self) -> dict:
        return {"sampler": self.scorer.sampler.state_dict(), "labels": self.labels.labels}

    def load_state_dict(self, st: dict) -> None:
        self.scorer.sampler = FamilySampler.from_state(st["sampler"])
        self.labels.labels = dict(st.get("labels") or {})  # in place: the curriculum sampler holds this object
