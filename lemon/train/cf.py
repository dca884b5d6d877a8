"""The counterfactual term as per-token advantages (DESIGN.md "Counterfactual GRPO, concretely").

For rollout i with group-normalised advantage A_i, counterfactual contrast delta_i = r(y_i) - r(y_i') and edited-span token
set S_i:    A_{i,t} = A_i + lambda * delta_i * 1[t in S_i]        (shape (B, T))
Putting the term into the advantages (not into a custom loss) keeps it working under TRL's GRPOTrainer and under Unsloth, which
replaces compute_loss on CUDA but accepts (B, T) advantages. lambda = 0 gives plain GRPO exactly.

Span -> token mapping works on the SAMPLED ids (never re-tokenises the text): token t covers the characters between the
decoded lengths of ids[:t] and ids[:t+1]; a token is in S_i when that range overlaps the edited value's character span.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

Span = tuple[int, int]


def token_char_offsets(ids: Sequence[int], decode: Callable[[list[int]], str]) -> list[Span]:
    """[start, end) characters of each sampled token in decode(ids), by incremental decoding. A token that completes a
    multi-byte character only after the next one gets an empty range here and the following token covers the character."""
    offsets, prev = [], 0
    ids = list(ids)
    for t in range(len(ids)):
        n = len(decode(ids[: t + 1]).rstrip("\ufffd"))  # an unfinished UTF-8 sequence decodes to U+FFFD: not yet a char
        offsets.append((prev, max(prev, n)))
        prev = max(prev, n)
    return offsets


def span_token_mask(offsets: Sequence[Span], spans: Sequence[Span]) -> list[bool]:
    """True for every token whose character range overlaps any of `spans` (half-open intervals)."""
    return [any(s < e_tok and s_tok < e for s, e in spans) and e_tok > s_tok for s_tok, e_tok in offsets]


def cf_advantages(adv: torch.Tensor, completion_mask: torch.Tensor, span_mask: torch.Tensor, delta: torch.Tensor,
                  lam: float) -> torch.Tensor:
    """Per-token advantages.
    adv (B,) group-normalised; completion_mask (B, T) 1 on real completion tokens; span_mask (B, T) 1 on edited-span tokens
    (all-zero rows for rollouts without an edit); delta (B,) contrast (0 where no edit). Returns (B, T), zero on padding."""
    if adv.dim() != 1 or completion_mask.shape != span_mask.shape or completion_mask.shape[0] != adv.shape[0] \
            or delta.shape != adv.shape:
        raise ValueError(f"shape mismatch: adv {tuple(adv.shape)}, completion_mask {tuple(completion_mask.shape)}, "
                         f"span_mask {tuple(span_mask.shape)}, delta {tuple(delta.shape)}")
    m = completion_mask.to(adv.dtype)  # (B, T)
    s = span_mask.to(adv.dtype) * m  # (B, T) a span never reaches into padding
    return adv[:, None] * m + lam * delta[:, None] * s  # (B, T)


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4, scale: bool = True) -> torch.Tensor:
    """GRPO advantages: reward minus its group mean, divided by the group std when `scale` (TRL's default)."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards is not a multiple of group_size={group_size}")
    r = rewards.view(-1, group_size)  # (num_groups, G)
    a = r - r.mean(dim=1, keepdim=True)
    if scale:
        a = a / (r.std(dim=1, keepdim=True) + eps)
    return a.reshape(-1)  # (B,)
