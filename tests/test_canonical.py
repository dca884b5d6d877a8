"""One token path per enumerated spec value (lemon.spec.grammar.canonical_value_tokens, GrammarCache.matcher's
canonical grammar): under the text grammar ' large' can also be written ' l'+'arge', ' la'+'rge', ..., so the policy's
probability of one choice, and the credit a reward gives it, is split over spellings. Checked three ways: the grammar's
own allowed sets, enumerated exhaustively from the value's start; the tokenizer's tokenization of full spec texts; and
64 samples of the random tiny policy at T=1, whose capacity edits the span map puts on exactly the value's tokens."""
import re
from collections import defaultdict

import numpy as np
import pytest

from lemon.prompts import CAPACITIES, default_prompts
from lemon.spec import Agent, Spec, parse_spec
from lemon.spec.grammar import GrammarCache, SpecGrammar, canonical_value_tokens

P = default_prompts()
ALL_ROLES = tuple(P.roles_for(None))
NAMES = ("smollm2-135m", "qwen2.5-coder-0.5b", "random-tiny")


@pytest.fixture(scope="module")
def toks():
    from transformers import AutoTokenizer
    from lemon.policy.model import cached_random_policy, converted_dir
    # the random tiny policy saves its own copy of SmolLM2's tokenizer, which transformers reloads with a different
    # pre-tokenizer ('\n' and '   ' apart): a third tokenizer, and the one the sampled tests below run on
    out = {n: AutoTokenizer.from_pretrained(converted_dir(n)) for n in NAMES[:2]}
    out["random-tiny"] = AutoTokenizer.from_pretrained(cached_random_policy(0))
    return out


@pytest.fixture(scope="module")
def cache():
    return GrammarCache()


def _bits(m, vocab: int) -> np.ndarray:
    return np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")[:vocab].astype(bool)


def _ends(tok, ids) -> list[int]:
    """Characters of decode(ids[:k+1]) for every k (ASCII spec texts: one character per byte)."""
    return [len(tok.decode(ids[:k + 1], clean_up_tokenization_spaces=False)) for k in range(len(ids))]


def _value_paths(m, token_bytes, values: list[str]) -> dict[str, set[tuple[int, ...]]]:
    """Every token path the matcher `m` (standing right after a key's colon) allows that spells ' value' for one of
    `values`: an exhaustive walk over the allowed sets, extending a path while its bytes are a proper prefix of a
    value. A token that runs past a value's end is a path of that value too."""
    want = {v: (" " + v).encode() for v in values}
    paths: dict[str, set] = defaultdict(set)

    def walk(m, acc: bytes, path: tuple[int, ...]):
        for t in np.flatnonzero(_bits(m, len(token_bytes))).tolist():
            b = acc + token_bytes(t)
            hit = [v for v, w in want.items() if b.startswith(w)]
            if hit:
                paths[max(hit, key=len)].add(path + (t,))
            elif any(w.startswith(b) for w in want.values()):
                m2 = m.deep_copy()
                assert m2.consume_token(t), m2.get_error()
                walk(m2, b, path + (t,))
            else:
                raise AssertionError(f"the grammar allowed {b!r}, which spells none of {values}")

    walk(m, b"", ())
    return dict(paths)


class _TokenBytes:
    def __init__(self, llg_tok, vocab):
        self.llg, self.vocab, self.memo = llg_tok, vocab, {}

    def __len__(self):
        return self.vocab

    def __call__(self, t: int) -> bytes:
        if t not in self.memo:
            self.memo[t] = self.llg.decode_bytes([t])
        return self.memo[t]


def _at_value(cache, tok, g, fld: str, canonical: bool):
    """A fresh matcher fed the tokenizer's tokens of a spec text up to `fld`'s colon (the first agent's)."""
    text = Spec((Agent("a1", "solver", "Solver", "Solve it.", "medium"),), "a1").to_yaml()
    prefix = text[:text.index(f"    {fld}:") + len(f"    {fld}:")]
    ids = tok(text, add_special_tokens=False)["input_ids"]
    k = _ends(tok, ids).index(len(prefix)) + 1  # the colon ends a token for both BPEs (checked by this index)
    m = cache.matcher(tok, g, canonical=canonical)
    assert all(m.consume_token(t) for t in ids[:k]), m.get_error()
    return m, _TokenBytes(cache.tokenizer(tok)[1], len(tok))


@pytest.mark.parametrize("name", NAMES)
def test_value_tokens_are_the_tokenizers_own(toks, name):
    """canonical_value_tokens against the tokenizer on other spec texts: every value, in every agent of 3-agent specs
    with varied neighbours, is tokenized as exactly that path, delimited by token boundaries."""
    tok = toks[name]
    vt = canonical_value_tokens(tok, ALL_ROLES)
    assert all(vt[f][v] for f in vt for v in vt[f])  # every value is delimited in both shipped BPEs
    for i, role in enumerate(ALL_ROLES):
        agents = tuple(Agent(f"a{k + 1}", ALL_ROLES[(i + k) % len(ALL_ROLES)], f"Role {k}", f"Do part {k} (with care).",
                             CAPACITIES[(i + k) % 3], tuple(f"a{j + 1}" for j in range(k))) for k in range(3))
        text = Spec(agents, "a3").to_yaml()
        ids = tok(text, add_special_tokens=False)["input_ids"]
        ends = _ends(tok, ids)
        starts = [0] + ends[:-1]
        for mt in re.finditer(r"\n    (base_role|capacity):( \w+)\n", text):
            s, e = mt.span(2)
            assert s in starts and e in ends, (name, mt.group(0))
            assert tuple(ids[starts.index(s):ends.index(e) + 1]) == vt[mt.group(1)][mt.group(2)[1:]]


@pytest.mark.parametrize("name", NAMES)
def test_each_value_has_one_token_path(toks, cache, name):
    """The grammar's allowed sets, walked exhaustively from right after 'capacity:' / 'base_role:': canonical, each
    value is spelled by exactly one token path, the tokenizer's own; the text grammar (canonical=False) spells every
    capacity value with several first tokens (the confound the canonical grammar removes)."""
    tok, g = toks[name], SpecGrammar(ALL_ROLES, max_agents=2)
    vt = canonical_value_tokens(tok, ALL_ROLES)
    for fld, values in (("capacity", list(CAPACITIES)), ("base_role", list(ALL_ROLES))):
        m, tb = _at_value(cache, tok, g, fld, canonical=True)
        assert _value_paths(m, tb, values) == {v: {vt[fld][v]} for v in values}
    m, tb = _at_value(cache, tok, g, "capacity", canonical=False)
    old = _value_paths(m, tb, list(CAPACITIES))
    assert set(old) == set(CAPACITIES)
    assert all(vt["capacity"][v] in old[v] for v in CAPACITIES)  # the canonical path was one of them
    assert all(len({p[0] for p in old[v]}) > 1 for v in CAPACITIES), {v: len(p) for v, p in old.items()}


# ---- sampled: the random tiny policy at T=1 ------------------------------------------------------------------------
SMALL = dict(max_agents=1, role_chars=4, duty_chars=8)  # short specs (~45 tokens): the values are what is measured


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoModelForCausalLM
    from lemon.policy.model import cached_random_policy
    return AutoModelForCausalLM.from_pretrained(cached_random_policy(0))


def _sample(tiny, tok, canonical: bool, n: int = 64):
    from lemon.policy.rollout import GrammarConstraint, sample_specs
    con = GrammarConstraint(SpecGrammar.for_domain(P, "math", **SMALL), GrammarCache(), canonical=canonical)
    out = sample_specs(tiny, tok, [[{"role": "user", "content": "Write a spec."}]], n=n, temperature=1.0,
                       max_new_tokens=200, seed=0, constraint=con)
    assert all(s.finished for s in out)
    return out


@pytest.fixture(scope="module")
def canonical_samples(toks, tiny):
    return _sample(tiny, toks["random-tiny"], canonical=True)


def _value_token_paths(tok, samples) -> dict[tuple[str, str], set[tuple[int, ...]]]:
    """(field, value) -> the token paths that spelled ' value' in the samples, read off by re-decoding each sample
    token by token (a value's tokens start right after the colon and end right before the newline, or else the path
    includes the neighbouring token that shares its characters)."""
    paths = defaultdict(set)
    for s in samples:
        ids = list(s.token_ids)
        ends = _ends(tok, ids)
        starts = [0] + ends[:-1]
        for mt in re.finditer(r"\n    (base_role|capacity):( \w+)\n", s.text):
            a, b = mt.span(2)
            paths[(mt.group(1), mt.group(2)[1:])].add(tuple(ids[k] for k in range(len(ids))
                                                            if starts[k] < b and ends[k] > a))
    return paths


def test_sampled_values_take_the_canonical_path(toks, tiny, canonical_samples):
    """64 specs of the random tiny policy at T=1: canonical, every capacity and base_role value appears with exactly one
    token path, the tokenizer's own; the text grammar, same seed, spells some value two ways or more."""
    tok = toks["random-tiny"]
    vt = canonical_value_tokens(tok, ALL_ROLES)
    got = _value_token_paths(tok, canonical_samples)
    assert {v for f, v in got if f == "capacity"} == set(CAPACITIES) and len(got) >= 8  # every capacity was drawn
    assert got == {(f, v): {vt[f][v]} for f, v in got}
    old = _value_token_paths(tok, _sample(tiny, tok, canonical=False))
    assert max(len(p) for p in old.values()) > 1, old


def test_capacity_edit_maps_onto_the_value_tokens(toks, canonical_samples):
    """The counterfactual capacity edit (lemon.train.edits) of canonical samples: span_positions puts its span on
    exactly the value's canonical token(s), which are the tokens whose re-decoded characters overlap the span."""
    from lemon.train.edits import apply_edit, eligible_sites
    from lemon.train.spanmap import span_positions
    tok = toks["random-tiny"]
    vt = canonical_value_tokens(tok, ALL_ROLES)["capacity"]
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731  (as sample_specs decodes Sample.text)
    n_edits = 0
    for s in canonical_samples[:24]:
        spec = parse_spec(s.text, base_roles=P.roles_for("math"), max_agents=SMALL["max_agents"])
        for site in eligible_sites(spec, "capacity", P):
            edit = apply_edit(spec, "capacity", site, P)
            sm = span_positions(s.token_ids, decode, s.text, edit.span)
            ends = _ends(tok, list(s.token_ids))
            starts = [0] + ends[:-1]
            want = tuple(k for k in range(len(ends)) if starts[k] < edit.span[1] and ends[k] > edit.span[0])
            value = spec.agent(site[0]).capacity
            assert sm.dropped is None and sm.positions == want
            assert tuple(s.token_ids[k] for k in sm.positions) == vt[value]
            assert decode([s.token_ids[k] for k in sm.positions]) == " " + value
            n_edits += 1
    assert n_edits >= 5
