"""lemon.policy.decode: the plain decoding loop against transformers' generate (greedy, token for token, under the spec
grammar) and the Gumbel-max draw against the softmax it samples from (a chi-square test on many draws)."""
import pytest

torch = pytest.importorskip("torch")

from lemon.eval.orchestrator import orchestrator_messages  # noqa: E402
from lemon.policy.decode import decode, gumbel_argmax  # noqa: E402
from lemon.prompts import default_prompts  # noqa: E402

P = default_prompts()


def test_gumbel_argmax_samples_the_softmax():
    """20,000 draws from a 5-way softmax at T=0.7: frequencies within a chi-square bound (df=4, p=0.001: 18.47)."""
    logits = torch.tensor([[1.0, 0.0, -1.0, 2.0, float("-inf")]])
    p = torch.softmax(logits / 0.7, -1)[0]
    gen = torch.Generator().manual_seed(0)
    draws = torch.cat([gumbel_argmax(logits.expand(1000, -1), 0.7, gen) for _ in range(20)])
    counts = torch.bincount(draws, minlength=5).double()
    assert counts[4] == 0  # a masked token never wins
    exp = p[:4].double() * draws.numel()
    chi2 = float(((counts[:4] - exp) ** 2 / exp).sum())
    assert chi2 < 18.47, (counts, exp)
    assert torch.equal(gumbel_argmax(logits, 0.0, gen), torch.tensor([3]))


def test_greedy_decode_is_generate_token_for_token_under_the_grammar():
    from lemon import benchmarks as B
    from lemon.policy.model import PolicyConfig, cached_random_policy, load_policy
    from lemon.policy.rollout import GrammarConstraint, GrammarMask, _vocab_width, eos_ids_of
    from lemon.spec.grammar import SpecGrammar
    model, tok = load_policy(PolicyConfig(model=str(cached_random_policy(0)), backend="transformers", lora_r=8,
                                          lora_alpha=16, dtype="fp32"))
    model.eval()
    msgs = [orchestrator_messages(e.question, "math", P, 3) for e in B.pool("gsm8k", "train")[:2]]
    enc = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
           for m in msgs]
    width, pad = max(map(len, enc)), tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    ids = torch.tensor([[pad] * (width - len(r)) + list(r) for r in enc])
    attn = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in enc])
    eos = eos_ids_of(model.generation_config, tok)
    g = GrammarConstraint(SpecGrammar.for_domain(P, "math", max_agents=3, role_chars=12, duty_chars=16))

    def mask():
        return GrammarMask(tok, list(g.for_prompts(2)), g.cache, prompt_len=width, eos_ids=eos,
                           n_vocab=_vocab_width(model, tok))
    mine = decode(model, ids, attn, n=1, temperature=0.0, max_new_tokens=200, eos_ids=eos, pad_id=pad,
                  processors=[mask()])
    from transformers import GenerationConfig, LogitsProcessorList
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=attn, logits_processor=LogitsProcessorList([mask()]),
                             generation_config=GenerationConfig(max_new_tokens=200, do_sample=False, eos_token_id=eos,
                                                                pad_token_id=pad))
    theirs = []
    for r in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(r) if t in eos), None)
        theirs.append(r[:cut] if cut is not None else r)
    assert all(len(r) > 20 for r in mine)
    assert mine == theirs
