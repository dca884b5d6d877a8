"""Policy plumbing on CPU with a tiny random Qwen2: a warm-start adapter is copied into a fresh LoRA model key by key
(the function the Unsloth branch of load_policy uses, issue 11 defect 2), and a mismatched adapter is refused."""
import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
from _tiny import tiny_model  # noqa: E402  (tests/_tiny.py)

from lemon.policy.model import PolicyConfig, load_adapter_weights, load_policy  # noqa: E402


def _lora(path, r):
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(path)
    cfg = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(PolicyConfig().target_modules),
                          task_type="CAUSAL_LM")
    return peft.get_peft_model(base, cfg)


def test_warm_start_adapter_is_loaded_not_dropped(tmp_path):
    tiny_model(tmp_path / "tiny")
    warm = _lora(tmp_path / "tiny", 4)
    for n, p in warm.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.05)  # fresh LoRA has B = 0: a dropped warm start would look identical
    warm.save_pretrained(tmp_path / "warm")
    fresh = _lora(tmp_path / "tiny", 4)
    assert all(v.abs().sum() == 0 for k, v in fresh.state_dict().items() if "lora_B" in k)
    n = load_adapter_weights(fresh, tmp_path / "warm")
    want = {k: v for k, v in warm.state_dict().items() if "lora_" in k}
    got = {k: v for k, v in fresh.state_dict().items() if "lora_" in k}
    assert n == len(want) and got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    # the transformers branch of load_policy loads the same adapter (trainable)
    model, _ = load_policy(PolicyConfig(model=str(tmp_path / "tiny"), backend="transformers", lora_r=4, lora_alpha=8),
                           adapter=tmp_path / "warm")
    lp = {k: v for k, v in model.state_dict().items() if "lora_B" in k}
    assert lp and all(torch.equal(lp[k], want[k]) for k in lp)
    assert any(p.requires_grad for n, p in model.named_parameters() if "lora_" in n)


def test_seeded_fresh_lora_is_the_same_in_every_process(tmp_path):
    """A fresh LoRA's A matrices are random: with `seed` two loads draw the same ones whatever the RNG did before (so
    an SFT warm start rebuilt from the same corpus is the same adapter), without it they differ."""
    tiny_model(tmp_path / "tiny")
    cfg = PolicyConfig(model=str(tmp_path / "tiny"), backend="transformers", lora_r=4, lora_alpha=8)
    lora_a = lambda m: {k: v.clone() for k, v in m.state_dict().items() if "lora_A" in k}  # noqa: E731
    a = lora_a(load_policy(cfg, seed=7)[0])
    torch.rand(100)  # the global RNG moved on, as it does between a build and a rebuild
    b = lora_a(load_policy(cfg, seed=7)[0])
    c = lora_a(load_policy(cfg)[0])
    assert a and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_mismatched_adapter_is_refused(tmp_path):
    tiny_model(tmp_path / "tiny")
    _lora(tmp_path / "tiny", 8).save_pretrained(tmp_path / "r8")
    with pytest.raises((ValueError, RuntimeError)):
        load_adapter_weights(_lora(tmp_path / "tiny", 4), tmp_path / "r8")  # rank 8 tensors into rank-4 modules
    with pytest.raises(FileNotFoundError, match="not a saved peft adapter"):
        load_adapter_weights(_lora(tmp_path / "tiny", 4), tmp_path)


def test_merged_sampling_copy_matches_the_policy_and_leaves_it_alone(tmp_path):
    """lemon.policy.dtype.merged_copy ('bf16_merged' rollouts): W + scale * B @ A in one plain module, so its logits
    match the unmerged peft policy (fp32 copy: to 1e-4; bf16 copy: to bf16 rounding), and the policy itself stays fp32,
    unmerged and trainable."""
    from lemon.policy.dtype import merged_copy
    tiny_model(tmp_path / "tiny")
    policy = _lora(tmp_path / "tiny", 4)
    for n, p in policy.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.05)
    ids = torch.randint(0, 95, (2, 12))  # (B, T)
    with torch.no_grad():
        want = policy(input_ids=ids).logits  # (B, T, V)
        flat = merged_copy(policy, torch.float32)
        bf = merged_copy(policy, torch.bfloat16)
        got32, got16 = flat(input_ids=ids).logits, bf(input_ids=ids).logits.float()
    assert not any("lora" in n for n, _ in flat.named_parameters())
    assert torch.allclose(got32, want, atol=1e-4)
    assert (got16 - want).abs().max() < 0.05 * want.abs().max()
    assert all(p.dtype == torch.float32 for p in policy.parameters())
    assert not any(getattr(m, "merged", False) for m in policy.modules())
    assert any(p.requires_grad for n, p in policy.named_parameters() if "lora_" in n)


def test_bf16_autocast_loss_and_gradient_agree_with_fp32():
    """The loss forward/backward runs under bf16 autocast on a native-bf16 CPU (lemon.train.pipeline,
    train_dtype='auto'): on the real 135M policy with LoRA, the per-token log-probs of a spec text, their mean (the GRPO
    loss' core) and the LoRA gradient must agree with fp32: mean log-prob within 2% relative, gradient cosine >= 0.98.
    Stated tolerance of the speed-up (LOG.md 2026-12-01)."""
    from lemon.eval.baselines import baseline_spec
    policy, tok = load_policy(PolicyConfig(model="smollm2-135m", lora_r=8, lora_alpha=16), lora=True)
    for n, p in policy.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.02)  # a non-trivial adapter, as after some training
    text = baseline_spec("chain", "math", n_agents=3).to_yaml()
    ids = torch.tensor([tok(text)["input_ids"]])  # (1, T)
    adv = torch.linspace(-1.0, 1.0, ids.shape[1] - 1)  # (T-1,) a per-token advantage, as CF-GRPO's (B, T) tensor

    def loss_and_grad(autocast: bool):
        policy.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = policy(input_ids=ids).logits[:, :-1]  # (1, T-1, V)
        lp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None])[0, :, 0]  # (T-1,)
        (-(lp * adv).mean()).backward()
        g = torch.cat([p.grad.flatten() for n, p in policy.named_parameters()
                       if p.requires_grad and p.grad is not None])
        return lp.detach(), g

    lp32, g32 = loss_and_grad(False)
    lp16, g16 = loss_and_grad(True)
    assert ids.shape[1] > 50
    assert abs(lp16.mean() - lp32.mean()) <= 0.02 * abs(lp32.mean())
    assert torch.nn.functional.cosine_similarity(g16, g32, dim=0) >= 0.98
