"""Rollouts of the orchestrator policy: n specs per prompt in ONE batched generate() call, optionally
grammar-constrained.

Constrained (the default in training; why, in lemon.spec.grammar): each row carries its own llguidance matcher for
its SpecGrammar (rows of one batch may come from different domains), and a logits processor masks every token the
grammar forbids before temperature is applied, so a sampled spec is always a prefix of a valid spec and a finished one
always parses. Unconstrained (constraint=None) is the ablation: the invalid-spec penalty applies there.

The sampling distribution under a grammar is the policy's softmax renormalised over the allowed tokens; the trainer's
log-probs (TRL) are of the unmasked policy. Forced tokens (one allowed choice) then have ratio-1 gradients only through
the unmasked log-prob; that is the usual practice with constrained RL sampling and is stated here so nobody is
surprised. Each Sample records how many tokens were allowed at every position (Sample.n_allowed; Sample.forced where one
was), so a trainer can leave forced tokens out of credit assignment, and sample_specs(keep_masks=True) keeps the masks
themselves for log-probs under the renormalised distribution (masked_logprobs). By default a base_role or capacity value
has ONE token path, the tokenizer's own (GrammarConstraint.canonical; lemon.spec.grammar.GrammarCache.matcher says why).

Seeding: the whole call runs under torch.random.fork_rng with torch.manual_seed(seed), so the same seed, prompts and
model give the same samples and the caller's global RNG is untouched. temperature 0 is greedy (evaluation of a trained
policy).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from lemon.spec.grammar import GrammarCache, GrammarError, SpecGrammar, require_llguidance
from lemon.policy.decode import decode
from lemon.policy.dtype import sampling_context


@dataclass(frozen=True)
class Sample:
    """One sampled completion."""

    prompt_index: int
    """Which prompt (index into `prompts`) it answers."""
    token_ids: tuple[int, ...]
    """Completion token ids, padding removed, the EOS token kept when it was generated."""
    text: str
    """The completion decoded with skip_special_tokens=True."""
    finished: bool
    """EOS was generated (under a grammar: the spec was complete); False when max_new_tokens cut it."""
    n_tokens: int
    """len(token_ids)."""
    n_allowed: tuple[int, ...] = ()
    """Per position of token_ids, how many tokens the sampler could choose from: under a grammar the size of the allowed
    set it sampled from (1: a forced token, e.g. a key or a quote); unconstrained, the logits width. Empty only for a
    Sample built by hand."""
    allowed_masks: Any = field(default=None, compare=False, repr=False)
    """sample_specs(keep_masks=True): the allowed-token bitmask at every position, an int32 tensor (n_tokens,
    ceil(V/32)), bit t % 32 of word t // 32 set when token t was allowed (llguidance's layout; all ones unconstrained).
    masked_logprobs turns it into log-probs under the renormalised distribution the sampler drew from. Else None."""

    @property
    def forced(self) -> tuple[bool, ...]:
        """Per position: the grammar allowed exactly one token there (no choice, so no credit to assign)."""
        return tuple(k == 1 for k in self.n_allowed)


@dataclass(frozen=True)
class GrammarConstraint:
    """The grammar of each prompt (one SpecGrammar for all, or one per prompt) and the cache that compiles them."""

    grammars: SpecGrammar | tuple[SpecGrammar, ...]
    """One grammar for every prompt, or a tuple with one per prompt."""
    cache: GrammarCache = field(default_factory=GrammarCache, compare=False)
    """Pass the trainer's cache so each (tokenizer, grammar) compiles once per run."""
    canonical: bool = True
    """Each base_role / capacity value has one token path, the tokenizer's own (GrammarCache.matcher): the choice of a
    value is then one decision with one probability. False: any token path that spells the value (the text grammar)."""

    def __post_init__(self):
        g = self.grammars
        if not isinstance(g, SpecGrammar) and not (isinstance(g, tuple) and g
                                                   and all(isinstance(x, SpecGrammar) for x in g)):
            raise TypeError("grammars must be a SpecGrammar or a non-empty tuple of them (one per prompt)")

    def for_prompts(self, n_prompts: int) -> tuple[SpecGrammar, ...]:
        if isinstance(self.grammars, SpecGrammar):
            return (self.grammars,) * n_prompts
        if len(self.grammars) != n_prompts:
            raise ValueError(f"{len(self.grammars)} grammars for {n_prompts} prompts: give one per prompt or "
                             "a single one")
        return self.grammars


def generate_is_unsloth(model) -> bool:
    """model.generate is Unsloth's wrapper: both wrappers keep transformers' own as `_old_generate` (2026.10.9 llama.py
    FastLlamaModel.from_pretrained, vision.py FastBaseModel.from_pretrained; 2025.9.1 likewise). A peft model forwards
    the attribute lookup to the model it wraps. What else Unsloth changes: lemon.train.unsloth_compat."""
    try:
        return getattr(model, "_old_generate", None) is not None
    except Exception:  # an exotic __getattr__: not Unsloth's
        return False


def _eos_ids(model, tokenizer) -> list[int]:
    return eos_ids_of(getattr(model, "generation_config", None), tokenizer)


def eos_ids_of(generation_config, tokenizer) -> list[int]:
    """The ids generate() stops on: the generation config's eos_token_id (an int or a list), else the tokenizer's
    EOS."""
    eos = getattr(generation_config, "eos_token_id", None)
    eos = tokenizer.eos_token_id if eos is None else eos
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def _vocab_width(model, tokenizer) -> int:
    emb = model.get_output_embeddings()
    return int(emb.weight.shape[0]) if emb is not None else len(tokenizer)


def sample_specs(model, tokenizer, prompts: Sequence[list[dict]], *, n: int, temperature: float, max_new_tokens: int,
                 seed: int, constraint: GrammarConstraint | None = None, dtype: str = "model",
                 keep_masks: bool = False, decoder: str = "auto") -> list[Sample]:
    """n completions for each chat prompt (lemon.eval.orchestrator.orchestrator_messages), prompt-major order: samples
    [i*n:(i+1)*n] answer prompts[i]. `dtype`: 'model' (its own weights' dtype) or 'autocast_bf16' (measured 3x slower
    for decoding; lemon.policy.dtype). For bf16 speed on a native-bf16 CPU pass a lemon.policy.dtype.SamplingCopy's
    sync() as the model. The model may be a peft model (adapters stay unmerged); its train/eval mode is restored
    afterwards. keep_masks: also return each sample's allowed-token bitmasks (Sample.allowed_masks; ~V/8 bytes per
    token). decoder: 'loop' (lemon.policy.decode), 'generate' (transformers), or 'auto': the loop on the CPU for a model
    whose forward returns a transformers Cache, generate otherwise (Unsloth's patched generate on CUDA). Both draw from
    the same distribution with different random streams, so a seed's samples depend on the decoder."""
    if decoder not in ("auto", "loop", "generate"):
        raise ValueError(f"decoder={decoder!r}; valid: auto, loop, generate")
    import torch
    if n < 1 or max_new_tokens < 1 or temperature < 0:
        raise ValueError(f"need n >= 1, max_new_tokens >= 1 and temperature >= 0 (got {n}, {max_new_tokens}, "
                         f"{temperature})")
    if not prompts:
        return []
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = _eos_ids(model, tokenizer)
    enc = [list(tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"])
           for p in prompts]
    width = max(map(len, enc))
    dev = model.device
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in enc], device=dev)  # (P, T) left-padded
    attn = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in enc], device=dev)  # (P, T)
    procs, mask = [], None
    n_vocab = _vocab_width(model, tokenizer)
    if constraint is not None:
        grammars = [g for g in constraint.for_prompts(len(prompts)) for _ in range(n)]
        mask = GrammarMask(tokenizer, grammars, constraint.cache, prompt_len=width, eos_ids=eos, n_vocab=n_vocab,
                           canonical=constraint.canonical, keep_masks=keep_masks)
        procs.append(mask)
    from transformers import GenerationConfig, LogitsProcessorList
    sample = temperature > 0
    # every sampling knob explicit: generate() fills unset ones from the model's generation_config (hub Qwen sets
    # top_k=20, top_p=0.8, repetition_penalty=1.05), which would make rollouts differ from the policy the trainer scores
    knobs = (dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0, min_p=0.0) if sample
             else dict(do_sample=False))
    gcfg = GenerationConfig(max_new_tokens=max_new_tokens, repetition_penalty=1.0, eos_token_id=eos, pad_token_id=pad,
                            use_cache=True, **knobs)
    was_training = model.training
    model.eval()
    try:
        # CPU state is always forked; CUDA's only when it samples there
        rng_devices = [dev] if dev.type == "cuda" else []
        with torch.random.fork_rng(devices=rng_devices), torch.no_grad(), sampling_context(dtype, dev):
            # Unsloth's generate() sets cache_implementation, which transformers refuses beside a cache: no shared
            # prefix
            cache = None if generate_is_unsloth(model) else _shared_prefix_cache(model, ids, attn, n)
            torch.manual_seed(seed)
            loop = decoder == "loop" or (decoder == "auto" and cache is not None and dev.type == "cpu")
            if loop:  # the plain loop (lemon.policy.decode: ~1.3-1.5x per decoding step on the CPU)
                new = decode(model, ids, attn, n=n, temperature=temperature, max_new_tokens=max_new_tokens, eos_ids=eos,
                             pad_id=pad, processors=procs, seed=seed, cache=cache)  # (B, L) cut after each row's EOS
            else:
                out = model.generate(input_ids=ids.repeat_interleave(n, 0), attention_mask=attn.repeat_interleave(n, 0),
                                     past_key_values=cache, generation_config=gcfg,
                                     logits_processor=LogitsProcessorList(procs))
                new = out[:, width:].tolist()  # (B, L)
    finally:
        model.train(was_training)
    counts = mask.allowed_counts() if mask is not None else None  # (B, L)
    samples = []
    eos_set = set(eos)
    for r, toks in enumerate(new):
        cut = next((i + 1 for i, t in enumerate(toks) if t in eos_set), None)  # HF pads only after a row's EOS
        toks = toks[:cut] if cut is not None else toks
        n_allowed = tuple(counts[r][:len(toks)]) if counts is not None else (n_vocab,) * len(toks)
        masks = None
        if keep_masks:
            masks = mask.row_masks(r, len(toks)) if mask is not None else \
                torch.full((len(toks), (n_vocab + 31) // 32), -1, dtype=torch.int32)  # (L, ceil(V/32)) all allowed
        samples.append(Sample(r // n, tuple(toks), tokenizer.decode(toks, skip_special_tokens=True), cut is not None,
                              len(toks), n_allowed, masks))
    return samples


def unpack_bitmask(bitmask, n_vocab: int):
    """llguidance's packed allowed-token bitmask (..., ceil(V/32)) int32 -> (..., n_vocab) bool: token t is bit t % 32
    of word t // 32 (llguidance.torch.apply_token_bitmask_inplace's layout)."""
    import torch
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)  # (32,)
    return ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(-2)[..., :n_vocab]  # (..., V)


def masked_logprobs(logits, allowed_masks, token_ids=None):
    """Log-probs under the distribution a constrained sampler draws from: log-softmax over the allowed tokens only
    (the policy's softmax renormalised over them; forbidden tokens get -inf). logits (..., L, V), already divided by the
    sampling temperature; allowed_masks (..., L, ceil(V/32)) int32 (Sample.allowed_masks). With token_ids (..., L):
    their log-probs, (..., L); without: the whole (..., L, V). Differentiable in the logits."""
    import torch
    allowed = unpack_bitmask(allowed_masks.to(logits.device), logits.shape[-1])  # (..., L, V)
    lp = torch.log_softmax(logits.float().masked_fill(~allowed, float("-inf")), -1)  # (..., L, V)
    if token_ids is None:
        return lp
    return lp.gather(-1, torch.as_tensor(token_ids, device=logits.device).long().unsqueeze(-1)).squeeze(-1)  # (..., L)


def _shared_prefix_cache(model, ids, attn, n: int):
    """The KV cache of each prompt but its last token, computed ONCE per prompt and repeated for its n rows: the prompt
    (~500 tokens) is most of a rollout's compute on CPU, and its n copies are identical. generate() then starts from the
    last prompt token. Positions follow the attention mask, as generate() computes them for left-padded rows. None
    (generate() then prefills every row itself, the same samples) when the forward returns no transformers Cache:
    Unsloth's returns a legacy tuple of (K, V) per layer (lemon.train.unsloth_compat), with no
    batch_repeat_interleave."""
    if ids.shape[1] < 2:
        return None
    pos = (attn.cumsum(-1) - 1).clamp(min=0)  # (P, T)
    out = model(input_ids=ids[:, :-1], attention_mask=attn[:, :-1], position_ids=pos[:, :-1], use_cache=True)
    cache = out.past_key_values
    if not hasattr(cache, "batch_repeat_interleave"):
        return None
    if n > 1:
        cache.batch_repeat_interleave(n)
    return cache


class GrammarMask:
    """A transformers LogitsProcessor: row b's logits keep only the tokens its grammar allows next. Each call first
    feeds the previous step's sampled token to the row's matcher, then fills all rows' bitmasks (llguidance, in parallel
    threads) and applies them. Finished rows (EOS taken) are left unmasked: generate() overwrites their tokens with pad.
    Each call also records how many tokens every row was allowed (one sum over the (B, V) mask it builds anyway) and,
    with keep_masks, a copy of the packed bitmask: step t of generate() is position t of each completion."""

    def __init__(self, tokenizer, grammars: Sequence[SpecGrammar], cache: GrammarCache, *, prompt_len: int,
                 eos_ids: Sequence[int], n_vocab: int, canonical: bool = True, keep_masks: bool = False):
        import torch
        llg, _ = require_llguidance()
        import llguidance.torch as llg_torch
        self._fill = llg_torch.fill_next_token_bitmask_par
        self.matchers = [cache.matcher(tokenizer, g, n_vocab=n_vocab, eos_ids=eos_ids, canonical=canonical)
                         for g in grammars]
        self.executor = llg.LLExecutor()
        self.prompt_len, self.eos, self.n_vocab = prompt_len, set(eos_ids), n_vocab
        self.done = [False] * len(grammars)
        self.bitmask = torch.full(((len(grammars)), (n_vocab + 31) // 32), -1, dtype=torch.int32)  # (B, ceil(V/32))
        self.counts: list = []  # per step: (B,) allowed-token counts
        self.masks: list | None = [] if keep_masks else None  # per step: (B, ceil(V/32)) copies

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] > self.prompt_len:
            for b, t in enumerate(input_ids[:, -1].tolist()):
                if self.done[b]:
                    continue
                if not self.matchers[b].consume_token(t):
                    raise GrammarError(f"row {b}: token {t} was not allowed by its grammar after masking "
                                       f"({self.matchers[b].get_error()})")
                self.done[b] = t in self.eos
        live = [(m, b) for b, m in enumerate(self.matchers) if not self.done[b]]
        self.bitmask.fill_(-1)
        if live:
            self._fill(self.executor, live, self.bitmask)
        allowed = unpack_bitmask(self.bitmask, scores.shape[1])  # (B, V)
        self.counts.append(allowed.sum(-1))  # (B,)
        if self.masks is not None:
            self.masks.append(self.bitmask.clone())
        return scores.masked_fill(~allowed.to(scores.device), float("-inf"))

    def allowed_counts(self) -> list[list[int]]:
        """(B, steps) allowed-token counts, one row per sample."""
        import torch
        return torch.stack(self.counts, 1).tolist() if self.counts else [[] for _ in self.matchers]

    def row_masks(self, row: int, length: int):
        """Row `row`'s bitmasks of its first `length` steps, (length, ceil(V/32)) int32."""
        import torch
        if not length:
            return self.bitmask.new_empty((0, self.bitmask.shape[1]))
        return torch.stack([m[row] for m in self.masks[:length]])  # (length, ceil(V/32))
