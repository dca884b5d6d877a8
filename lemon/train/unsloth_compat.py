"""Where Unsloth's patches change what lemon's code sees, and how lemon copes. Read from unsloth / unsloth_zoo 2026.10.9
(the pin in requirements-gpu.txt; also the newest on PyPI when this was written) and unsloth 2025.9.1.

Sampling (lemon.policy.rollout.sample_specs prefills each prompt once and repeats its KV cache for the n samples):
- Unsloth's forward returns a LEGACY TUPLE cache ((K, V) per layer; unsloth/models/llama.py LlamaModel_fast_forward
  builds `next_decoder_cache` as a tuple), which has no `batch_repeat_interleave`.
- Unsloth's generate wrapper sets `cache_implementation`, which transformers refuses beside a caller's `past_key_values`
  ("Passing both `cache_implementation` ... and `past_key_values`", GenerationMixin._prepare_cache_for_generation):
  2025.9.1 llama.py unsloth_fast_generate sets "dynamic" unconditionally; 2026.10.9 llama.py unsloth_fast_generate only
  without a cache (it converts a tuple cache with _ensure_cache_is_dynamic), but 2026.10.9 vision.py
  unsloth_base_fast_generate (FastModel: 8-bit, full fine-tuning, architectures without a Fast* class) writes its
  choice, usually "static", into the caller's generation_config even beside a cache (only its flash-attention branch
  checks for one). So a model whose generate() is Unsloth's never gets a shared cache:
  generate() prefills the repeated prompt itself (the prefix cache is a CPU saving; a GPU prefills the batch at once).

The loss (CFGRPOMixin._generate_and_score_completions hands TRL (B, T) advantages, T = completion width):
unsloth compute_loss (unsloth/models/rl_replacements.py grpo_trainer_compute_loss) always takes unsloth_zoo
rl_replacements.py grpo_accumulated_loss (its _get_per_token_logps returns None), which, per micro-batch, on the text
path:
  lp_b = calculate_pad_tokens_in_prompt(cat(prompt_ids, completion_ids), T, pad)   # pad tokens in b's prompt columns
  M = old_logps.shape[1] - T if old_logps is not None else ref_logps.shape[1] - T if ref_logps is not None
      else max_b lp_b
  input_ids = left_pack_padding(input_ids, pad)          # a stable sort moving EVERY pad token to the row's end
  window = input_ids[:, -(T + M):]                       # the columns it scores: width T + M
  completion_mask = create_completion_attention_mask(window, lp, M, pad)   # REBUILT: cols >= M - lp_b and not pad
then grpo_compute_loss multiplies the (B, T + M) ratios by `advantages` ((B,) is unsqueezed to (B, 1)). So TRL-layout
(B, T) advantages fail to broadcast whenever M > 0 (prompts of unequal length in the micro-batch), and TRL's
completion_mask, which carries our keep mask (errored rollouts), is replaced. M is micro-batch-wide; old/ref logps
(Unsloth's _get_per_token_logps_and_entropies, over the whole generation batch) fix it to the generation batch's M.

What lemon does (unsloth_advantages): cf_lambda = 0 gives Unsloth its own (B,) advantages (each row is one number then);
cf_lambda > 0 moves every completion token's advantage to its column in that window when M is known at generation time
(old/ref logps present, or the step is one micro-batch: steps_per_generation == 1, as in the `paper` preset), and
refuses otherwise. Errored rollouts already have zero advantages (lemon.train.cf.step_advantages), so losing the keep
mask leaves their tokens only in Unsloth's token count: nothing for loss_type dapo (num_items_in_batch is ours), grpo
and dr_grpo at beta = 0; bnpo's local count and a beta > 0 KL term would still see them.
"""
from __future__ import annotations

import torch


def is_unsloth_trainer(trainer) -> bool:
    """The trainer subclasses Unsloth's patched GRPOTrainer (unsloth_compiled_cache.UnslothGRPOTrainer), the class
    lemon.train.grpo.trainer_class('unsloth') builds on."""
    return any("unsloth" in f"{c.__module__}.{c.__name__}".lower() for c in type(trainer).__mro__)


def unsloth_window(prompt_ids: torch.Tensor, completion_ids: torch.Tensor, pad_id: int,
                   logps_width: int | None = None) -> int:
    """Width T + M of the columns grpo_accumulated_loss scores: from the old/ref logps when the batch has them, else
    T + the largest count of pad tokens in a row's prompt columns (calculate_pad_tokens_in_prompt)."""
    if logps_width is not None:
        return int(logps_width)
    return completion_ids.shape[1] + int((prompt_ids == pad_id).sum(1).max())


def to_unsloth_layout(adv: torch.Tensor, prompt_ids: torch.Tensor, completion_ids: torch.Tensor, pad_id: int,
                      width: int) -> torch.Tensor:
    """(B, T) advantages of TRL's completion columns -> (B, width): each completion token's value moved to the column
    Unsloth scores it in. left_pack_padding is a stable sort of the non-pad tokens to the front, so a token's packed
    column is (non-pad tokens up to and including it) - 1, and the window starts at packed column P + T - width. Pad
    tokens in the completion are dropped by Unsloth's rebuilt mask; their advantages go nowhere (zero elsewhere)."""
    B, P = prompt_ids.shape
    T = completion_ids.shape[1]
    if adv.shape != (B, T):
        raise ValueError(f"advantages {tuple(adv.shape)} do not match completion_ids {tuple(completion_ids.shape)}")
    real = torch.cat([prompt_ids, completion_ids], 1) != pad_id  # (B, P + T)
    col = (real.cumsum(1) - 1)[:, P:] - (P + T - width)  # (B, T) window column of each completion token
    ok = real[:, P:] & (col >= 0) & (col < width)  # (B, T)
    out = adv.new_zeros(B, width)
    rows = torch.arange(B, device=adv.device)[:, None].expand(B, T)
    out[rows[ok], col[ok]] = adv[ok]
    return out


def unsloth_advantages(out: dict, completion_mask: torch.Tensor, *, pad_id: int | None, cf_lambda: float,
                       steps_per_generation: int) -> torch.Tensor:
    """The advantages to hand Unsloth's loss for one generation batch `out` (TRL's output dict; out["advantages"] are
    lemon's (B, T), zero on errored rollouts; completion_mask is TRL's (B, T) before the keep mask). See the module
    doc."""
    adv = out["advantages"]  # (B, T)
    if cf_lambda == 0:  # plain GRPO: every row is one number on its tokens, Unsloth's native (B,) form fits any split
        m = completion_mask.to(adv.dtype)
        return (adv * m).sum(1) / m.sum(1).clamp(min=1)  # (B,)
    if pad_id is None:
        raise ValueError("Unsloth's GRPO loss finds prompts and completions by the pad token: the tokenizer has none")
    logps = out.get("old_per_token_logps")
    logps = out.get("ref_per_token_logps") if logps is None else logps
    if logps is None and steps_per_generation != 1:
        raise ValueError(
            f"cf_lambda={cf_lambda} with the unsloth backend needs each optimisation step to be ONE micro-batch "
            f"(steps_per_generation is {steps_per_generation}): Unsloth's GRPO loss (unsloth_zoo "
            "grpo_accumulated_loss) scores each micro-batch on a window widened by that micro-batch's own largest "
            "prompt padding, which is unknown when the advantages are made (TRL shuffles the rows into micro-batches "
            "afterwards), so the counterfactual's per-token advantages cannot be placed. Use micro_batch = batch_size "
            "(0), cf_lambda = 0, or the transformers backend.")
    width = unsloth_window(out["prompt_ids"], out["completion_ids"], pad_id,
                           None if logps is None else logps.shape[1])
    return to_unsloth_layout(adv, out["prompt_ids"], out["completion_ids"], pad_id, width)
