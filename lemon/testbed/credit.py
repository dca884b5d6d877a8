"""A seedless measurement of credit assignment: how well does each policy-gradient estimator point where the expected
reward rises, per unit of budget? (No training run, so no seed-to-seed noise: one fixed policy checkpoint, many draws.)

The target. The sampler draws a spec y from q(y | x), the policy's softmax renormalised over the tokens the grammar
allows (lemon.policy.rollout). The objective is J = mean over the measured questions x of E_q[R(x, y)], with R the
world's EXACT expected reward (lemon.testbed.world: no outcome noise). Its gradient in the LoRA weights is
        grad J = mean_x E_q[(R(x, y) - b_x) grad log q(y | x)],     log q(y | x) = sum_t masked log-prob of y_t,
estimated with N samples per question (leave-one-out baseline b: unbiased) in two independent halves; the halves' cosine
says how well the reference itself is known (the issue asks >= 0.9).

The estimators, each computed from fresh draws exactly as the trainer weights tokens (lemon.train.cf.rollout_advantages
with scale 'none', the unmasked log-probs TRL uses, forced-token masking as TrainConfig.mask_forced_tokens):
  grpo@G    G specs per question, A_i = r_i - mean_group r on every completion token;
  cf@G      the same G specs plus one counterfactual edit each (the trainer's own edit sampler and span mapping):
            + lambda * delta_i on the edited span's tokens. Same policy samples as grpo@G;
  grpo@2G   2G specs per question: as many executions as cf@G (G rollouts + G edits);
  cf-term   cf@G minus grpo@G: the counterfactual term alone;
  cfb@G     cf@G with each delta minus the step's leave-one-out mean delta of its family (cf_baseline "family", an
            extension beyond the paper); cfb-term = cfb@G minus grpo@G;
  ... masked  grpo@G / cf@G with the grammar-renormalised log-probs (the sampler's own) instead of the unmasked ones:
            what the estimators would be if the trainer scored tokens as the sampler draws them.
For each estimator: the cosine of its gradient with the reference, over D independent draws (mean and a bootstrap CI).
A better estimator per unit of budget has the higher cosine at equal samples (cf@G vs grpo@G) or equal executions
(cf@G vs grpo@2G).
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

from lemon import benchmarks as B
from lemon.eval.orchestrator import orchestrator_messages
from lemon.policy.rollout import GrammarConstraint, masked_logprobs, sample_specs
from lemon.run.executor import NodeCache
from lemon.testbed.exact import ExactScorer
from lemon.train.cf import note_forced, rollout_advantages
from lemon.train.edits import FAMILIES, FamilySampler

# cfb@G: cf@G with the contrast baselined per family (TrainConfig.cf_baseline="family", an extension beyond the paper)
ESTIMATORS = ("grpo@G", "cf@G", "grpo@2G", "cf-term", "grpo@G masked", "cf@G masked", "cfb@G", "cfb-term")


@dataclass(frozen=True)
class CreditConfig:
    """One measurement: which draws, how many, and how the trainer would weight them."""

    group: int = 4
    """G: specs per question in one estimator draw (the trainer's num_generations)."""
    draws: int = 32
    """Independent draws of each estimator."""
    reference_samples: int = 512
    """Samples per question in EACH half of the reference gradient."""
    cf_lambda: float = 1.0
    """Weight of the counterfactual term (the trainer's cf_lambda)."""
    mask_forced: bool = True
    """Forced tokens carry no advantage in the estimators (TrainConfig.mask_forced_tokens)."""
    temperature: float = 1.0
    """Sampling temperature (the trainer's)."""
    batch: int = 32
    """Sequences per forward / backward pass."""
    seed: int = 0
    """Seeds every draw (draw d uses seed + d; the reference halves their own)."""

    def __post_init__(self):
        if self.group < 2 or self.draws < 2 or self.reference_samples < 2 or self.batch < 1:
            raise ValueError("group, draws and reference_samples must be >= 2 (a group baseline, a spread of draws, a "
                             "leave-one-out baseline) and batch >= 1")


class Measure:
    """Policy, world, questions and the trainer's scoring of one checkpoint: draws samples, scores them exactly, and
    turns weighted token log-probs into flat LoRA gradients."""

    def __init__(self, model, tok, world, examples, prompts, train_cfg, caps, cfg: CreditConfig):
        self.model, self.tok, self.world, self.examples, self.prompts = model, tok, world, list(examples), prompts
        self.tcfg, self.caps, self.cfg = train_cfg, caps, cfg
        self.msgs = [orchestrator_messages(e.question, "math", prompts, train_cfg.max_agents) for e in self.examples]
        self.constraint = GrammarConstraint(train_cfg.grammar(prompts, "math"))
        self.params = [p for n, p in model.named_parameters() if "lora_" in n and p.requires_grad]
        self.prompt_ids = [list(tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True,
                                                        return_dict=True)["input_ids"]) for m in self.msgs]

    def scorer(self) -> ExactScorer:
        """A fresh exact scorer with the trainer's settings and a fresh (uniform) family sampler: draws stay
        independent."""
        benches = {b: B.get_benchmark(b) for b in B.BENCHMARKS}
        return ExactScorer(self.world.pool(), self.prompts, {e.id: e for e in self.examples}, benches,
                           reward=self.tcfg.reward, caps=self.caps, cache=NodeCache(),
                           sampler=FamilySampler(floor=self.tcfg.family_floor), cf_lambda=self.cfg.cf_lambda,
                           families=FAMILIES, max_agents=self.tcfg.max_agents, seed=0, world=self.world)

    def sample(self, n: int, seed: int, keep_masks: bool = False):
        """n samples for every question, prompt-major, drawn in chunks of cfg.batch rows."""
        per = max(1, self.cfg.batch // len(self.msgs))
        out = [[] for _ in self.msgs]
        k = 0
        while len(out[0]) < n:
            m = min(per, n - len(out[0]))
            s = sample_specs(self.model, self.tok, self.msgs, n=m, temperature=self.cfg.temperature,
                             max_new_tokens=self.tcfg.max_completion_length, seed=seed * 1000 + k,
                             constraint=self.constraint, keep_masks=keep_masks)
            for x in s:
                out[x.prompt_index].append(x)
            k += 1
        return out  # [question][sample]

    def logprobs(self, chunk) -> list:
        """Each item's (L,) token log-probs, differentiable in the LoRA weights: chunk = [(question, sample, masked)],
        one left-padded forward; log-probs of the unmasked policy (masked=False, what the trainer reads) or of the
        grammar-renormalised one the sampler drew from (masked=True), at the sampling temperature."""
        import torch
        seqs = [self.prompt_ids[q] + list(s.token_ids) for q, s, _ in chunk]
        width = max(map(len, seqs))
        pad = self.tok.pad_token_id
        ids = torch.tensor([[pad] * (width - len(x)) + x for x in seqs])  # (b, T) left-padded
        attn = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in seqs])  # (b, T)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)  # (b, T)
        keep = max(len(s.token_ids) for _, s, _ in chunk) + 1  # left-padded: every completion is in the tail
        self.model.eval()  # no dropout: the policy that sampled
        logits = self.model(input_ids=ids, attention_mask=attn, position_ids=pos,
                            logits_to_keep=keep).logits  # (b, keep, V): the LM head only where it is read
        out = []
        for b, (_, s, masked) in enumerate(chunk):
            L = len(s.token_ids)
            lg = logits[b, keep - L - 1:keep - 1].float() / self.cfg.temperature  # (L, V) predicts y_1..y_L
            y = torch.tensor(s.token_ids)  # (L,)
            out.append(masked_logprobs(lg, s.allowed_masks, y) if masked else
                       torch.log_softmax(lg, -1).gather(-1, y[:, None]).squeeze(-1))  # (L,)
        return out

    def grad(self, items) -> np.ndarray:
        """Flat LoRA gradient of sum over items (q, sample, weights (L,) or scalar, masked) of sum_t w_t log p(y_t)."""
        import torch
        grads = [torch.zeros_like(p) for p in self.params]
        for start in range(0, len(items), self.cfg.batch):
            chunk = items[start:start + self.cfg.batch]
            lps = self.logprobs([(q, s, masked) for q, s, _, masked in chunk])
            total = sum((torch.as_tensor(w, dtype=lp.dtype) * lp).sum() for (_, _, w, _), lp in zip(chunk, lps))
            g = torch.autograd.grad(total, self.params, allow_unused=True)
            for acc, x in zip(grads, g):
                if x is not None:
                    acc += x
        return torch.cat([g.flatten() for g in grads]).numpy().astype(np.float64)

    def rewards(self, groups) -> list[list[float]]:
        sc = self.scorer()
        return [[r.total for r in sc.score([(self.examples[q].id, s.text, s.token_ids, q, 0) for s in grp])]
                for q, grp in enumerate(groups)]

    def reference(self, seed: int) -> tuple[np.ndarray, np.ndarray, int]:
        """Two independent halves of the reference gradient (each from cfg.reference_samples per question) and the
        number of samples per question in all."""
        halves = []
        for h in range(2):
            groups = self.sample(self.cfg.reference_samples, seed=10_000 * (h + 1) + seed, keep_masks=True)
            rew = self.rewards(groups)
            items = []
            for q, (grp, r) in enumerate(zip(groups, rew)):
                r = np.asarray(r)
                loo = (r.sum() - r) / (len(r) - 1)  # leave-one-out baseline: unbiased
                items += [(q, s, float(a) / len(r), True) for s, a in zip(grp, r - loo)]
            halves.append(self.grad(items) / len(self.examples))
        return halves[0], halves[1], 2 * self.cfg.reference_samples

    def draw(self, d: int) -> dict[str, np.ndarray]:
        """One draw of every estimator (grpo@G and cf@G share their samples; grpo@2G adds G more per question)."""
        G = self.cfg.group
        groups = self.sample(2 * G, seed=self.cfg.seed + d, keep_masks=True)
        sc = self.scorer()
        first = [grp[:G] for grp in groups]
        recs = sc.score([(self.examples[q].id, s.text, s.token_ids, q, 0) for q, grp in enumerate(first) for s in grp])
        sc.add_counterfactuals(recs, d, lambda ids: self.tok.decode(list(ids), skip_special_tokens=True))
        flat = [s for grp in first for s in grp]
        out = {}
        for name, lam in (("grpo@G", 0.0), ("cf@G", self.cfg.cf_lambda)):
            out[name] = self.grad(self._weighted(flat, recs, lam))
            out[f"{name} masked"] = self.grad(self._weighted(flat, recs, lam, masked=True))
        out["cf-term"] = out["cf@G"] - out["grpo@G"]
        out["cfb@G"] = self.grad(self._weighted(flat, recs, self.cfg.cf_lambda, cf_baseline="family"))
        out["cfb-term"] = out["cfb@G"] - out["grpo@G"]
        recs2 = self.scorer().score([(self.examples[q].id, s.text, s.token_ids, q, 0) for q, grp in enumerate(groups)
                                     for s in grp])
        flat2 = [s for grp in groups for s in grp]
        out["grpo@2G"] = self.grad(self._weighted(flat2, recs2, 0.0))
        return out

    def _weighted(self, samples, recs, lam: float, masked: bool = False, cf_baseline: str = "none"):
        """(q, sample, per-token weights, unmasked) items: the trainer's (B, T) advantages (lemon.train.cf), forced
        tokens zeroed when cfg.mask_forced."""
        import torch
        T = max(len(s.token_ids) for s in samples)
        cmask = torch.tensor([[1] * len(s.token_ids) + [0] * (T - len(s.token_ids)) for s in samples])  # (B, T)
        note_forced(recs, samples)
        adv, _, _ = rollout_advantages(recs, cmask, lam=lam, scale="none", mask_forced=self.cfg.mask_forced,
                                       cf_baseline=cf_baseline)  # (B, T)
        return [(recs[i].group, s, adv[i, :len(s.token_ids)].clone(), masked) for i, s in enumerate(samples)]


def corrected_cosine(est: np.ndarray, h1: np.ndarray, h2: np.ndarray) -> float:
    """cos(est, grad J) with the reference's own noise taken out: est . (h1 + h2) / 2 is unbiased for est . grad J and
    h1 . h2 for |grad J|^2 (the halves are independent), so their ratio is consistent where the plain cosine with a
    noisy reference is shrunk toward 0 (Spearman's correction for attenuation, in vector form). NaN when h1 . h2 <= 0
    (the reference has no measurable direction)."""
    g2 = float(h1 @ h2)
    ne = np.linalg.norm(est)
    return float("nan") if g2 <= 0 else 0.0 if ne == 0 else float(est @ ((h1 + h2) / 2) / (ne * g2 ** 0.5))


def cosine(est: np.ndarray, ref: np.ndarray) -> float:
    """cos(est, ref); 0 for an all-zero estimate (e.g. every reward of every group equal: the step would not move the
    policy, which counts as pointing nowhere), NaN for an all-zero reference."""
    ne, nr = np.linalg.norm(est), np.linalg.norm(ref)
    return float("nan") if nr == 0 else 0.0 if ne == 0 else float(est @ ref / (ne * nr))


def bootstrap_mean_ci(x, n: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    x = np.asarray([v for v in x if v == v], dtype=float)
    if not len(x):
        return float("nan"), float("nan"), float("nan")
    rng = random.Random(seed)
    means = sorted(float(np.mean([x[rng.randrange(len(x))] for _ in x])) for _ in range(n))
    return float(x.mean()), means[int(0.025 * n)], means[int(0.975 * n) - 1]
