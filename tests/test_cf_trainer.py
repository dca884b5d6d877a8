"""The counterfactual term inside the REAL trainer (issue 28 C): lemon.train.grpo's CF-GRPO trainer class, TRL's own
generation/scoring path, TRL's loss, backward and one AdamW step, on a tiny random Qwen2 with LoRA (tests/_tiny.py).

A group of two rollouts with EQUAL rewards (no global GRPO signal) where rollout 0 carries a counterfactual contrast on
a known span of its completion tokens. What must hold (DESIGN.md, "Counterfactual GRPO, concretely": "with A_i = 0 the
gradient is non-zero only on S_i"):
- cf_lambda = 1: the LoRA gradient the trainer steps with equals the gradient of an obvious reference loss that sums
  -A_t log p(y_t | prompt, y_<t) over the SPAN tokens only, one forward per token (A_t = lambda * delta / max(std,
  floor), divided by TRL's token count); it differs from the same reference summed over the whole completion, so a
  trainer that spread the contrast over every token (span mask ignored) fails; the LoRA weights move.
- cf_lambda = 0 (the same batch): every LoRA gradient is exactly zero and no LoRA weight changes.
The rollout function is a stand-in (fixed token ids and scored records; no sampling, no workers): everything after it is
the code `lemon train` runs."""
import math
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("trl")
from _tiny import tiny_model  # noqa: E402  (tests/_tiny.py)
from lemon.train.grpo import CPU_MIN_TRL  # noqa: E402

import trl  # noqa: E402
if tuple(int(x) for x in trl.__version__.split(".")[:2]) < CPU_MIN_TRL:  # the GPU environment's trl (lemon.train.grpo)
    pytest.skip(f"trl {trl.__version__} cannot train on a CPU (check_trl_cpu); this test trains on the CPU",
                allow_module_level=True)

from lemon.run.executor import NodeCache  # noqa: E402
from lemon.train.edits import FamilySampler  # noqa: E402
from lemon.train.rewards import RewardBreakdown, RewardConfig  # noqa: E402
from lemon.train.scoring import Rollout  # noqa: E402

PROMPT = [{"role": "user", "content": "Plan: 3 apples."}]
# character-level tiny vocab: ids 0..94 are printable characters, 95 pad, 96 eos
COMPLETIONS = [[65, 12, 70, 71, 72, 73, 20, 33, 41, 96], [66, 14, 25, 31, 96]]
SPAN = (2, 3, 4, 5)  # rollout 0's edited field: completion positions 2..5
DELTA, FLOOR, REWARD = 1.0, 0.1, 0.5


class _Rollouts:
    """What lemon.train.episodes.SpecRollouts gives the trainer (TRL's rollout_func + the scored records of the
    step)."""

    def __init__(self, tok, lam: float, forced: tuple = ()):
        self.mask_forced = bool(forced)
        self.tok, self.cf_lambda, self.scale_rewards = tok, lam, "batch"
        self.std_floor, self.curriculum_ids = FLOOR, None
        self.scorer = SimpleNamespace(reward_cfg=RewardConfig(), sampler=FamilySampler(), cache=NodeCache())
        br = RewardBreakdown(total=REWARD, success=1.0, token_efficiency=0.5, graph_cost=0.0, valid=True,
                             worker_tokens=10)
        self.batch = [Rollout("q", "spec", tuple(c), 0, True, None, br, agents=2, edges=1) for c in COMPLETIONS]
        self.batch[0].family, self.batch[0].delta, self.batch[0].cf_status = "capacity", DELTA, "ok"
        self.batch[0].span_positions = SPAN
        self.batch[0].forced_positions = forced
        self.last_stats = {}
        self.calls = 0

    def prompt_ids(self):
        return list(self.tok.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True,
                                                 return_dict=True)["input_ids"])

    def __call__(self, prompts, trainer):
        assert len(prompts) == len(COMPLETIONS)
        self.calls += 1
        return {"prompt_ids": [self.prompt_ids()] * len(COMPLETIONS), "completion_ids": [list(c) for c in COMPLETIONS],
                "logprobs": None, "rollout_index": list(range(len(COMPLETIONS)))}


def _lora(model):
    return {n: p for n, p in model.named_parameters() if "lora_" in n}


def _policy(path):
    from lemon.policy.model import PolicyConfig, load_policy
    # fp32 explicitly: 'auto' loads bf16 wherever CUDA exists, and this test's trainer runs on the CPU (use_cpu=True)
    # against an fp32 reference (on the H200 machine 'auto' gave a 5e-4 gradient mismatch, 2026-12-04)
    model, tok = load_policy(PolicyConfig(model=str(path), backend="transformers", lora_r=4, lora_alpha=8,
                                          dtype="fp32"), seed=0)
    with torch.no_grad():  # LoRA B starts at 0 (so A would get no gradient): give every adapter weight a value
        g = torch.Generator().manual_seed(1)
        for p in _lora(model).values():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model, tok


def _reference_grads(model, prompt_ids, positions_of, max_grad_norm):
    """The gradient TRL's dapo loss should produce, the slow obvious way: -(1/N) sum_i sum_{t in positions_of(i)}
    A_t log p(y_t | prompt, y_<t), one forward per token on the unpadded sequence; N = all completion tokens of the
    batch; A_t = lambda * delta / max(std of the equal rewards = 0, floor); clipped to max_grad_norm as the Trainer
    does."""
    params = _lora(model)
    n_tokens = sum(len(c) for c in COMPLETIONS)
    adv = 1.0 * DELTA / max(0.0, FLOOR)
    loss = 0.0
    for i, comp in enumerate(COMPLETIONS):
        for t in positions_of(i):
            ids = torch.tensor([prompt_ids + comp[:t]])
            logp = torch.log_softmax(model(input_ids=ids).logits[0, -1].float(), -1)[comp[t]]
            loss = loss - adv * logp / n_tokens
    grads = torch.autograd.grad(loss, list(params.values()))
    norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads))
    coef = min(1.0, max_grad_norm / (norm + 1e-6))
    return {n: g * coef for n, g in zip(params, grads)}


def _train_one_step(tmp_path, lam: float, compact: bool = False, forced: tuple = ()):
    """Build the real CF-GRPO trainer (lemon.train.grpo.trainer_class, reward_functions) on the tiny policy and run
    Trainer.train for one step; returns (model before the step's LoRA weights, gradients at the optimizer step,
    after)."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig
    from lemon.train.grpo import reward_functions, trainer_class
    model, tok = _policy(tmp_path / "tiny")
    rollouts = _Rollouts(tok, lam, forced)
    funcs, weights = reward_functions(rollouts)
    args = GRPOConfig(output_dir=str(tmp_path / f"grpo-{lam}"), max_steps=1, learning_rate=1e-2,
                      per_device_train_batch_size=len(COMPLETIONS), gradient_accumulation_steps=1,
                      num_generations=len(COMPLETIONS), max_completion_length=16, temperature=1.0, beta=0.0,
                      reward_weights=weights, logging_steps=1, save_strategy="no", report_to="none", seed=0,
                      use_cpu=True, bf16=False, gradient_checkpointing=False, disable_tqdm=True, log_completions=False)
    Trainer = trainer_class("transformers")
    trainer = Trainer(model=model, processing_class=tok, reward_funcs=funcs, args=args,
                      train_dataset=Dataset.from_list([{"prompt": PROMPT}]), rollouts=rollouts)
    before = {n: p.detach().clone() for n, p in _lora(trainer.model).items()}
    grads = {}

    class Grab(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kw):  # after backward and clipping, before AdamW
            grads.update({n: None if p.grad is None else p.grad.detach().clone()
                          for n, p in _lora(trainer.model).items()})
    trainer.add_callback(Grab())
    from lemon.train.grpo import completion_only_lm_head
    if compact:  # what lemon.train.pipeline does: only the completion's positions go through the LM head
        import trl.trainer.utils as U
        real_apply, rows = U._ChunkedLogProbFunction.apply, []

        def spy(hidden, *a):
            rows.append(hidden.shape[0])
            return real_apply(hidden, *a)
        U._ChunkedLogProbFunction.apply = spy
        try:
            with completion_only_lm_head() as on:
                assert on
                trainer.train()
        finally:
            U._ChunkedLogProbFunction.apply = real_apply
        # one forward of the step: exactly the completion tokens are scored (not prompt + completion + padding)
        assert rows == [sum(len(c) for c in COMPLETIONS)], rows
    else:
        trainer.train()
    assert rollouts.calls == 1 and trainer.state.global_step == 1
    after = {n: p.detach().clone() for n, p in _lora(trainer.model).items()}
    return trainer, rollouts, before, grads, after


@pytest.mark.parametrize("compact", [False, True], ids=["trl-cpu-default", "completion-only-head"])
def test_cf_term_trains_only_through_the_edited_span_and_lambda_zero_trains_nothing(tmp_path, compact):
    """compact=True: the same checks with lemon.train.grpo.completion_only_lm_head on (how lemon.train.pipeline trains),
    so the faster LM-head path is held to the same per-token reference as trl's own."""
    tiny_model(tmp_path / "tiny")
    # lambda = 0: the same batch, equal rewards -> no gradient at all, no weight moves
    _, _, before0, grads0, after0 = _train_one_step(tmp_path, 0.0, compact)
    assert grads0 and all(g is not None for g in grads0.values())  # backward ran through every adapter weight...
    assert all(torch.all(g == 0) for g in grads0.values())  # ...and gave exactly nothing
    assert all(torch.equal(before0[n], after0[n]) for n in before0)

    # lambda = 1: the reference gradients, computed at the weights the step starts from
    trainer, rollouts, before, grads, after = _train_one_step(tmp_path, 1.0, compact)
    model, _ = _policy(tmp_path / "tiny")  # the same seeded weights as the trainer's model before its step
    assert all(torch.equal(p, before[n]) for n, p in _lora(model).items())
    pids = rollouts.prompt_ids()
    clip = trainer.args.max_grad_norm
    span_ref = _reference_grads(model, pids, lambda i: SPAN if i == 0 else (), clip)
    whole_ref = _reference_grads(model, pids, lambda i: range(len(COMPLETIONS[0])) if i == 0 else (), clip)
    assert grads.keys() == span_ref.keys() and all(g is not None for g in grads.values())
    flat = lambda gs: torch.cat([gs[n].flatten() for n in sorted(gs)])  # noqa: E731
    got, span, whole = flat(grads), flat(span_ref), flat(whole_ref)
    assert got.abs().max() > 1e-4  # a real signal, not a vacuous match of zeros
    assert torch.allclose(got, span, rtol=1e-4, atol=1e-7), (got - span).abs().max()
    # the span restriction is visible in the gradient: a trainer that put the contrast on every token would fail above
    assert not torch.allclose(whole, span, rtol=1e-2, atol=1e-5)
    assert any(not torch.equal(before[n], after[n]) for n in before)  # and the AdamW step moved the adapter


def test_completion_only_lm_head_is_scoped_and_cpu_only():
    import trl.trainer.utils as U
    from lemon.train.grpo import completion_only_lm_head
    real = U._use_triton
    with completion_only_lm_head() as on:
        assert on and U._use_triton(torch.device("cpu")) is True
        assert U._use_triton(torch.device("meta")) == real(torch.device("meta"))  # other devices: trl's own answer
    assert U._use_triton is real


def test_grammar_forced_tokens_carry_no_advantage(tmp_path):
    """Rollout 0's span has two positions the grammar forced (one allowed token): with the trainer's forced-token mask
    on, the step's gradient is the reference over the span's OTHER positions only (lemon.train.cf.forced_mask)."""
    tiny_model(tmp_path / "tiny")
    forced = (3, 4)
    trainer, rollouts, before, grads, _ = _train_one_step(tmp_path, 1.0, forced=forced)
    model, _ = _policy(tmp_path / "tiny")
    pids, clip = rollouts.prompt_ids(), trainer.args.max_grad_norm
    free = _reference_grads(model, pids, lambda i: [t for t in SPAN if t not in forced] if i == 0 else (), clip)
    span = _reference_grads(model, pids, lambda i: SPAN if i == 0 else (), clip)
    flat = lambda gs: torch.cat([gs[n].flatten() for n in sorted(gs)])  # noqa: E731
    got = flat(grads)
    assert got.abs().max() > 1e-4
    assert torch.allclose(got, flat(free), rtol=1e-4, atol=1e-7), (got - flat(free)).abs().max()
    assert not torch.allclose(flat(span), flat(free), rtol=1e-2, atol=1e-5)  # the mask is visible in the gradient
