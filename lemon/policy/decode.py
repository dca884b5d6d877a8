"""A plain decoding loop for small policies on the CPU: what `model.generate` does for sampling with a KV cache, minus
its per-step machinery.

Why: on the testbed's 2-layer random policy (SmolLM2's 49k vocabulary, batch 8, one thread) `generate` spent ~10 ms per
decoding step in `torch.multinomial` alone, more than the model's forward and the grammar mask together. Here a token is
drawn by the Gumbel-max trick, argmax(logits / T + G) with G ~ Gumbel(0, 1) i.i.d.: the same distribution as sampling
from softmax(logits / T) (Gumbel 1954; Maddison et al. 2014, "A* sampling", §2), in one pass over the vocabulary.
Tokens the logits processors set to -inf (the grammar) can never win. Temperature 0 is the argmax (greedy).

What is the same as `generate`: the processors are called with the whole sequence so far and the raw next-token logits
(transformers' LogitsProcessor protocol), rows left-padded with positions from the attention mask, a row stops at its
first EOS and is padded afterwards, the cache is the model's own (a transformers Cache). What differs: the random stream
(samples for a seed differ from `generate`'s), and no repetition penalty, top-k / top-p or min-p (lemon samples with
none of them). tests/test_decode.py checks greedy decoding against `generate` token for token and the sampled first
token's frequencies against the softmax.
"""
from __future__ import annotations

from typing import Sequence


def gumbel_argmax(logits, temperature: float, generator):
    """One draw per row from softmax(logits / temperature); argmax when temperature == 0. logits (B, V) -> (B,)."""
    import torch
    if temperature == 0:
        return logits.argmax(-1)
    u = torch.rand(logits.shape, generator=generator, dtype=torch.float32).clamp_(min=1e-20)  # (B, V)
    return (logits.float() / temperature - torch.log(-torch.log(u))).argmax(-1)  # (B,)


def decode(model, ids, attn, *, n: int, temperature: float, max_new_tokens: int, eos_ids: Sequence[int], pad_id: int,
           processors: Sequence = (), seed: int = 0, cache=None) -> list[list[int]]:
    """Sample max_new_tokens at most for each of the P prompts `ids` (P, T) (left-padded, mask `attn` (P, T)), n rows
    per prompt (prompt-major). `cache`: the KV cache of each prompt but its last token, already repeated n times (as
    lemon.policy.rollout's shared-prefix cache); None = prefill here. Returns each row's new tokens up to and including
    its first EOS (rows cut by max_new_tokens have none)."""
    import torch
    rows = ids.repeat_interleave(n, 0)  # (B, T)
    mask = attn.repeat_interleave(n, 0)  # (B, T)
    B = rows.shape[0]
    gen = torch.Generator().manual_seed(seed)
    eos = torch.tensor(sorted(set(int(e) for e in eos_ids)))  # (E,)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, T) positions follow the mask, as generate() computes them
    if cache is None:  # prefill all but the last prompt token; the loop below feeds the last one
        out = model(input_ids=rows[:, :-1], attention_mask=mask[:, :-1], position_ids=pos[:, :-1], use_cache=True)
        cache = out.past_key_values
    step_ids, step_pos = rows[:, -1:], pos[:, -1:]  # (B, 1)
    seq, done, new = rows, torch.zeros(B, dtype=torch.bool), []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            out = model(input_ids=step_ids, attention_mask=mask, position_ids=step_pos, past_key_values=cache,
                        use_cache=True)
            cache = out.past_key_values
            logits = out.logits[:, -1, :]  # (B, V)
            for p in processors:
                logits = p(seq, logits)
            tok = gumbel_argmax(logits, temperature, gen)  # (B,)
            tok = torch.where(done, torch.full_like(tok, pad_id), tok)
            new.append(tok)
            done = done | torch.isin(tok, eos)
            seq = torch.cat([seq, tok[:, None]], 1)  # (B, T + k)
            mask = torch.cat([mask, torch.ones(B, 1, dtype=mask.dtype)], 1)
            step_ids, step_pos = tok[:, None], step_pos + 1
            if bool(done.all()):
                break
    toks = torch.stack(new, 1).tolist() if new else [[] for _ in range(B)]  # (B, L)
    eos_set = set(eos.tolist())
    outs = []
    for r in toks:
        cut = next((i + 1 for i, t in enumerate(r) if t in eos_set), None)
        outs.append(r[:cut] if cut is not None else r)
    return outs
