"""Span -> token mapping for the counterfactual term (paper §3.3: the contrast is applied to the edited span only; here
S_i is the set of SAMPLED token positions of the edited field's value, and the text is never re-tokenised).

Three steps, all here:
1. align the completion text the reward function saw with decode(ids): TRL may prepend a bootstrap prefix to the text,
   and its `parse_response` path may strip whitespace or a trailing EOS from it, so the text can be longer OR shorter
   than the ids' decoding (`align`);
2. give every token the characters of decode(ids) it holds, by incremental decoding, O(T) decode calls
   (`token_char_offsets`). A byte-level BPE (Qwen2.5, SmolLM2) splits a multi-byte character over several tokens; every
   token holding one of its bytes covers that character, so a token holding only leading bytes is never left out of a
   span;
3. select the tokens whose characters overlap the span (`span_token_mask`).
`span_positions` runs the three and returns a SpanMap whose `dropped` names why nothing could be mapped (logged as
cf/dropped), so a lost counterfactual term is counted, never silent.
"""
from __future__ import annotations

from dataclasses import dataclass
from difflib import SequenceMatcher
from typing import Callable, Sequence

Span = tuple[int, int]  # [start, end) characters
Decode = Callable[[list[int]], str]

# stable reasons for SpanMap.dropped (the trainer counts them)
TEXT_MISMATCH = "text_mismatch"  # the completion text and decode(ids) share no stretch that holds the span
SPAN_OUTSIDE = "span_outside_ids"  # the span lies (partly) in text the ids did not produce (e.g. a prepended prefix)
# decoding a prefix of ids is not a prefix of decode(ids) (beyond a split char)
DECODE_INCONSISTENT = "decode_inconsistent"
EMPTY_SPAN = "empty_span"
NO_TOKENS = "no_tokens"  # no sampled token holds a character of the span
# a UTF-8 character has at most 3 bytes after its first: at most 3 replacement characters while unfinished
_MAX_PARTIAL = 3


@dataclass(frozen=True)
class SpanMap:
    positions: tuple[int, ...]  # sampled token positions (indices into ids) that hold characters of the span
    dropped: str | None = None  # None when mapped, else one of the reasons above
    shift: int = 0  # text index = decode(ids) index + shift
    detail: str = ""  # a human-readable note on why it was dropped


def align(text: str, full: str) -> int | None:
    """Shift k such that text[i + k] == full[i] over the part the two strings share, or None. Tried in order: equal; a
    prefix prepended to the text (TRL's bootstrap); the text cut at the end (stripped EOS/whitespace) or at the start;
    the text inside the decoding or the decoding inside the text; the same on both stripped of whitespace; else the
    longest common stretch if it is at least half the shorter string (callers check that it holds the span). The
    preferred placement comes first, so a repeated substring never picks an arbitrary occurrence."""
    if text == full:
        return 0
    if text.endswith(full):
        return len(text) - len(full)
    if full.startswith(text) or text.startswith(full):
        return 0
    if full.endswith(text):
        return len(text) - len(full)
    for a, b, sign in ((full, text, -1), (text, full, 1)):
        i = a.find(b)
        if i >= 0 and a.find(b, i + 1) < 0:
            return sign * i
    stripped = text.strip(), full.strip()
    if all(stripped):
        k = align(*stripped) if stripped != (text, full) else None
        if k is not None:
            return k + (len(text) - len(text.lstrip())) - (len(full) - len(full.lstrip()))
    m = SequenceMatcher(None, text, full, autojunk=False).find_longest_match(0, len(text), 0, len(full))
    return m.a - m.b if 2 * m.size >= min(len(text), len(full)) > 0 else None  # a stretch, not a stray shared word


def _prefix_lengths(ids: Sequence[int], decode: Decode, full: str, stop: int | None = None):
    """Yield, per token t, (c_t, partial_t, p_t): p_t = decode(ids[:t+1]), c_t = characters of `full` it reproduces,
    partial_t = whether it also holds bytes of the NEXT character (an unfinished multi-byte character decodes to
    U+FFFD). Raises ValueError when a prefix's decoding departs from `full` by more than an unfinished character. Stops
    once c_t >= stop (the tokens after a span do not matter)."""
    ids = list(ids)
    for t in range(len(ids)):
        p = decode(ids[: t + 1])  # one call per token: O(T) calls
        if full.startswith(p):
            c = len(p)
        else:
            q = p.rstrip("\ufffd")
            c = len(q) if full.startswith(q) else _common_prefix(p, full)
            if len(p) - c > _MAX_PARTIAL or p[c:].strip("\ufffd"):
                raise ValueError(f"decode(ids[:{t + 1}]) = ...{p[max(0, c - 20):c + 10]!r} departs from decode(ids) at "
                                 f"character {c}")
        yield c, len(p) > c, p
        if stop is not None and c >= stop:
            return


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def token_char_offsets(ids: Sequence[int], decode: Decode, full: str | None = None,
                       stop: int | None = None) -> list[Span]:
    """[start, end) characters of decode(ids) held by each sampled token (incremental decoding, one decode call per
    token). With c_t the complete characters after token t, token t holds the bytes from character c_{t-1} (the one it
    starts or continues) to character c_t - 1, or to c_t when it ends inside a multi-byte character: range [c_{t-1},
    c_t + partial_t). So every token holding a byte of a character covers it (neighbours then share that character), and
    only a token that decodes to nothing (a skipped special token) gets an empty range. With `stop`, offsets end at the
    first token reaching character `stop`."""
    full = decode(list(ids)) if full is None else full
    out, prev_c, prev_p = [], 0, ""
    for c, partial, p in _prefix_lengths(ids, decode, full, stop):
        c = max(c, prev_c)  # never backwards (a decoder that cleans up spaces may shorten a prefix for a moment)
        # unchanged decoding: a token that decodes to nothing, unless a character is unfinished (its middle bytes leave
        # the single U+FFFD as it was; a special token inside a character does not happen)
        out.append((prev_c, prev_c) if p == prev_p and not partial else (prev_c, min(len(full), c + partial)))
        prev_c, prev_p = c, p
    return out


def span_token_mask(offsets: Sequence[Span], spans: Sequence[Span]) -> list[bool]:
    """True for every token whose (non-empty) character range overlaps any of `spans` (half-open intervals)."""
    return [e_tok > s_tok and any(s < e_tok and s_tok < e for s, e in spans) for s_tok, e_tok in offsets]


def span_positions(ids: Sequence[int], decode: Decode, text: str, span: Span) -> SpanMap:
    """The sampled token positions holding `text[span[0]:span[1]]`, where `text` is the completion text the edit was
    made on and `ids` the sampled completion ids (decoded by `decode` exactly as the trainer decodes them). Never raises
    on mismatched inputs: a SpanMap with empty positions and a `dropped` reason comes back instead."""
    s, e = span
    if not 0 <= s < e <= len(text):
        return SpanMap((), EMPTY_SPAN, 0, f"span {span} in a text of {len(text)} characters")
    ids = list(ids)
    full = decode(ids)
    k = align(text, full)
    if k is None:
        return SpanMap((), TEXT_MISMATCH, 0,
                       f"text ({len(text)} chars) and decode(ids) ({len(full)} chars) share nothing")
    fs, fe = s - k, e - k  # the span in decode(ids) coordinates
    if fs < 0 or fe > len(full) or full[fs:fe] != text[s:e]:
        reason = SPAN_OUTSIDE if (fs < 0 or fe > len(full)) else TEXT_MISMATCH
        return SpanMap((), reason, k, f"span {span} -> {(fs, fe)} of decode(ids) ({len(full)} chars), "
                                      f"text {text[s:e][:40]!r} vs ids {full[max(fs, 0):max(fe, 0)][:40]!r}")
    try:
        offsets = token_char_offsets(ids, decode, full, stop=fe)
    except ValueError as err:
        return SpanMap((), DECODE_INCONSISTENT, k, str(err))
    pos = tuple(t for t, m in enumerate(span_token_mask(offsets, [(fs, fe)])) if m)
    if not pos:
        return SpanMap((), NO_TOKENS, k, f"no token holds characters {fs}..{fe} of decode(ids)")
    return SpanMap(pos, None, k)
