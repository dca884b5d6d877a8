"""Unsloth on CPU, by stand-ins rebuilt from its source (unsloth / unsloth_zoo 2026.10.9, the requirements-gpu.txt pin,
and unsloth 2025.9.1; lemon.train.unsloth_compat says what each piece does and where). Issue 29, findings 2 and 3.

Sampling: a tiny random Qwen2 patched to behave, as seen from outside, like Unsloth's FastLanguageModel / FastModel: its
forward returns legacy tuple caches and its generate() sets cache_implementation. Specs sampled through it equal the
plain model's with the same seed.

The loss: the real CF-GRPO mixin on a GRPOTrainer class that says it is Unsloth's; the advantages it hands over go
through Unsloth's loss arithmetic, re-implemented below from unsloth_zoo's source, on a batch whose prompts differ in
length. The per-token weights that arithmetic applies must sit on the counterfactual's edited span only, with TRL's
value, and nothing on an errored rollout."""
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("trl")
from _tiny import tiny_model  # noqa: E402  (tests/_tiny.py)

# ------------------------------------------------------------------------------------------------------------- sampling


def _unsloth_like(model, *, tuple_cache: bool, force: str | None):
    """Patch a transformers model instance as Unsloth's loaders do, as far as a caller sees it.
    tuple_cache: forward() returns the cache as a tuple of (K, V) per layer (unsloth/models/llama.py
    LlamaModel_fast_forward,
      `next_decoder_cache += (...)`; CausalLM_fast_forward passes it out). Inside generate() Unsloth's own
      _fast_prepare_inputs_for_generation converts it back and forth, so the stand-in leaves transformers' Cache there.
    force: how generate() sets cache_implementation whatever the caller passed: 'kwarg' = 2025.9.1 llama.py
      unsloth_fast_generate (`kwargs["cache_implementation"] = "dynamic"`), 'config' = 2026.10.9 vision.py
      unsloth_base_fast_generate (writes it into the caller's generation_config; "static" there, "dynamic" here so the
      CPU run needs no static cache). Both keep transformers' generate as `_old_generate`, as Unsloth does."""
    from transformers.cache_utils import Cache
    hf_forward, hf_generate = model.forward, model.generate
    depth = []

    def forward(*a, **kw):
        out = hf_forward(*a, **kw)
        if not depth and isinstance(getattr(out, "past_key_values", None), Cache):
            out.past_key_values = tuple((layer.keys, layer.values) for layer in out.past_key_values.layers)
        return out

    def generate(*a, **kw):
        if force == "kwarg":
            kw["cache_implementation"] = "dynamic"
        elif force == "config":
            kw["generation_config"].cache_implementation = "dynamic"
        depth.append(1)
        try:
            return hf_generate(*a, **kw)
        finally:
            depth.pop()

    if tuple_cache:
        model.forward = forward
    if tuple_cache or force:
        model.generate = generate
    # force=None with tuple_cache: a wrapper the sampler cannot recognise, so its forward's cache must give it away
    if force:
        model._old_generate = hf_generate
    return model


PROMPTS = [[{"role": "user", "content": "Plan: 3 apples."}],
           [{"role": "user", "content": "Plan: how many apples are left after 7 days of eating two?"}]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    tiny_model(path)
    return path


def _load(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("tuple_cache,force,peft", [(True, "kwarg", False), (True, "kwarg", True), (True, None, False),
                                                    (False, "config", False)],
                         ids=["fast_language_model", "fast_language_model_peft", "tuple_cache_only", "fast_model"])
def test_unsloth_like_model_samples_what_the_plain_model_samples(tiny, tuple_cache, force, peft):
    from lemon.policy.rollout import sample_specs
    plain, tok = _load(tiny)
    other, _ = _load(tiny)
    model = _unsloth_like(other, tuple_cache=tuple_cache, force=force)
    if peft:  # Unsloth's policy is a peft model around the patched one; a fresh adapter (B = 0) changes no output
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    for t in (1.0, 0.0):  # rollouts and greedy evaluation share the path
        # an Unsloth-like model samples through generate (its patched one on CUDA): the same samples as the plain
        # model's generate; the plain model's default CPU decoder (the loop) agrees token for token when greedy
        want = sample_specs(plain, tok, PROMPTS, n=3, temperature=t, max_new_tokens=12, seed=7, decoder="generate")
        got = sample_specs(model, tok, PROMPTS, n=3, temperature=t, max_new_tokens=12, seed=7)
        assert got == want
        if t == 0.0:
            assert sample_specs(plain, tok, PROMPTS, n=3, temperature=t, max_new_tokens=12, seed=7) == want
    assert len({s.token_ids for s in want[:3]}) == 1 and len({s.token_ids for s in got}) > 1  # greedy rows agree


# ----------------------------------------------------------------------------------------------------------------- loss

# character-level tiny vocab: ids 0..94 printable characters, 95 pad, 96 eos. Rows 0-1 answer the short prompt, 2-3 the
# long one; equal rewards everywhere (no global GRPO signal); row 0 carries a counterfactual on its completion tokens
# 2..5; row 2's execution errored.
COMPLETIONS = [[65, 12, 70, 71, 72, 73, 20, 33, 41, 96], [66, 14, 25, 31, 96], [67, 15, 26, 96],
               [68, 16, 27, 28, 29, 96]]
SPAN, DELTA, FLOOR, REWARD, ERRORED = (2, 3, 4, 5), 1.0, 0.1, 0.5, 2


class _Rollouts:
    """What lemon.train.episodes.SpecRollouts gives the trainer: TRL's rollout_func and the step's scored records."""

    def __init__(self, tok, lam: float):
        from lemon.run.executor import NodeCache
        from lemon.train.edits import FamilySampler
        from lemon.train.rewards import RewardBreakdown, RewardConfig
        from lemon.train.scoring import Rollout
        self.tok, self.cf_lambda, self.scale_rewards = tok, lam, "batch"
        self.std_floor, self.curriculum_ids = FLOOR, None
        self.scorer = SimpleNamespace(reward_cfg=RewardConfig(), sampler=FamilySampler(), cache=NodeCache())
        ok = RewardBreakdown(total=REWARD, success=1.0, token_efficiency=0.5, graph_cost=0.0, valid=True,
                             worker_tokens=9)
        bad = RewardBreakdown(total=None, success=0.0, token_efficiency=0.0, graph_cost=0.0, valid=True,
                              worker_tokens=0, errored=True)
        self.batch = [Rollout("q", "spec", tuple(c), i // 2, True, None, bad if i == ERRORED else ok, agents=2, edges=1)
                      for i, c in enumerate(COMPLETIONS)]
        self.batch[0].family, self.batch[0].delta, self.batch[0].cf_status = "capacity", DELTA, "ok"
        self.batch[0].span_positions = SPAN
        self.last_stats = {}

    def __call__(self, prompts, trainer):
        ids = [list(self.tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True,
                                                 return_dict=True)["input_ids"]) for p in prompts]
        return {"prompt_ids": ids, "completion_ids": [list(c) for c in COMPLETIONS], "logprobs": None,
                "rollout_index": list(range(len(COMPLETIONS)))}


def _trainer(tiny, tmp_path, lam: float, micro_batch: int):
    """The CF-GRPO class exactly as trainer_class('unsloth') builds it, on a GRPOTrainer subclass named and placed as
    Unsloth's patched one (unsloth_compiled_cache.UnslothGRPOTrainer); TRL's own generation path runs underneath."""
    import trl
    from datasets import Dataset
    from lemon.train.grpo import CFGRPOMixin, reward_functions
    base = type("UnslothGRPOTrainer", (trl.GRPOTrainer,), {"__module__": "unsloth_compiled_cache.UnslothGRPOTrainer"})
    cls = type("CFGRPOTrainer", (CFGRPOMixin, base), {})
    model, tok = _load(tiny)
    rollouts = _Rollouts(tok, lam)
    funcs, weights = reward_functions(rollouts)
    args = trl.GRPOConfig(output_dir=str(tmp_path / "grpo"), max_steps=1, per_device_train_batch_size=micro_batch,
                          gradient_accumulation_steps=len(COMPLETIONS) // micro_batch, num_generations=2,
                          max_completion_length=16, beta=0.0, reward_weights=weights, save_strategy="no",
                          report_to="none", use_cpu=True, bf16=False, disable_tqdm=True, log_completions=False)
    trainer = cls(model=model, processing_class=tok, reward_funcs=funcs, args=args,
                  train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS]), rollouts=rollouts)
    return trainer, tok


def _step(trainer):
    return trainer._generate_and_score_completions([{"prompt": PROMPTS[i // 2]} for i in range(len(COMPLETIONS))])


def _unsloth_token_weights(out: dict, pad: int):
    """d loss / d (the policy's log-prob of each scored column), by unsloth_zoo 2026.10.9 rl_replacements.py:
    unsloth compute_loss: input_ids = cat(prompt_ids, completion_ids), logits_to_keep = T
    (unsloth/models/rl_replacements.py grpo_trainer_compute_loss, lines 4800-4817); grpo_accumulated_loss, text path
    (lines 2962-2981): M from the prompts' pad counts (calculate_pad_tokens_in_prompt, 680-695; no old/ref logps at beta
    0 on-policy), left_pack_padding (778-785), the window of the last T + M columns, completion_mask rebuilt by
    create_completion_attention_mask (700-724); the logits of those columns (3712-3713); grpo_compute_loss (936-1250)
    with loss_type dapo: old None -> coef_1 = exp(new - new.detach()) (1116, 1133), loss_i = -min(coef_1 A,
    clamp(coef_1) A) (1164), sum(loss_i * mask) / num_items_in_batch (1233-1243), advantages (B,) unsqueezed (1003).
    Returns (weights (B, T + M), the window's token ids, M, left pads)."""
    prompt_ids, completion_ids = out["prompt_ids"], out["completion_ids"]
    T = completion_ids.shape[1]
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    lp = (input_ids[:, :-T] == pad).sum(dim=1)  # calculate_pad_tokens_in_prompt
    M = int(lp.max())
    order = torch.argsort((input_ids != pad).int(), dim=1, descending=True, stable=True)  # left_pack_padding
    window = torch.gather(input_ids, 1, order)[:, -(T + M):]
    mask = (torch.arange(T + M)[None] >= (M - lp)[:, None]) & (window != pad)  # create_completion_attention_mask
    new = torch.zeros(window.shape, requires_grad=True)  # the weights below do not depend on the log-probs' values
    adv = out["advantages"]
    adv = adv.unsqueeze(1) if adv.dim() == 1 else adv
    coef_1 = torch.exp(new - new.detach())
    loss_i = -torch.min(coef_1 * adv, torch.clamp(coef_1, 1 - 0.2, 1 + 0.2) * adv)
    loss = (loss_i * mask).sum() / out["num_items_in_batch"].clamp(min=1.0)
    loss.backward()
    return new.grad, window, M, lp


def test_unsloth_loss_puts_the_cf_contrast_on_the_edited_span_only(tiny, tmp_path):
    trainer, tok = _trainer(tiny, tmp_path, lam=1.0, micro_batch=len(COMPLETIONS))  # one micro-batch per step
    out = _step(trainer)
    pad = tok.pad_token_id
    weights, window, M, lp = _unsloth_token_weights(out, pad)
    assert M > 0 and len(set(lp.tolist())) == 2  # the two prompts' lengths differ: the window is wider than T
    n_kept = sum(len(c) for i, c in enumerate(COMPLETIONS) if i != ERRORED)
    assert int(out["num_items_in_batch"]) == n_kept  # TRL's count without the errored rollout
    want = torch.zeros_like(weights)
    for b, comp in enumerate(COMPLETIONS):
        for t, tid in enumerate(comp):
            col = M - int(lp[b]) + t  # where Unsloth scores completion token t of row b
            assert int(window[b, col]) == tid  # the packing really puts it there
            if b == 0 and t in SPAN:
                want[b, col] = -(1.0 * DELTA / FLOOR) / n_kept  # -A_t / N: lambda * delta / max(std = 0, floor), dapo
    assert torch.allclose(weights, want, atol=1e-7), (weights - want).abs().max()
    assert torch.all(weights[ERRORED] == 0)


def test_unsloth_plain_grpo_gets_per_rollout_advantages(tiny, tmp_path):
    """cf_lambda = 0: Unsloth's own (B,) form, which no micro-batch split can misplace."""
    trainer, tok = _trainer(tiny, tmp_path, lam=0.0, micro_batch=2)
    out = _step(trainer)
    assert out["advantages"].shape == (len(COMPLETIONS),) and torch.all(out["advantages"] == 0)  # equal rewards
    weights, _, _, _ = _unsloth_token_weights(out, tok.pad_token_id)
    assert torch.all(weights == 0)


def test_unsloth_cf_grpo_refuses_a_step_split_into_micro_batches(tiny, tmp_path):
    trainer, _ = _trainer(tiny, tmp_path, lam=1.0, micro_batch=2)
    with pytest.raises(ValueError, match="micro_batch = batch_size"):
        _step(trainer)


def test_layout_follows_unsloths_packing_with_pads_anywhere():
    """to_unsloth_layout against the packing arithmetic above, on prompts padded left and inside, and a pad token inside
    a completion (Unsloth's left_pack_padding moves every pad, so later tokens shift)."""
    from lemon.train.unsloth_compat import to_unsloth_layout, unsloth_window
    pad = 0
    prompt_ids = torch.tensor([[0, 0, 5, 6], [7, 0, 8, 9], [1, 2, 3, 4]])
    completion_ids = torch.tensor([[11, 12, 13, 0], [14, 0, 15, 16], [17, 18, 0, 0]])
    adv = torch.arange(1.0, 13.0).view(3, 4) * (completion_ids != pad)
    width = unsloth_window(prompt_ids, completion_ids, pad)
    assert width == 4 + 2
    got = to_unsloth_layout(adv, prompt_ids, completion_ids, pad, width)
    out = {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "advantages": got,
           "num_items_in_batch": torch.tensor(1.0)}
    weights, window, _, _ = _unsloth_token_weights(out, pad)
    placed = {(b, int(window[b, j])): -float(weights[b, j]) for b in range(3) for j in range(width) if weights[b, j]}
    want = {(b, int(completion_ids[b, t])): float(adv[b, t]) for b in range(3) for t in range(4) if adv[b, t]}
    assert placed == want
