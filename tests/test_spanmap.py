"""Span -> sampled-token mapping on the real byte-level BPE tokenizers of the shipped policies (Qwen2.5-Coder-0.5B,
SmolLM2-135M), checked against a slow obvious reference: each token's own UTF-8 bytes (read from its vocabulary string,
not from decode) and the span's bytes; a token belongs to the span exactly when the two byte ranges overlap."""
import random

import pytest

from lemon.spec import parse_spec
from lemon.train import spanmap as SM
from lemon.train.spanmap import SpanMap, align, span_positions, span_token_mask, token_char_offsets

DUTIES = ["Café au lait: prix en €, déjà vu — naïve façade.", "用漢字和数学解题：先列出已知量，再计算。",
          "Count the 😀 and 👩‍💻 emoji, then 🇫🇷 flags; done ✅.", "Ünïcödé e\u0301 (combining) and Ω ≤ ∑ ∫ 𝔘𝔫𝔦.",
          "Plain ASCII duty for comparison, with a number 42."]


def spec_text(rng) -> str:
    lines = ["agents:"]
    ids = []
    for k in range(rng.randint(2, 4)):
        aid = f"a{k}"
        deps = rng.sample(ids, min(len(ids), rng.randint(0, 2)))
        lines += [f"  - id: {aid}", "    base_role: solver", f"    role: \"Rôle {k} ✨\"",
                  f"    duty: \"{rng.choice(DUTIES)} {rng.choice(DUTIES)}\"",
                  f"    capacity: {rng.choice(['small', 'large'])}", f"    depends_on: [{', '.join(deps)}]"]
        ids.append(aid)
    return "\n".join(lines) + "\n"


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte <-> printable-character table, which byte-level BPE vocabularies (Qwen2, SmolLM2) are written in."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class Tok:
    def __init__(self, name):
        from transformers import AutoTokenizer
        from lemon.policy.model import converted_dir
        self.hf = AutoTokenizer.from_pretrained(converted_dir(name))
        self.special = set(self.hf.all_special_ids)
        self.bd = _byte_decoder()
        self.bc = {b: c for c, b in self.bd.items()}
        self._lengths = {}

    def token_bytes(self, i: int, skip_special: bool) -> bytes:
        if i in self.special:
            return b"" if skip_special else self.hf.convert_ids_to_tokens(i).encode()
        return bytes(self.bd[ch] for ch in self.hf.convert_ids_to_tokens(i))

    def byte_lengths(self, ids, skip_special: bool) -> list[int]:
        key = (tuple(ids), skip_special)
        if key not in self._lengths:
            self._lengths[key] = [len(self.token_bytes(i, skip_special)) for i in ids]
        return self._lengths[key]

    def exact_ids(self, piece: str) -> list[int]:
        """Canonical ids of `piece`, or its single-byte tokens where the tokenizer would normalise it (Qwen's NFC turns
        e + U+0301 into é; a sampled sequence is never normalised)."""
        ids = self.hf.encode(piece, add_special_tokens=False)
        if self.hf.decode(ids) == piece:
            return ids
        return [self.hf.convert_tokens_to_ids(c) for c in "".join(self.bc[b] for b in piece.encode())]

    def sampled_ids(self, text: str, rng, canonical: bool = False) -> list[int]:
        """Ids a model could have sampled for `text`: canonical pieces mixed with runs of single-byte tokens that split
        multi-byte characters at every byte boundary (canonical: line by line)."""
        if canonical:
            return [i for line in text.splitlines(keepends=True) for i in self.exact_ids(line)]
        out, i = [], 0
        while i < len(text):
            j = min(len(text), i + rng.randint(1, 12))
            if rng.random() < 0.3:
                out += [self.hf.convert_tokens_to_ids(self.bc[b]) for b in text[i:j].encode()]
            else:
                out += self.exact_ids(text[i:j])
            i = j
        return out


@pytest.fixture(scope="module", params=["qwen2.5-coder-0.5b", "smollm2-135m"])
def tok(request):
    return Tok(request.param)


def reference_positions(tok: Tok, ids, full: str, fspan, skip_special: bool) -> tuple[int, ...]:
    """Tokens whose own bytes overlap the span's bytes (the slow, obvious definition)."""
    bs, be = len(full[:fspan[0]].encode()), len(full[:fspan[1]].encode())
    out, pos = [], 0
    for t, n in enumerate(tok.byte_lengths(ids, skip_special)):
        if n and pos < be and bs < pos + n:
            out.append(t)
        pos += n
    return tuple(out)


def _all_spans(s):
    return [sp for a in s.spans for sp in (a.role, a.duty, a.capacity, *a.deps)]


def test_mapping_equals_byte_reference_on_multibyte_specs(tok):
    rng = random.Random(0)
    n_spans = n_split = 0
    for trial in range(8):
        text = spec_text(rng)
        ids = tok.sampled_ids(text, rng, canonical=trial == 0)
        decode = lambda x: tok.hf.decode(x, skip_special_tokens=True)  # noqa: E731  (as TRL decodes)
        assert decode(ids) == text
        for span in _all_spans(parse_spec(text)):
            m = span_positions(ids, decode, text, span)
            assert m.dropped is None and m.shift == 0
            assert m.positions == reference_positions(tok, ids, text, span, True)
            covered = decode(ids[m.positions[0]:m.positions[-1] + 1])
            assert m.positions == tuple(range(m.positions[0], m.positions[-1] + 1))
            assert text[span[0]:span[1]] in covered  # the selected tokens hold the whole span ...
            for t in (m.positions[0], m.positions[-1]):  # ... and each end token holds a byte of it
                rest = [p for p in m.positions if p != t]
                assert not rest or text[span[0]:span[1]] not in decode(ids[rest[0]:rest[-1] + 1])
            n_spans += 1
            n_split += any(tok.hf.decode([i]).count("\ufffd") for i in ids[m.positions[0]:m.positions[-1] + 1])
    assert n_spans > 60 and n_split > 10  # split multi-byte characters really were inside spans


def test_text_longer_or_shorter_than_the_decoded_ids(tok):
    """TRL's bootstrap prefix makes the text longer; its parse_response path may strip a trailing EOS / whitespace (or
    the leading whitespace), making the text shorter than decode(ids)."""
    rng = random.Random(1)
    eos = tok.hf.convert_tokens_to_ids("<|im_end|>")
    nl = tok.hf.encode("\n\n", add_special_tokens=False)
    for trial in range(3):
        core = spec_text(rng)
        ids = tok.hf.encode(" \n", add_special_tokens=False) + tok.sampled_ids(core, rng) + nl + [eos]
        for skip in (False, True):
            decode = lambda x: tok.hf.decode(x, skip_special_tokens=skip)  # noqa: E731
            full = decode(ids)
            variants = {"prefix": "<think>\n\n</think>\n\n" + full,
                        "eos_and_space_stripped": full[:full.rindex("\n") + 1].rstrip() if not skip else full.rstrip(),
                        "both_ends_stripped": full.replace("<|im_end|>", "").strip(),
                        "prefix_and_stripped": "Assistant:\n" + full.replace("<|im_end|>", "").strip()}
            for name, text in variants.items():
                spans = _all_spans(parse_spec(text))
                for span in rng.sample(spans, 6):
                    m = span_positions(ids, decode, text, span)
                    assert m.dropped is None, (name, m)
                    fspan = (span[0] - m.shift, span[1] - m.shift)
                    assert full[fspan[0]:fspan[1]] == text[span[0]:span[1]]
                    assert m.positions == reference_positions(tok, ids, full, fspan, skip), name


def test_o_of_t_decode_calls(tok):
    text = spec_text(random.Random(2))
    ids = tok.sampled_ids(text, random.Random(3))
    calls = []

    def decode(x):
        calls.append(len(x))
        return tok.hf.decode(x, skip_special_tokens=True)

    span = parse_spec(text).spans[-1].duty
    assert span_positions(ids, decode, text, span).positions
    assert len(calls) <= len(ids) + 1  # one full decode, then one per token up to the span's end
    calls.clear()
    assert span_positions(ids, decode, text, parse_spec(text).spans[0].role).positions
    assert len(calls) < len(ids) // 2  # an early span stops early


def test_offsets_cover_every_character_and_split_characters_twice(tok):
    text = "é漢字😀 done 🇫🇷"
    ids = [tok.hf.convert_tokens_to_ids(tok.bc[b]) for b in text.encode()]  # one token per byte: every character split
    decode = lambda x: tok.hf.decode(x)  # noqa: E731
    offs = token_char_offsets(ids, decode)
    assert all(e > s for s, e in offs)  # no token gets an empty range (the old mapping left 14 of these 26 empty)
    for c in range(len(text)):  # each character is held by exactly the tokens of its bytes
        holders = [t for t, (s, e) in enumerate(offs) if s <= c < e]
        b0 = len(text[:c].encode())
        assert holders == list(range(b0, b0 + len(text[c].encode())))


def test_skipped_special_token_gets_an_empty_range(tok):
    eos = tok.hf.convert_tokens_to_ids("<|im_end|>")
    ids = tok.hf.encode("abc", add_special_tokens=False) + [eos] + tok.hf.encode(" d", add_special_tokens=False)
    offs = token_char_offsets(ids, lambda x: tok.hf.decode(x, skip_special_tokens=True))
    k = ids.index(eos)
    assert offs[k][0] == offs[k][1] and span_token_mask(offs, [(0, 5)])[k] is False


def test_drop_reasons_instead_of_silence():
    pieces = ["agents", ":", " x", "\n"]
    decode = lambda x: "".join(pieces[i] for i in x)  # noqa: E731  (a control-flow double: no tokenizer involved)
    ids = [0, 1, 2, 3]
    assert span_positions(ids, decode, "agents: x\n", (8, 9)) == SpanMap((2,), None, 0)
    assert span_positions(ids, decode, "agents: x\n", (3, 3)).dropped == SM.EMPTY_SPAN
    assert span_positions(ids, decode, "PREFIX agents: x\n", (0, 6)).dropped == SM.SPAN_OUTSIDE
    assert span_positions(ids, decode, "completely different", (0, 5)).dropped == SM.TEXT_MISMATCH
    flaky = lambda x: decode(x) if len(x) in (0, 4) else "zz" * len(x)  # noqa: E731  prefixes disagree with the whole
    assert span_positions(ids, flaky, "agents: x\n", (8, 9)).dropped == SM.DECODE_INCONSISTENT
    nothing = lambda x: "" if len(x) < 4 else decode(x)  # noqa: E731
    m = span_positions(ids, nothing, "agents: x\n", (8, 9))
    assert m.dropped is None and m.positions == (3,)  # every character arrives with the last token


def test_align_prefers_the_natural_placement():
    assert align("abc", "abc") == 0
    assert align("PREabc", "abc") == 3  # prepended bootstrap
    assert align("abc", "abc<eos>") == 0  # trailing EOS stripped from the text
    assert align("abc", "  abc  ") == -2  # both ends stripped
    assert align("P: abc", " abc\n<eos>") == 2  # prefix on one side, trailing whitespace + EOS on the other
    assert align("xyz", "abc") is None
