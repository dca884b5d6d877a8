"""Sample.n_allowed / Sample.forced and the kept allowed-token masks (lemon.policy.rollout) on the random tiny policy
with the real spec grammar, against a slow reference that replays each sample's tokens through a fresh matcher; and
masked_logprobs against a per-position loop."""
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from lemon.prompts import default_prompts  # noqa: E402
from lemon.spec.grammar import GrammarCache, SpecGrammar  # noqa: E402

P = default_prompts()
G = SpecGrammar.for_domain(P, "math", max_agents=2, role_chars=6, duty_chars=12)
MSGS = [[{"role": "user", "content": "Write a spec."}], [{"role": "user", "content": "Plan it."}]]
KEYS = ("id", "base_role", "role", "duty", "capacity", "depends_on")  # `final` is not forced: see the test


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from lemon.policy.model import cached_random_policy
    path = cached_random_policy(0)
    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)


def _run(tiny, canonical=True, keep_masks=False, constrained=True, max_new_tokens=120):
    from lemon.policy.rollout import GrammarConstraint, sample_specs
    model, tok = tiny
    con = GrammarConstraint(G, GrammarCache(), canonical=canonical) if constrained else None
    return sample_specs(model, tok, MSGS, n=4, temperature=1.0, max_new_tokens=max_new_tokens, seed=0, constraint=con,
                        keep_masks=keep_masks)


@pytest.fixture(scope="module")
def plain(tiny):
    return _run(tiny)


@pytest.fixture(scope="module")
def kept(tiny):
    return _run(tiny, keep_masks=True)


def _replay(tiny, token_ids, canonical=True):
    """Per position: the packed allowed mask of a fresh matcher fed the sample's tokens one by one (slow reference)."""
    model, tok = tiny
    n_vocab = model.get_output_embeddings().weight.shape[0]
    m = GrammarCache().matcher(tok, G, n_vocab=n_vocab, eos_ids=[tok.eos_token_id], canonical=canonical)
    out = []
    for t in token_ids:
        # llguidance's own buffer has a spare word past ceil(V/32) (1537 for V = 49152): cut to the layout in use
        out.append(np.frombuffer(m.compute_bitmask(), dtype=np.int32)[:(n_vocab + 31) // 32].copy())
        assert m.consume_token(int(t)), m.get_error()
    return out, n_vocab


def _count(packed: np.ndarray, n_vocab: int) -> int:
    return int(np.unpackbits(packed.view(np.uint8), bitorder="little")[:n_vocab].sum())


@pytest.mark.parametrize("canonical", [True, False])
def test_n_allowed_and_forced_match_a_replay(tiny, plain, canonical):
    samples = plain if canonical else _run(tiny, canonical=False)
    tok = tiny[1]
    for s in samples:
        assert s.finished and len(s.n_allowed) == len(s.forced) == s.n_tokens
        masks, n_vocab = _replay(tiny, s.token_ids, canonical)
        want = tuple(_count(mk, n_vocab) for mk in masks)
        assert s.n_allowed == want
        assert s.forced == tuple(k == 1 for k in want)
        # forced positions: the 'agents:' header and every key but `final` (whose first token is the choice between
        # another agent and the end); about 20 of an agent's ~30 structural tokens
        ends = [len(tok.decode(list(s.token_ids[:k + 1]))) for k in range(s.n_tokens)]
        starts = [0] + ends[:-1]
        key_chars = [(0, len("agents:"))] + [m.span(1) for m in re.finditer(rf"\b({'|'.join(KEYS)}):", s.text)]
        on_keys = [[k for k in range(s.n_tokens) if starts[k] < b and a < ends[k]] for a, b in key_chars]
        n_agents = s.text.count("- id:")
        assert len(key_chars) == 1 + len(KEYS) * n_agents and all(on_keys)
        assert all(s.forced[k] for ks in on_keys for k in ks), \
            [[(tok.decode([s.token_ids[k]]), s.n_allowed[k]) for k in ks] for ks in on_keys]
        assert sum(s.forced) >= 20 * n_agents
        assert s.forced[-1]  # EOS: the only token allowed once `final` is written
    assert any(not f for s in samples for f in s.forced)


def test_unconstrained_n_allowed_is_the_vocabulary(tiny):
    model, _ = tiny
    n_vocab = model.get_output_embeddings().weight.shape[0]
    out = _run(tiny, constrained=False, keep_masks=True, max_new_tokens=16)
    for s in out:
        assert s.n_allowed == (n_vocab,) * s.n_tokens and not any(s.forced)
        assert s.allowed_masks.shape == (s.n_tokens, (n_vocab + 31) // 32) and bool((s.allowed_masks == -1).all())


def test_kept_masks_are_the_masks_sampled_from(tiny, plain, kept):
    """keep_masks=True: Sample.allowed_masks equals the replayed matcher's masks position by position, holds the sampled
    token, and keeping them changes no sample; without it the field is None."""
    from lemon.policy.rollout import unpack_bitmask
    assert plain == kept and all(s.allowed_masks is None for s in plain)
    for s in kept:
        masks, n_vocab = _replay(tiny, s.token_ids)
        assert s.allowed_masks.dtype == torch.int32 and s.allowed_masks.shape == (s.n_tokens, (n_vocab + 31) // 32)
        assert torch.equal(s.allowed_masks, torch.from_numpy(np.stack(masks)))
        allowed = unpack_bitmask(s.allowed_masks, n_vocab)  # (L, V)
        assert allowed.sum(-1).tolist() == list(s.n_allowed)
        assert allowed[torch.arange(s.n_tokens), torch.tensor(s.token_ids)].all()


def test_masked_logprobs_against_a_loop(kept):
    from lemon.policy.rollout import masked_logprobs, unpack_bitmask
    s = kept[0]
    n_vocab = 49152
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(s.n_tokens, n_vocab, generator=g)).requires_grad_(True)  # (L, V)
    ids = torch.tensor(s.token_ids)  # (L,)
    got = masked_logprobs(logits, s.allowed_masks, ids)  # (L,)
    allowed = unpack_bitmask(s.allowed_masks, n_vocab)  # (L, V)
    for t in range(s.n_tokens):  # the obvious reference, one position at a time
        idx = torch.nonzero(allowed[t]).flatten().tolist()
        ref = logits[t, ids[t]] - torch.logsumexp(logits[t, idx], 0)
        assert torch.allclose(got[t], ref, atol=1e-5)
        if len(idx) == 1:
            assert got[t].item() == 0.0  # a forced token has probability 1 under the constrained distribution
    full = masked_logprobs(logits, s.allowed_masks)  # (L, V)
    assert torch.equal(full.gather(-1, ids[:, None])[:, 0], got)
    assert torch.isinf(full[~allowed]).all() and torch.isfinite(full[allowed]).all()
    assert torch.allclose(full.exp().sum(-1), torch.ones(s.n_tokens), atol=1e-4)
    got.sum().backward()
    assert (logits.grad[~allowed] == 0).all() and logits.grad[allowed].abs().sum() > 0  # no gradient to forbidden ones
    assert (logits.grad[torch.tensor(s.forced)] == 0).all()  # nor through forced positions
    # unconstrained masks (all ones) give the plain log-softmax
    ones = torch.full_like(s.allowed_masks, -1)
    plain = torch.log_softmax(logits, -1).gather(-1, ids[:, None])[:, 0]  # (L,)
    assert torch.allclose(masked_logprobs(logits, ones, ids), plain)
