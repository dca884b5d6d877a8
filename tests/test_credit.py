"""lemon.testbed.credit: the batched gradient of weighted token log-probs (left padding, logits_to_keep, masked or not)
against a slow one-sequence-at-a-time reference, and the cosine conventions."""
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from lemon.testbed.credit import Measure, corrected_cosine, cosine  # noqa: E402


def test_cosine_conventions_and_the_attenuation_correction():
    rng = np.random.default_rng(0)
    g = rng.normal(size=400)
    assert cosine(np.zeros(400), g) == 0.0 and np.isnan(cosine(g, np.zeros(400)))
    # a noisy reference shrinks the plain cosine; the corrected one recovers cos(est, g) on average
    est = g + rng.normal(size=400) * 1.0
    true = cosine(est, g)
    plain, corr = [], []
    for _ in range(200):
        h1, h2 = g + rng.normal(size=400) * 2, g + rng.normal(size=400) * 2
        plain.append(cosine(est, (h1 + h2) / 2))
        corr.append(corrected_cosine(est, h1, h2))
    assert np.mean(plain) < true - 0.1 and abs(np.mean(corr) - true) < 0.05, (true, np.mean(plain), np.mean(corr))


def test_batched_gradient_is_the_per_sequence_gradient():
    from lemon.policy.model import PolicyConfig, cached_random_policy, load_policy
    from lemon.policy.rollout import masked_logprobs
    from lemon.testbed.vocab import small_tokenizer_dir
    model, tok = load_policy(PolicyConfig(model=str(cached_random_policy(1, tokenizer_dir=small_tokenizer_dir())),
                                          backend="transformers", lora_r=4, lora_alpha=8, dtype="fp32"), seed=0)
    with torch.no_grad():  # LoRA B starts at 0: give every adapter weight a value so that A gets gradient too
        g = torch.Generator().manual_seed(2)
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    m = Measure.__new__(Measure)  # only what grad() reads
    m.model, m.tok = model, tok
    m.params = [p for n, p in model.named_parameters() if "lora_" in n]
    m.cfg = SimpleNamespace(batch=3, temperature=0.7)
    m.prompt_ids = [tok("Plan the task: 3 apples and 4 pears.")["input_ids"], tok("Count.")["input_ids"]]
    V = model.get_output_embeddings().weight.shape[0]
    rng = torch.Generator().manual_seed(3)
    items = []
    for k, (q, L) in enumerate([(0, 5), (1, 9), (0, 2), (1, 7)]):  # different lengths: padding matters
        ids = torch.randint(0, V, (L,), generator=rng).tolist()
        masks = torch.randint(-2 ** 31, 2 ** 31 - 1, (L, (V + 31) // 32), generator=rng,
                              dtype=torch.int64).to(torch.int32)
        for t, y in enumerate(ids):  # the sampled token is always allowed
            masks[t, y // 32] |= torch.tensor(1 << (y % 32), dtype=torch.int64).to(torch.int32)
        s = SimpleNamespace(token_ids=tuple(ids), allowed_masks=masks)
        items.append((q, s, torch.randn(L, generator=rng) if k % 2 else 0.37, k >= 2))
    got = m.grad(items)
    ref = [torch.zeros_like(p) for p in m.params]
    for q, s, w, masked in items:  # slow and obvious: one unpadded sequence, every position's logits
        ids = torch.tensor([m.prompt_ids[q] + list(s.token_ids)])
        lg = model(input_ids=ids).logits[0, len(m.prompt_ids[q]) - 1:-1].float() / 0.7  # (L, V)
        y = torch.tensor(s.token_ids)
        lp = masked_logprobs(lg, s.allowed_masks, y) if masked else torch.log_softmax(lg, -1)[torch.arange(len(y)), y]
        for acc, x in zip(ref, torch.autograd.grad((torch.as_tensor(w) * lp).sum(), m.params)):
            acc += x
    want = torch.cat([r.flatten() for r in ref]).numpy()
    assert np.abs(want).max() > 1e-3
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
