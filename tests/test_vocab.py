"""The testbed's small BPE (lemon.testbed.vocab): built from the project's own text, round-trips every spec and prompt,
is read by llguidance (grammar-constrained samples parse), and a random policy drawn on it is the random-tiny-bpe
base."""
import pytest

pytest.importorskip("tokenizers")

from lemon.prompts import default_prompts  # noqa: E402
from lemon.testbed.vocab import SPECIALS, small_tokenizer_dir  # noqa: E402

P = default_prompts()


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(small_tokenizer_dir(2048, P))


def test_small_vocab_round_trips_specs_and_prompts(tok):
    assert len(tok) == 2048 and tok.eos_token == "<|im_end|>" and all(t in tok.get_vocab() for t in SPECIALS)
    spec = ('agents:\n  - id: a1\n    base_role: solver\n    role: "Adder #1"\n    duty: "Add 3.5 + 4 = 7.5; done!"\n'
            '    capacity: large\n    depends_on: []\nfinal: a1\n')
    ids = tok(spec)["input_ids"]
    assert tok.decode(ids) == spec and len(ids) < 80  # learned merges: far fewer tokens than bytes
    assert tok.decode(tok("naïve ☃ — unseen bytes")["input_ids"]) == "naïve ☃ — unseen bytes"  # byte level: no <unk>
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_the_same_corpus_builds_the_same_tokenizer(tmp_path, monkeypatch):
    """Deterministic: a second build (another cache) gives the identical vocabulary and merges."""
    first = (small_tokenizer_dir(2048, P) / "tokenizer.json").read_text()
    monkeypatch.setattr("lemon.testbed.vocab.cache_dir", lambda: tmp_path / "models")
    second = small_tokenizer_dir(2048, P)
    assert str(second).startswith(str(tmp_path)) and (second / "tokenizer.json").read_text() == first
    with pytest.raises(ValueError, match="vocab_size"):
        small_tokenizer_dir(100, P)


def test_grammar_samples_on_the_small_vocab_parse(tok):
    from lemon import benchmarks as B
    from lemon.eval.orchestrator import orchestrator_messages
    from lemon.policy.model import PolicyConfig, cached_random_policy, load_policy
    from lemon.policy.rollout import GrammarConstraint, sample_specs
    from lemon.spec import parse_spec
    from lemon.spec.grammar import SpecGrammar
    path = cached_random_policy(0, tokenizer_dir=small_tokenizer_dir(2048, P))
    assert "testbed-bpe2048" in path.name
    model, tk = load_policy(PolicyConfig(model=str(path), backend="transformers", lora_r=8, lora_alpha=16,
                                         dtype="fp32"))
    assert model.get_output_embeddings().weight.shape[0] == 2048
    msgs = [orchestrator_messages(e.question, "math", P, 3) for e in B.pool("gsm8k", "train")[:2]]
    g = GrammarConstraint(SpecGrammar.for_domain(P, "math", max_agents=3, role_chars=12, duty_chars=16))
    samples = sample_specs(model, tk, msgs, n=4, temperature=1.0, max_new_tokens=300, seed=0, constraint=g)
    assert all(s.finished for s in samples)
    specs = [parse_spec(s.text, base_roles=P.roles_for("math"), max_agents=3) for s in samples]
    assert len({s.to_yaml() for s in specs}) > 1  # a random policy: different specs
