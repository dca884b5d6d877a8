"""The policy served by llama-server (lemon.policy.served, lemon.eval.served): the top-n greedy under an llguidance mask
against a slow obvious reference (a fake server, every branch: forced tokens, a top-n hit, the ban fallback), the F32
base against transformers' own dequantized weights, and the real server against the real transformers policy."""
import json
import random

import numpy as np
import pytest

from lemon.prompts import default_prompts
from lemon.spec import parse_spec
from lemon.spec.grammar import GrammarCache, SpecGrammar

P = default_prompts()
GRAMMAR = SpecGrammar.for_domain(P, "math", max_agents=2, role_chars=12, duty_chars=24)


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer
    from lemon.policy.model import converted_dir
    return AutoTokenizer.from_pretrained(str(converted_dir("smollm2-135m")))


class FakeServed:
    """ServedPolicy's greedy loop over a fake /completion: fixed pseudo-random logits per (prefix length, token)."""

    def __init__(self, n_vocab: int, eos: int):
        from lemon.policy.served import ServedPolicy
        self.greedy_constrained = ServedPolicy.greedy_constrained.__get__(self)
        self.n_vocab, self.eos, self.calls, self.bans = n_vocab, eos, 0, 0
        rng = np.random.default_rng(0)
        self.table = rng.standard_normal((400, n_vocab)).astype(np.float32)  # (T, V) logits of the fake model
        # the fake model likes to stop: the EOS branch is taken as soon as the grammar allows it
        self.table[:, eos] += 3.0

    def logits(self, n_done: int):
        return self.table[n_done % len(self.table)]

    def _post(self, body):
        self.calls += 1
        row = self.logits(len(body["prompt"]) - 3).copy()
        for t, ok in body.get("logit_bias", []):
            if ok is False:
                self.bans += 1
                row[t] = -np.inf
        top = np.argsort(-row, kind="stable")[:max(body["n_probs"], 1)]
        return {"tokens": [int(top[0])], "completion_probabilities": [{"top_logprobs": [{"id": int(t)} for t in top]}]}


def reference_greedy(fake, matcher, max_tokens: int):
    """The obvious version: every step, the full mask and the argmax of the logits over it."""
    out = []
    while len(out) < max_tokens:
        mask = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint32)
        allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))
        row = fake.logits(len(out))
        pick = int(allowed[np.argmax(row[allowed])]) if len(allowed) > 1 else int(allowed[0])
        if pick == fake.eos:
            return out, True
        assert matcher.consume_token(pick)
        out.append(pick)
    return out, False


@pytest.mark.parametrize("top_n", [1, 8, 64])
def test_top_n_greedy_matches_the_full_mask_argmax(tok, top_n):
    """Exactness of the top-n shortcut: the same tokens as the argmax over the whole mask, with top_n = 1 forcing the
    ban fallback at most free positions; forced tokens never call the server."""
    cache, eos = GrammarCache(), tok.eos_token_id
    fake = FakeServed(len(tok), eos)
    m_ref = cache.matcher(tok, GRAMMAR, n_vocab=len(tok), eos_ids=[eos])
    want, want_done = reference_greedy(fake, m_ref, 300)
    m = cache.matcher(tok, GRAMMAR, n_vocab=len(tok), eos_ids=[eos])
    got, done = fake.greedy_constrained([0, 1, 2], m, max_tokens=300, eos_ids={eos}, n_vocab=len(tok), top_n=top_n)
    assert list(got) == want and done == want_done and done
    text = tok.decode(list(got), skip_special_tokens=True)
    assert parse_spec(text, base_roles=P.roles_for("math"), max_agents=2).agents  # a complete spec of the grammar
    assert 0 < fake.calls < len(got)  # forced text (most of a spec) costs no request
    if top_n == 1:
        assert fake.bans > 0  # the fallback ran
    # a cut: max_tokens reached before the spec is complete is reported as unfinished
    m = cache.matcher(tok, GRAMMAR, n_vocab=len(tok), eos_ids=[eos])
    cut, done = fake.greedy_constrained([0, 1, 2], m, max_tokens=10, eos_ids={eos}, n_vocab=len(tok), top_n=top_n)
    assert list(cut) == want[:10] and not done


def test_bad_inputs_are_named(tmp_path):
    from lemon.policy.served import adapter_to_gguf, base_gguf
    with pytest.raises(FileNotFoundError, match="not a saved peft adapter"):
        adapter_to_gguf(tmp_path, "smollm2-135m")
    with pytest.raises(ValueError, match="weights='q8'"):
        base_gguf("smollm2-135m", "q8")


def test_f32_base_holds_exactly_the_trained_policys_weights():
    """base_gguf('f32') dequantizes with gguf-py as transformers does: a tensor transformers does not permute
    (ffn_down) is bit-identical to the policy's fp32 weights."""
    import torch
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM
    from lemon.policy.served import base_gguf
    from lemon.policy.model import converted_dir
    r = GGUFReader(str(base_gguf("smollm2-135m")))
    assert {t.tensor_type.name for t in r.tensors} == {"F32"} and r.fields["general.file_type"].contents() == 0
    down = next(t for t in r.tensors if t.name == "blk.3.ffn_down.weight")
    hf = AutoModelForCausalLM.from_pretrained(str(converted_dir("smollm2-135m")), dtype=torch.float32)
    want = hf.model.layers[3].mlp.down_proj.weight.detach().numpy()
    assert np.array_equal(np.asarray(down.data).reshape(want.shape), want)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_served_policy_writes_the_transformers_policys_greedy_specs(tmp_path):
    """The real llama-server with the SmolLM2 policy and a random LoRA (B ~ N(0, 0.05^2), so the adapter matters)
    writes, token for token, the greedy constrained spec of lemon.policy.rollout.sample_specs on a GSM8K train question;
    token log-probs agree to 1e-3. One question, at most 2 agents: transformers' greedy decoding is the slow part."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from served_policy_bench import logprob_gap, random_lora
    from lemon.benchmarks.pools import pool
    from lemon.eval.orchestrator import OrchestratorConfig, orchestrator_messages
    from lemon.eval.served import ServedPolicySpecWriter
    from lemon.policy.served import ServedPolicy
    from lemon.policy.model import PolicyConfig, load_policy
    from lemon.policy.rollout import GrammarConstraint, sample_specs
    qs = list(pool("gsm8k", "train"))
    random.Random(0).shuffle(qs)
    qs = qs[:1]
    adapter = random_lora("smollm2-135m", 0.05, tmp_path / "lora")
    model, tok = load_policy(PolicyConfig(model="smollm2-135m"), adapter=adapter)
    g = SpecGrammar.for_domain(P, "math", max_agents=2)
    msgs = [orchestrator_messages(e.question, "math", P, 2) for e in qs]
    want = sample_specs(model, tok, msgs, n=1, temperature=0.0, max_new_tokens=286, seed=0,
                        constraint=GrammarConstraint(g))
    with ServedPolicy("smollm2-135m", adapter, log_dir=tmp_path / "logs") as served:
        w = ServedPolicySpecWriter(served, tok, OrchestratorConfig(max_tokens=286, max_agents=2))
        got = [w.propose(e.question, "math", P) for e in qs]
        gap = logprob_gap(model, tok, served, w.prompt_ids(qs[0].question, "math", P))
        assert json.loads(json.dumps(served.describe()))["lora_gguf"].endswith(".gguf")
    for s, p in zip(want, got):
        assert p.text == s.text and p.completion_tokens == s.n_tokens
    assert gap < 1e-3


def test_study_evaluation_writer_on_the_server(tmp_path):
    """StudyConfig.policy_server: the study's trained-policy writer (LazyPolicyWriter) starts a llama-server on its
    first spec, writes a grammar-valid spec there, names itself '@served', and stops the server on close(); a
    non-shipped policy is refused by the config."""
    import sys
    from dataclasses import replace
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from served_policy_bench import random_lora
    from lemon.study.runner import study_preset
    from lemon.study.stages import LazyPolicyWriter
    cfg = study_preset("smoke", policy_server=True)
    w = LazyPolicyWriter(cfg, random_lora("smollm2-135m", 0.02, tmp_path / "lora"), name="lemon:test")
    try:
        p = w.propose("Tom has 3 apples and buys 4 more. How many apples does he have?", "math", P)
        server = w._server.manager.server("policy")
        assert w.name == "lemon:test@served" and p.spec is not None and p.completion_tokens > 0 and server.alive()
    finally:
        w.close()
    assert not server.alive()
    with pytest.raises(ValueError, match="policy_server=True serves a shipped GGUF policy"):
        replace(cfg, train=replace(cfg.train, policy=replace(cfg.train.policy, model="Qwen/Qwen2.5-7B-Instruct")))
