"""The counterfactual term as per-token advantages (paper §3.3), in the same units as the global GRPO advantage.

Paper (as first read by this project), for rollout i of a group, group-normalised A_i, contrast
delta_i = r(y_i) - r(y_i') of one edit and the edited span's tokens S_i:
        A_{i,t} = A_i + lambda * delta_i * 1[t in S_i],        A_i = (r_i - mean_group r) / std_group r
There delta_i is raw reward while A_i is divided by the group's std, so the CF term's weight relative to A changes from
group to group (a group with spread 0.05 multiplies A by 20 and leaves delta alone). LEMON divides BOTH by one scale s:
        A_{i,t} = [ (r_i - mean_group r) + lambda * delta_i * 1[t in S_i] ] / s_i                         (B, T)
with, since issue 30, s = 1 by default ("none": raw reward units for both terms, as Dr. GRPO drops the std; Liu et al.
2025, "Understanding R1-Zero-Like Training"). Then lambda means the same on every step: one unit of delta weighs exactly
what one unit of reward above the group mean weighs, and neither depends on what else is in the batch. The earlier
default, s = max(std of the step's rewards, std_floor) ("batch", PPO-lite / TRL's scale_rewards="batch"), made the CF
update's size depend on the OTHER questions of the step: with every rollout of a step solved, s fell to the floor 0.1
and one capacity token of the duel's last cf step got advantage 11.8 next to global advantages <= 0.03 (issue 30;
tests/test_cf.py). "batch" and "group" (s = max(std of the group, std_floor)) stay available; the floor keeps them from
dividing a counterfactual contrast by ~0. Under AdamW the common size of the advantages matters little (the update is
normalised per parameter), so "none" needs no other learning rate. lambda = 0 gives plain GRPO exactly (same scale, same
masking).

Span length: the CF weight of a token does NOT depend on how many tokens the span has. The edited field is one action
whose log-probability is the SUM of its tokens' log-probs, so REINFORCE on that action puts the same weight delta/s on
each of its tokens: a 20-token duty and a 1-token capacity get the same per-token weight, and the duty's total gradient
is the sum over its tokens, exactly as the global term treats a whole completion (tests/test_cf.py checks this against
log-prob sums).

Rollouts whose execution errored (reward None) are excluded: they do not enter any group mean or scale, get advantage 0
and are masked out of the loss (`keep`); a group with fewer than 2 scored rollouts has no baseline and gets 0.
The span -> token mapping lives in lemon.train.spanmap.
"""
from __future__ import annotations

from collections import defaultdict

import torch

# moved to lemon.train.spanmap (issue 11, defect 6); re-exported for callers not yet pointed there
from lemon.train.spanmap import span_token_mask, token_char_offsets  # noqa: F401


def cf_advantages(adv: torch.Tensor, completion_mask: torch.Tensor, span_mask: torch.Tensor, delta: torch.Tensor,
                  lam: float, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token advantages (adv_i + lam * delta_i * 1[t in S_i]) / scale_i.
    adv (B,) group-centred (or already normalised when scale is None); completion_mask (B, T) 1 on real completion
    tokens; span_mask (B, T) 1 on edited-span tokens (all-zero rows for rollouts without an edit); delta (B,) contrast
    (0 where no edit); scale (B,) the common divisor (None = 1). Returns (B, T), zero on padding."""
    if adv.dim() != 1 or completion_mask.shape != span_mask.shape or completion_mask.shape[0] != adv.shape[0] \
            or delta.shape != adv.shape:
        raise ValueError(f"shape mismatch: adv {tuple(adv.shape)}, completion_mask {tuple(completion_mask.shape)}, "
                         f"span_mask {tuple(span_mask.shape)}, delta {tuple(delta.shape)}")
    m = completion_mask.to(adv.dtype)  # (B, T)
    s = span_mask.to(adv.dtype) * m  # (B, T) a span never reaches into padding
    out = adv[:, None] * m + lam * delta[:, None] * s  # (B, T)
    if scale is not None:
        if scale.shape != adv.shape:
            raise ValueError(f"scale has shape {tuple(scale.shape)}, expected {tuple(adv.shape)}")
        out = out / scale[:, None].to(out.dtype)
    return out


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4, scale: bool = True) -> torch.Tensor:
    """GRPO advantages: reward minus its group mean, divided by the group std when `scale` (TRL's default)."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards is not a multiple of group_size={group_size}")
    r = rewards.view(-1, group_size)  # (num_groups, G)
    a = r - r.mean(dim=1, keepdim=True)
    if scale:
        a = a / (r.std(dim=1, keepdim=True) + eps)
    return a.reshape(-1)  # (B,)


SCALES = ("batch", "group", "none")


def step_advantages(rewards, groups, deltas, completion_mask: torch.Tensor, span_mask: torch.Tensor, *, lam: float,
                    scale: str = "none", std_floor: float = 0.1) -> tuple[torch.Tensor, torch.Tensor, float]:
    """One step's (B, T) advantages from per-rollout rewards (None = errored, excluded), group ids and CF deltas (0
    where there is no counterfactual). Returns (advantages (B, T), keep (B,) bool, the batch scale s (for logging; the
    mean of s_i under "group")); advantages and keep are on completion_mask's device (CUDA in a GPU run)."""
    if scale not in SCALES:
        raise ValueError(f"scale={scale!r}; valid: {', '.join(SCALES)}")
    if std_floor <= 0:
        raise ValueError(f"std_floor={std_floor} must be > 0")
    B = completion_mask.shape[0]
    # the rewards-side arithmetic is tiny and runs on the CPU; its (B,) results follow the mask
    dev = completion_mask.device
    if not len(rewards) == len(groups) == len(deltas) == B:
        raise ValueError(f"{len(rewards)} rewards, {len(groups)} groups, {len(deltas)} deltas for a batch of {B}")
    keep = torch.tensor([r is not None for r in rewards])  # (B,)
    r = torch.tensor([float(x) if x is not None else 0.0 for x in rewards], dtype=torch.float32)  # (B,)
    g = torch.tensor(groups)  # (B,)
    centred = torch.zeros(B)  # (B,) r_i - mean of its group's scored rewards
    s = torch.ones(B)  # (B,)
    for gid in g.unique():
        m = (g == gid) & keep
        if m.sum() >= 2:
            centred[m] = r[m] - r[m].mean()
            if scale == "group":
                s[m] = max(float(r[m].std(unbiased=False)), std_floor)
    if scale == "batch":
        vals = r[keep]
        s[:] = max(float(vals.std(unbiased=False)) if vals.numel() >= 2 else 0.0, std_floor)
    delta = torch.tensor([float(d) for d in deltas]) * keep  # (B,) never a contrast on an errored rollout
    s_mean = float(s[keep].mean()) if keep.any() else float(s.mean())
    # on CUDA the masks live on the GPU (TRL's completion_mask): move the (B,) vectors there, never the (B, T)
    # masks back
    centred, delta, s, keep = (x.to(dev) for x in (centred, delta, s, keep))
    adv = cf_advantages(centred, completion_mask, span_mask.to(dev), delta, lam, scale=s)  # (B, T) on the mask's device
    adv = adv * keep[:, None].to(adv.dtype)
    return adv, keep, s_mean


def note_forced(recs, samples) -> None:
    """Copy each sample's grammar-forced positions (Sample.forced: one allowed token) onto its rollout record, where
    forced_mask reads them. Every producer of rollout records (the trainer's rollout function, the testbed's credit
    measurement and walk-through) calls this, so the three see one definition of "forced"."""
    for r, s in zip(recs, samples, strict=True):
        r.forced_positions = tuple(t for t, f in enumerate(getattr(s, "forced", ())) if f)


def forced_mask(recs, cmask: torch.Tensor) -> torch.Tensor:
    """(B, T) 1 where the grammar allowed exactly one token (Rollout.forced_positions), on cmask's device.

    Why those tokens get no advantage: rollouts are sampled from the policy renormalised over the allowed tokens, whose
    log-prob of a forced token is 0 whatever the weights, so the exact policy gradient has no term there. The trainer's
    log-probs are the unmasked policy's, under which a forced token's gradient would push mass onto keys, quotes and ids
    (~25 per agent) in proportion to the rollout's advantage: noise common to the CF and the global arm."""
    return _positions_mask(recs, cmask, "forced_positions")


def span_mask(recs, cmask: torch.Tensor) -> torch.Tensor:
    """(B, T) 1 on each rollout's edited-span tokens S_i (Rollout.span_positions; all-zero rows where there is no
    edit)."""
    return _positions_mask(recs, cmask, "span_positions")


def _positions_mask(recs, cmask: torch.Tensor, attr: str) -> torch.Tensor:
    m = torch.zeros_like(cmask)  # (B, T)
    for i, r in enumerate(recs):
        pos = [t for t in getattr(r, attr) if t < m.shape[1]]
        if pos:
            m[i, pos] = 1
    return m


CF_BASELINES = ("none", "family")


def baselined_deltas(recs, how: str = "none") -> list[float]:
    """Each rollout's CF contrast, minus a baseline when `how` = "family" (an extension beyond the paper).

    "none" (the paper): delta_i = r(y_i) - r(y_i') as is. The paper's edits only take away, so most contrasts are > 0
    and the CF term raises almost every edited value it sees, whether or not the spec was good: REINFORCE without a
    baseline, which commits early to whatever is sampled often (Chung et al. 2021, "Beyond variance reduction").
    "family": delta_i minus the mean contrast of the step's OTHER scored rollouts edited by the same family (leave one
    out: the baseline does not depend on y_i); a rollout whose family no other rollout of the step drew keeps its raw
    contrast. This is not a neutral variance reduction: a site is only editable for some values (a capacity above small,
    a customised duty), so subtracting b there moves mass toward the uneditable values by b; it removes the push an
    editable value gets just for being editable, and keeps the push of a value whose edit hurts MORE than usual."""
    if how not in CF_BASELINES:
        raise ValueError(f"cf_baseline={how!r}; valid: {', '.join(CF_BASELINES)}")
    raw = [float(r.delta or 0.0) if r.total is not None else 0.0 for r in recs]
    if how == "none":
        return raw
    fam = [r.family if (r.total is not None and r.delta is not None and r.family) else None for r in recs]
    total, count = defaultdict(float), defaultdict(int)  # per family: sum and number of the step's contrasts
    for f, d in zip(fam, raw):
        if f is not None:
            total[f] += d
            count[f] += 1
    return [d - (total[f] - d) / (count[f] - 1) if f is not None and count[f] > 1 else d for f, d in zip(fam, raw)]


def rollout_advantages(recs, completion_mask: torch.Tensor, *, lam: float, scale: str = "none",
                       std_floor: float = 0.1, mask_forced: bool = True,
                       cf_baseline: str = "none") -> tuple[torch.Tensor, torch.Tensor, float]:
    """THE per-token advantages of one step, from its rollout records (Rollout: total, group, delta, span_positions,
    forced_positions): step_advantages over the records' rewards, groups and CF deltas with S_i from span_positions,
    then forced tokens zeroed when mask_forced (TrainConfig.mask_forced_tokens), contrasts baselined per cf_baseline
    (TrainConfig.cf_baseline; "none" = the paper). The trainer (lemon.train.grpo), the credit measurement and the
    walk-throughs all call this one function. Returns (advantages (B, T), keep (B,), batch scale)."""
    adv, keep, s = step_advantages([r.total for r in recs], [r.group for r in recs],
                                   baselined_deltas(recs, cf_baseline),
                                   completion_mask, span_mask(recs, completion_mask), lam=lam, scale=scale,
                                   std_floor=std_floor)  # (B, T)
    if mask_forced:
        adv = adv * (1 - forced_mask(recs, completion_mask)).to(adv.dtype)  # (B, T)
    return adv, keep, s


def advantage_parts(recs, completion_mask: torch.Tensor, *, lam: float, scale: str = "none",
                    std_floor: float = 0.1, mask_forced: bool = True,
                    cf_baseline: str = "none") -> dict[str, torch.Tensor]:
    """rollout_advantages taken apart for display (the walk-throughs): "total" (what the loss weights), "global" (the
    same call with lambda 0), "cf" (the rest), and the (B, T) masks they were built from: "completion" (errored
    rollouts zeroed, as the trainer drops them from the loss), "span" (S_i) and "forced" (zeros unless mask_forced)."""
    kw = dict(scale=scale, std_floor=std_floor, mask_forced=mask_forced, cf_baseline=cf_baseline)
    total, keep, _ = rollout_advantages(recs, completion_mask, lam=lam, **kw)  # (B, T)
    glob, _, _ = rollout_advantages(recs, completion_mask, lam=0.0, **kw)  # (B, T)
    forced = forced_mask(recs, completion_mask) if mask_forced else torch.zeros_like(completion_mask)  # (B, T)
    return {"total": total, "global": glob, "cf": total - glob,
            "completion": completion_mask * keep[:, None].to(completion_mask.dtype),
            "span": span_mask(recs, completion_mask), "forced": forced}
