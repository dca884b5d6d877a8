"""The spec grammar (lemon.spec.grammar), the canonical SFT format (Spec.to_yaml / canonical) and policy rollouts
(lemon.policy.rollout): the grammar's language parses, every canonical spec is in it token by token for both shipped
tokenizers, and real constrained samples from the 135M policy all parse."""
import random
import string

import numpy as np
import pytest

from lemon.prompts import CAPACITIES, DOMAINS, default_prompts
from lemon.spec import Agent, Spec, parse_spec, spec_from_dict
from lemon.spec.grammar import GrammarCache, SpecGrammar, accepts, grammars_for
from lemon.spec.schema import DUTY_CHARS, ROLE_CHARS, TEXT_PUNCT, canonical, clean_text

P = default_prompts()
ALL_ROLES = tuple(P.roles_for(None))


@pytest.fixture(scope="module")
def toks():
    from transformers import AutoTokenizer
    from lemon.policy.model import converted_dir
    return {name: AutoTokenizer.from_pretrained(converted_dir(name)) for name in ("qwen2.5-coder-0.5b", "smollm2-135m")}


@pytest.fixture(scope="module")
def cache():
    return GrammarCache()


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


# ---- canonical format ------------------------------------------------------------------------------------------------
def test_to_yaml_is_the_grammar_layout():
    s = Spec((Agent("a1", "planner", "Planner", "List the steps.", "small"),
              Agent("a2", "solver", "Solver", "Solve it (carefully).", "large", ("a1",))), "a2")
    assert s.to_yaml() == ('agents:\n  - id: a1\n    base_role: planner\n    role: "Planner"\n'
                           '    duty: "List the steps."\n    capacity: small\n    depends_on: []\n'
                           '  - id: a2\n    base_role: solver\n    role: "Solver"\n'
                           '    duty: "Solve it (carefully)."\n    capacity: large\n    depends_on: [a1]\nfinal: a2\n')


def test_canonical_renames_drops_and_cleans():
    s = spec_from_dict({"agents": [
        dict(id="plan", base_role="planner", role="Careful: planner", duty="Plan: \"all\"\nsteps  #1 café",
             capacity="small"),
        dict(id="calc", base_role="calculator", role="Calc", duty="Add 5% & 6", capacity="medium", depends_on=["plan"]),
        dict(id="solve", base_role="solver", role="42 Solver", duty="x" * 300, capacity="large",
             depends_on=["calc", "plan"]),
        dict(id="late", base_role="critic", role="Late", duty="Never runs.", capacity="small", depends_on=["solve"])],
        "final": "solve"})
    c = canonical(s)
    assert [a.id for a in c.agents] == ["a1", "a2", "a3"] and c.final == "a3"  # `late` comes after final: dropped
    assert c.agents[2].depends_on == ("a1", "a2")  # remapped and sorted by position
    assert c.agents[0].role == "Careful - planner"
    assert c.agents[0].duty == "Plan - 'all' steps no. 1 cafe"
    assert c.agents[1].duty == "Add 5 percent and 6"
    assert c.agents[2].role == "Solver" and c.agents[2].duty == "x" * DUTY_CHARS
    assert canonical(c) == c  # idempotent
    assert parse_spec(c.to_yaml()) == c


def _clean_reference(s: str, n: int) -> bool:
    """Slow obvious check of clean_text's output: the alphabet, a leading letter, no trailing or double space,
    bounded."""
    ok = set(string.ascii_letters + string.digits + TEXT_PUNCT)
    return (s == "" or (s[0].isascii() and s[0].isalpha() and not s.endswith(" ") and "  " not in s
                        and all(ch in ok for ch in s))) and len(s) <= n


_CHARS = string.ascii_letters + string.digits + TEXT_PUNCT + ":\"#\\\n\t_%&[]{}|`éü日😀\u2019\u2014" + "  "


def _messy_text(rng, lo, hi):
    while True:
        t = "".join(rng.choice(_CHARS) for _ in range(rng.randint(lo, hi)))
        if t.strip():
            return t


def _messy_spec(rng, max_agents=8):
    n = rng.randint(1, max_agents)
    ids = rng.sample(["plan", "solve", "check", "x1", "calc-2", "final_step", "q", "Agent", "z9", "read", "w"], n)
    agents = [dict(id=ids[k], base_role=rng.choice(ALL_ROLES), role=_messy_text(rng, 1, 80).strip()[:80],
                   duty=_messy_text(rng, 1, 500).strip()[:500], capacity=rng.choice(CAPACITIES),
                   depends_on=rng.sample(ids[:k], rng.randint(0, k))) for k in range(n)]
    return spec_from_dict({"agents": agents, "final": rng.choice(ids)})


def test_clean_text_against_reference():
    rng = random.Random(1)
    for _ in range(2000):
        s, n = _messy_text(rng, 1, 120), rng.choice([ROLE_CHARS, DUTY_CHARS, 5])
        out = clean_text(s, n)
        assert _clean_reference(out, n), (s, out)
        assert clean_text(out, n) == out  # a fixed point
    assert clean_text("Solve it, then check (twice).", 200) == "Solve it, then check (twice)."


def test_canonical_roundtrip_in_grammar(toks, cache):
    """>= 200 random valid specs: canonical(spec).to_yaml() is taken token by token by the grammar with both tokenizers
    and parses back to the same spec."""
    rng = random.Random(0)
    g = SpecGrammar(ALL_ROLES, max_agents=8)
    for i in range(200):
        c = canonical(_messy_spec(rng))
        text = c.to_yaml()
        assert parse_spec(text) == c
        for name, tok in toks.items():
            assert accepts(cache, tok, g, _ids(tok, text)), (name, text)


@pytest.mark.parametrize("bad", [
    lambda t: t.replace("depends_on: [a1]", "depends_on: [a2]"),  # self / forward
    lambda t: t.replace("depends_on: [a1, a2]", "depends_on: [a2, a1]"),  # not increasing
    lambda t: t.replace("depends_on: [a1, a2]", "depends_on: [a1, a1]"),
    lambda t: t.replace("final: a3", "final: a2"),  # final must be the last agent
    lambda t: t.replace("id: a2", "id: calc"),
    lambda t: t.replace('role: "Solver"', 'role: "Solver: main"'),
    lambda t: t.replace('role: "Solver"', 'role: "Solver "'),
    lambda t: t.replace('role: "Solver"', 'role: Solver'),
    lambda t: t.replace('role: "Solver"', 'role: "' + "S" * (ROLE_CHARS + 1) + '"'),
    lambda t: t.replace("base_role: solver", "base_role: coder"),  # a code role in a math spec
    lambda t: t.replace("capacity: large", "capacity: huge"),
    lambda t: t[:-1],  # no final newline
])
def test_grammar_rejects_near_misses(toks, cache, bad):
    good = Spec((Agent("a1", "planner", "Planner", "Plan.", "small"),
                 Agent("a2", "solver", "Solver", "Solve.", "large", ("a1",)),
                 Agent("a3", "verifier", "Checker", "Check.", "medium", ("a1", "a2"))), "a3").to_yaml()
    g = SpecGrammar.for_domain(P, "math", max_agents=4)
    text = bad(good)
    assert text != good
    for tok in toks.values():
        assert accepts(cache, tok, g, _ids(tok, good))
        assert not accepts(cache, tok, g, _ids(tok, text)), text


def test_deps_are_exactly_the_increasing_subsets(toks, cache):
    """Agent 4's depends_on against the obvious reference: every increasing subset of a1..a3 and nothing else."""
    import itertools
    tok, g = toks["smollm2-135m"], SpecGrammar(ALL_ROLES, max_agents=4)
    base = [Agent(f"a{k}", "solver", "S", "Do it.", "small") for k in (1, 2, 3)]
    for r in range(0, 4):
        for deps in itertools.permutations(["a1", "a2", "a3", "a4"], r):
            text = Spec(tuple(base) + (Agent("a4", "solver", "S", "Do it.", "small", deps),), "a4").to_yaml()
            want = list(deps) == sorted(deps) and "a4" not in deps
            assert accepts(cache, tok, g, _ids(tok, text)) == want, deps
    too_many = Spec(tuple(Agent(f"a{k}", "solver", "S", "D.", "small") for k in range(1, 6)), "a5").to_yaml()
    assert not accepts(cache, tok, g, _ids(tok, too_many))


# ---- the language is inside parse_spec: random walks through the grammar -------------------------------------------
def _walk(m, tok, rng, closers, starts_f, target):
    """Random tokens among those the grammar allows, biased to close strings early (varied lengths) and to avoid `final`
    before `target` agents (varied sizes)."""
    out, vocab = [], len(closers)
    while not out or out[-1] != tok.eos_token_id:
        bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")[:vocab]
        allowed = np.flatnonzero(bits)
        if tok.decode(out).count("- id:") < target and (~starts_f[allowed]).any():
            allowed = allowed[~starts_f[allowed]]
        close = allowed[closers[allowed]]
        pick = rng.choice(close) if len(close) and rng.random() < 0.3 else rng.choice(allowed)
        assert m.consume_token(int(pick)), m.get_error()
        out.append(int(pick))
    return out


@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b", "smollm2-135m"])
def test_random_walks_parse(toks, cache, name):
    tok, rng = toks[name], np.random.default_rng(0)
    vocab = len(tok)
    pieces = tok.convert_ids_to_tokens(list(range(vocab)))
    closers = np.array(['"' in (p or "") or "Ċ" in (p or "") or "\n" in (p or "") for p in pieces])
    starts_f = np.array([(p or "").startswith("f") for p in pieces])
    sizes = set()
    for dom, n, rc, dc in [(d, n, rc, dc) for d in DOMAINS
                           for n, rc, dc in ((1, 48, 200), (3, 8, 30), (8, 12, 20))] * 3:
        g = SpecGrammar.for_domain(P, dom, max_agents=n, role_chars=rc, duty_chars=dc)
        m = cache.matcher(tok, g, eos_ids=[tok.eos_token_id])
        ids = _walk(m, tok, rng, closers, starts_f, target=int(rng.integers(1, n + 1)))
        text = tok.decode(ids, skip_special_tokens=True)
        s = parse_spec(text, base_roles=P.roles_for(dom), max_agents=n)  # raises if the grammar let anything else out
        assert s.to_yaml() == text and [a.id for a in s.agents] == [f"a{k + 1}" for k in range(len(s.agents))]
        assert s.final == s.agents[-1].id and all(len(a.role) <= rc and len(a.duty) <= dc for a in s.agents)
        assert ids[-1] == tok.eos_token_id
        sizes.add(len(s.agents))
    assert len(sizes) >= 3


def test_cache_compiles_once(toks):
    c, tok = GrammarCache(), toks["smollm2-135m"]
    g = SpecGrammar.for_domain(P, "code", max_agents=2)
    c.matcher(tok, g)
    n = c.compiles
    m1, m2 = c.matcher(tok, g), c.matcher(tok, SpecGrammar.for_domain(P, "code", max_agents=2))
    assert c.compiles == n == 2  # one tokenizer, one grammar
    # independent copies
    assert m1.consume_token(_ids(tok, "agents")[0]) and m2.compute_ff_bytes().startswith(b"agents:")


def test_grammar_config_checks():
    with pytest.raises(ValueError, match="parse_spec's limits"):
        SpecGrammar(ALL_ROLES, duty_chars=600)
    with pytest.raises(ValueError, match="distinct"):
        SpecGrammar(("solver", "solver"))


# ---- rollouts (lemon.policy.rollout) on the real 135M policy ---------------------------------------------------------
@pytest.fixture(scope="module")
def policy():
    from lemon.policy.model import PolicyConfig, load_policy
    return load_policy(PolicyConfig(model="smollm2-135m"), lora=False)


def _prompts(domains):
    from lemon.benchmarks import pool
    from lemon.eval.orchestrator import orchestrator_messages
    bench = {"math": "gsm8k", "knowledge": "mmlu", "code": "humaneval"}
    return [orchestrator_messages(pool(bench[d], "train")[i].question, d, P, 3) for i, d in enumerate(domains)]


def _check_structure(samples, tok, n, n_prompts, max_new):
    assert [s.prompt_index for s in samples] == [i for i in range(n_prompts) for _ in range(n)]
    for s in samples:
        assert s.n_tokens == len(s.token_ids) <= max_new
        assert s.text == tok.decode(list(s.token_ids), skip_special_tokens=True)
        assert s.finished == (s.token_ids[-1] == tok.eos_token_id)  # EOS kept when generated ...
        assert tok.eos_token_id not in s.token_ids[:-1]  # ... and nothing (no padding) after it


SMALL_BOUNDS = dict(max_agents=3, role_chars=16, duty_chars=40)  # keeps the 135M test short; the grammar is the same


def test_constrained_samples_all_parse_mixed_domains(policy):
    """8 specs from the real 135M policy at T=1, rows from three domains in one generate call: every one finishes and
    parses with its own domain's base roles."""
    from lemon.policy.rollout import GrammarConstraint, sample_specs
    model, tok = policy
    domains = ["math", "knowledge", "code", "math"]
    con = GrammarConstraint(tuple(grammars_for(P, domains, **SMALL_BOUNDS)), GrammarCache())
    out = sample_specs(model, tok, _prompts(domains), n=2, temperature=1.0, max_new_tokens=300, seed=0, constraint=con)
    _check_structure(out, tok, 2, 4, 300)
    for smp in out:
        assert smp.finished, smp.text
        spec = parse_spec(smp.text, base_roles=P.roles_for(domains[smp.prompt_index]), max_agents=3)
        assert spec.to_yaml() == smp.text


def test_seeded_and_greedy(policy):
    from lemon.policy.rollout import GrammarConstraint, sample_specs
    model, tok = policy
    msgs = _prompts(["math"])
    con = GrammarConstraint(SpecGrammar.for_domain(P, "math", **SMALL_BOUNDS), GrammarCache())
    run = lambda seed, t=1.0: sample_specs(model, tok, msgs, n=2, temperature=t, max_new_tokens=28, seed=seed,  # noqa
                                           constraint=con)
    a = run(0)
    assert a == run(0)
    assert any(run(s) != a for s in (1, 2))  # ~14 of the 28 tokens are forced by the grammar
    greedy = run(0, t=0.0)
    assert len({g.token_ids for g in greedy}) == 1  # greedy: the n rows of a prompt agree
    assert greedy[0].text.startswith("agents:\n  - id: a1\n    base_role: ")


def test_unconstrained_same_structure(policy):
    from lemon.policy.rollout import sample_specs
    model, tok = policy
    out = sample_specs(model, tok, _prompts(["math", "code"]), n=2, temperature=1.0, max_new_tokens=16, seed=3)
    _check_structure(out, tok, 2, 2, 16)
    assert {type(x).__name__ for x in out} == {"Sample"}


def test_peft_policy_samples_without_merging(policy):
    """A fresh LoRA adapter (B = 0) samples exactly what the base model samples, through peft, adapters unmerged."""
    from peft import LoraConfig, get_peft_model
    from lemon.policy.model import PolicyConfig, load_policy
    from lemon.policy.rollout import sample_specs
    base, tok = policy
    msgs = _prompts(["knowledge"])
    want = sample_specs(base, tok, msgs, n=2, temperature=1.0, max_new_tokens=12, seed=5)
    fresh, _ = load_policy(PolicyConfig(model="smollm2-135m"), lora=False)
    peft_model = get_peft_model(fresh, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    peft_model.train()
    got = sample_specs(peft_model, tok, msgs, n=2, temperature=1.0, max_new_tokens=12, seed=5)
    assert got == want
    assert peft_model.training  # mode restored
    assert not any(getattr(m, "merged", False) for m in peft_model.modules())


def test_dtype_detection():
    import torch
    from lemon.policy.dtype import cpu_bf16_flags, sampling_context, sampling_weights_dtype
    assert cpu_bf16_flags("processor: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile\n") == {"avx512_bf16"}
    assert cpu_bf16_flags("flags: fpu avx2\n") == set()
    assert sampling_weights_dtype("cpu") in (torch.float32, torch.bfloat16)
    with sampling_context("autocast_bf16", "cpu"):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="valid"):
        sampling_context("fp8", "cpu")


def test_sampling_copy_follows_lora_and_leaves_policy_alone():
    import torch
    from peft import LoraConfig, get_peft_model
    from lemon.policy.dtype import SamplingCopy
    from lemon.policy.model import PolicyConfig, load_policy
    from lemon.policy.rollout import sample_specs
    base, tok = load_policy(PolicyConfig(model="smollm2-135m"), lora=False)
    policy = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    shadow = SamplingCopy(policy, torch.bfloat16)
    name = shadow.names[1]  # a lora_B (zero at init)
    with torch.no_grad():
        dict(policy.named_parameters())[name].normal_()
    m = shadow.sync(policy)
    live, copied = dict(policy.named_parameters())[name], dict(m.named_parameters())[name]
    assert live.dtype == torch.float32 and copied.dtype == torch.bfloat16 and "lora" in name
    assert torch.equal(copied, live.detach().to(torch.bfloat16))
    out = sample_specs(m, tok, _prompts(["math"]), n=2, temperature=1.0, max_new_tokens=8, seed=0)
    assert len(out) == 2 and all(s.n_tokens >= 1 for s in out)
    policy.base_model.model.model.layers[0].self_attn.k_proj.weight.requires_grad_(True)
    with pytest.raises(ValueError, match="new SamplingCopy"):
        shadow.sync(policy)
