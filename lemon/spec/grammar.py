"""The constrained-decoding grammar of a spec: a Lark grammar (llguidance) whose language is a subset of what parse_spec
accepts, and exactly the text Spec.to_yaml() writes for a canonical() spec (the SFT target format):

    agents:
      - id: a1
        base_role: <one of the domain's base roles>
        role: "<1..role_chars chars of TEXT alphabet>"
        duty: "<1..duty_chars chars>"
        capacity: small|medium|large
        depends_on: [<increasing subset of a1..a(k-1)>]
      - id: a2
        ...
    final: a<n>

Why this shape: the plain spec.json_schema() as a constraint gave 0/4 valid specs from
the 0.5B at T=1, two running to the token cap inside unbounded strings and two naming non-agents in depends_on. So every
string is bounded, ids are fixed by position (a1..an) and agent k's dependencies are a choice among a1..a(k-1), each at
most once, in increasing order; `final` is always the last agent (paper §3.1: every agent can then matter). n is
1..max_agents.

Why llguidance (bench/grammar_bench.py --libs on a shared 2-core machine, other jobs running): install 7.6 MB in 1.8 s
with no dependencies, vs xgrammar 0.2.8's ~1 GB (triton 999 MB, apache-tvm-ffi) in 11 s; the same Lark text compiles in
0.01-0.02 s per grammar after a one-off 3-4 s tokenizer conversion (Qwen2.5; SmolLM2 0.4-1.2 s), vs xgrammar's 1.3-1.7 s
tokenizer plus 6-12 s per grammar (one per domain and max_agents); mask + consume per decoding step at batch 8: 2.9-5.1
ms vs 3.3-8.8 ms (Qwen2.5), 0.9-1.4 ms vs 0.4-0.7 ms (SmolLM2), both far below a policy decoding step (~200-400 ms);
both accepted all 64 canonical texts and rejected all 64 near-misses.

Canonical value paths: compiled for a tokenizer, each base_role and capacity value is a sequence of token-id terminals
(`<[id]>`), the tokens the tokenizer itself gives it in a spec text, so one choice has one token path and one
probability (GrammarCache.matcher; canonical=False keeps the text-only grammar, where ' large' is also ' l'+'arge',
' la'+'rge', ...).

Compiling (a tokenizer's vocabulary trie, ~1 s; a grammar's parser) happens once per (tokenizer, SpecGrammar) in a
GrammarCache that callers create and pass around (the trainer holds one); rows get cheap copies of the compiled matcher.
"""
from __future__ import annotations

import hashlib
import json
import time
import weakref
from dataclasses import dataclass
from typing import Mapping, Sequence

from lemon.prompts import CAPACITIES, Prompts
from lemon.spec.schema import DUTY_CHARS, MAX_AGENTS, MAX_LEN, ROLE_CHARS, TEXT_PUNCT, Agent, Spec, _scalar

PIN = "llguidance==1.9.1"


class GrammarUnavailableError(ImportError):
    """The constrained-decoding library is not installed."""

    def __init__(self):
        super().__init__("grammar-constrained sampling needs llguidance: `.venv/bin/pip install -c "
                         f"constraints.txt {PIN}` (it is in requirements.txt), or sample unconstrained "
                         "(constraint=None)")


class GrammarError(ValueError):
    """llguidance rejected a grammar or a matcher entered an error state (a bug in this module or a misuse: say
    which)."""


@dataclass(frozen=True)
class SpecGrammar:
    """What the spec grammar is generated from; equal configs compile to the same grammar (the GrammarCache key)."""

    base_roles: tuple[str, ...]
    """The base roles the spec may use (Prompts.roles_for(domain)); the grammar offers them in this order."""
    max_agents: int = MAX_AGENTS
    """n ranges over 1..max_agents."""
    role_chars: int = ROLE_CHARS
    """Longest role value in characters."""
    duty_chars: int = DUTY_CHARS
    """Longest duty value in characters."""

    def __post_init__(self):
        if not self.base_roles or len(set(self.base_roles)) != len(self.base_roles):
            raise ValueError(f"base_roles must be non-empty and distinct, got {self.base_roles!r}")
        if not 1 <= self.max_agents <= 16:
            raise ValueError(f"max_agents={self.max_agents} must be in 1..16 (the orchestrator's bound)")
        if not 2 <= self.role_chars <= MAX_LEN["role"] or not 2 <= self.duty_chars <= MAX_LEN["duty"]:
            raise ValueError(f"role_chars={self.role_chars} / duty_chars={self.duty_chars} must be in "
                             f"2..{MAX_LEN['role']} / 2..{MAX_LEN['duty']}: beyond parse_spec's limits a grammar text "
                             "would not parse")

    @classmethod
    def for_domain(cls, prompts: Prompts, domain: str, **kw) -> "SpecGrammar":
        """The grammar of specs for a task of `domain` (its base roles plus the common ones, as the prompt lists
        them)."""
        return cls(tuple(prompts.roles_for(domain)), **kw)

    def lark(self, value_tokens: Mapping[str, Mapping[str, Sequence[int] | None]] | None = None) -> str:
        """The grammar in llguidance's Lark dialect. Without `value_tokens` every value is text (any token path that
        spells it). With them (canonical_value_tokens: field -> value -> canonical token ids, or None when the tokenizer
        does not put a token boundary on both sides of the value), each enumerated value is a sequence of token-id
        terminals `<[id]>` and its key's literal stops at the colon: the space before the value is the first byte of the
        value's first token, as the tokenizer writes it. The text language is the same either way."""
        n = self.max_agents
        lit = json.dumps
        sp = "" if value_tokens is not None else " "  # canonical: the value's own first token holds the space
        rules = ['start: "agents:\\n" agent1 rest1']
        for k in range(1, n + 1):
            more = f" | agent{k + 1} rest{k + 1}" if k < n else ""
            rules.append(f'rest{k}: "final: a{k}\\n"{more}')
            deps = f"deps_1_{k - 1}?" if k > 1 else ""
            rules.append(f'agent{k}: "  - id: a{k}\\n    base_role:{sp}" base "\\n    role: \\"" ROLE '
                         f'"\\"\\n    duty: \\"" DUTY "\\"\\n    capacity:{sp}" capacity '
                         f'"\\n    depends_on: [" {deps} "]\\n"')
        for u in range(1, n):  # deps_j_u: a non-empty increasing list of ids drawn from a_j..a_u
            for j in range(1, u + 1):
                tail = f' (", " deps_{j + 1}_{u})? | deps_{j + 1}_{u}' if j < u else ""
                rules.append(f'deps_{j}_{u}: "a{j}"{tail}')
        if value_tokens is None:
            rules.append("base: " + " | ".join(lit(_scalar(r)) for r in self.base_roles))
            rules.append("capacity: " + " | ".join(lit(c) for c in CAPACITIES))
        else:
            base, cap = value_tokens["base_role"], value_tokens["capacity"]
            rules.append("base: " + " | ".join(_token_path(base.get(_scalar(r)), " " + _scalar(r))
                                               for r in self.base_roles))
            rules.append("capacity: " + " | ".join(_token_path(cap.get(c), " " + c) for c in CAPACITIES))
        rules.append(f"ROLE: /{_text_regex(self.role_chars)}/")
        rules.append(f"DUTY: /{_text_regex(self.duty_chars)}/")
        return "\n".join(rules) + "\n"


def _token_path(ids: Sequence[int] | None, text: str) -> str:
    # llguidance's `<[id]>` terminal matches exactly that token (ordinary tokens too, checked on llguidance 1.9.1), so a
    # sequence of them admits one token path; a value the tokenizer does not delimit stays a text literal (any path)
    return " ".join(f"<[{int(i)}]>" for i in ids) if ids else json.dumps(text)


def canonical_value_tokens(hf_tokenizer, base_roles: Sequence[str]) -> dict[str, dict[str, tuple[int, ...] | None]]:
    """{'base_role': {value: ids}, 'capacity': {value: ids}}: the token ids the tokenizer itself gives the space and the
    value in a complete spec text (Spec.to_yaml() of a one-agent spec), or None for a value whose tokens do not start
    right after the key's colon and end right before the newline (the grammar then keeps it as text). Both shipped
    byte-level BPEs split ': large\\n' as ':' | ' large' | '\\n...' (their pre-tokenisers cut before a space-letter
    run and before a newline), so every value is delimited there."""
    out: dict[str, dict[str, tuple[int, ...] | None]] = {"base_role": {}, "capacity": {}}
    for fld, values in (("base_role", base_roles), ("capacity", CAPACITIES)):
        for v in values:
            role, cap = (v, CAPACITIES[0]) if fld == "base_role" else (base_roles[0], v)
            text = Spec((Agent("a1", role, "Agent", "Do the task.", cap),), "a1").to_yaml()
            key = f"\n    {fld}:"
            i = text.index(key) + len(key)
            j = i + 1 + len(_scalar(v))  # [i, j) = ' value'
            ids = hf_tokenizer(text, add_special_tokens=False)["input_ids"]
            ends = [len(hf_tokenizer.decode(ids[:k + 1], clean_up_tokenization_spaces=False)) for k in range(len(ids))]
            starts = [0] + ends[:-1]
            path = None
            if i in starts and j in ends and starts.index(i) <= ends.index(j):
                path = tuple(int(t) for t in ids[starts.index(i):ends.index(j) + 1])
                if hf_tokenizer.decode(list(path), clean_up_tokenization_spaces=False) != text[i:j]:
                    path = None  # a decoder that does not round-trip: keep the value as text
            out[fld][_scalar(v)] = path
    return out

def _text_regex(max_chars: int) -> str:
    # a letter, then up to max_chars-1 more of the alphabet, the last one not a space (see schema.TEXT_PUNCT)
    body = "".join("\\" + c if c in "-[]\\^&~/." else c for c in TEXT_PUNCT)  # escaped for regex-syntax and Lark's /../
    return f"[A-Za-z](?:[A-Za-z0-9{body}]{{0,{max_chars - 2}}}[A-Za-z0-9{body[1:]}])?"


def grammars_for(prompts: Prompts, domains: Sequence[str], **kw) -> list[SpecGrammar]:
    """One SpecGrammar per row domain (rows of one batch may come from different benchmarks)."""
    return [SpecGrammar.for_domain(prompts, d, **kw) for d in domains]


class GrammarCache:
    """Compiled grammars, one per (tokenizer, vocabulary size, EOS ids, SpecGrammar), created by the caller and passed
    in explicitly. `compiles` and `compile_s` count the work done (a test checks reuse; a bench prints the time)."""

    def __init__(self):
        self._keys: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # hf tokenizer -> {(n_vocab, eos): key}
        self._tokenizers: dict = {}
        self._matchers: dict = {}
        self._values: dict = {}  # (tokenizer digest, base roles) -> canonical_value_tokens
        self.compiles = 0
        self.compile_s = 0.0

    def tokenizer(self, hf_tokenizer, *, n_vocab: int | None = None, eos_ids: Sequence[int] | None = None):
        """(key, llguidance LLTokenizer) for a HF fast tokenizer. n_vocab = the model's logits width (may exceed the
        tokenizer's length: those ids are never allowed); eos_ids = the ids generate() stops on (allowed once the spec
        is complete)."""
        llg, llg_hf = require_llguidance()
        eos = tuple(eos_ids) if eos_ids is not None else (hf_tokenizer.eos_token_id,)
        sub = (n_vocab, eos)
        per = self._keys.setdefault(hf_tokenizer, {})
        if sub not in per:
            t0 = time.perf_counter()
            digest = hashlib.sha256(hf_tokenizer.backend_tokenizer.to_str().encode()).hexdigest()[:16]
            key = (digest, n_vocab, eos)
            if key not in self._tokenizers:
                self._tokenizers[key] = llg_hf.from_tokenizer(hf_tokenizer, n_vocab=n_vocab, eos_token=list(eos))
                self.compiles += 1
            self.compile_s += time.perf_counter() - t0
            per[sub] = key
        key = per[sub]
        return key, self._tokenizers[key]

    def value_tokens(self, hf_tokenizer, grammar: SpecGrammar) -> dict[str, dict[str, tuple[int, ...] | None]]:
        """canonical_value_tokens of the tokenizer for the grammar's base roles, computed once."""
        k = (hashlib.sha256(hf_tokenizer.backend_tokenizer.to_str().encode()).hexdigest()[:16], grammar.base_roles)
        if k not in self._values:
            self._values[k] = canonical_value_tokens(hf_tokenizer, grammar.base_roles)
        return self._values[k]

    def matcher(self, hf_tokenizer, grammar: SpecGrammar, *, n_vocab: int | None = None,
                eos_ids: Sequence[int] | None = None, canonical: bool = True):
        """A fresh llguidance LLMatcher for `grammar` (a copy of the compiled one: rows never share state). canonical:
        each base_role / capacity value has one token path, the tokenizer's own (SpecGrammar.lark with value_tokens):
        otherwise the policy's probability of one choice is split over several spellings (' large', ' l'+'arge', ...)
        and so is the credit a reward puts on it. canonical=False compiles the text-only grammar."""
        llg, _ = require_llguidance()
        key, tok = self.tokenizer(hf_tokenizer, n_vocab=n_vocab, eos_ids=eos_ids)
        ck = (key, grammar, canonical)
        if ck not in self._matchers:
            t0 = time.perf_counter()
            lark = grammar.lark(self.value_tokens(hf_tokenizer, grammar) if canonical else None)
            m = llg.LLMatcher(tok, llg.LLMatcher.grammar_from_lark(lark), log_level=0)
            if m.is_error():
                raise GrammarError(f"llguidance rejected the spec grammar for {grammar}: {m.get_error()}")
            self._matchers[ck] = m
            self.compiles += 1
            self.compile_s += time.perf_counter() - t0
        return self._matchers[ck].deep_copy()


def accepts(cache: GrammarCache, hf_tokenizer, grammar: SpecGrammar, token_ids: Sequence[int], **kw) -> bool:
    """True when the grammar takes `token_ids` one by one and is then complete (only EOS may follow). By default the
    canonical grammar (GrammarCache.matcher): a value spelled with other tokens than the tokenizer's own is refused."""
    m = cache.matcher(hf_tokenizer, grammar, **kw)
    return all(m.consume_token(int(t)) for t in token_ids) and m.is_accepting() and not m.is_error()


def require_llguidance():
    """(llguidance, llguidance.hf), or GrammarUnavailableError saying how to install it."""
    try:
        import llguidance
        import llguidance.hf
    except ImportError:
        raise GrammarUnavailableError() from None
    return llguidance, llguidance.hf
