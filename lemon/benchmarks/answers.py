"""Answer extraction and normalisation for the numeric and multiple-choice benchmarks.

Numeric (GSM8K, MultiArith, SVAMP) -- follows two public normalisers:

* OpenAI grade-school-math ``grade_school_math/dataset.py::extract_answer``: the gold
  and a model's answer follow ``#### <number>``; commas are stripped
  (``match_str.replace(",", "")``).
* Kojima et al. (2022) zero-shot-CoT, ``kojima-takeshi188/zero_shot_cot``
  ``utils.py::answer_cleansing``: strip commas, take all numbers with
  ``re.findall(r'-?\\d+\\.?\\d*', pred)``; when an answer trigger was found take the
  FIRST number after it, otherwise the LAST number in the text; drop a trailing ``.``;
  compare numerically.

Order of preference here: the last ``Answer:`` / ``answer is`` segment (first number in
it), then the last ``\\boxed{...}``, then the last ``#### ...``, then the last number of
the whole text. ``$``, thousands separators, ``%`` and trailing units/periods are
ignored; fractions ``3/4`` are exact. Comparison is numeric (integers exactly, others
within 1e-6 absolute), so ``72 == 72.0 == "72.00"`` and ``1,000 == 1000``.

Multiple choice (AQuA A-E, MMLU A-D) -- in the spirit of Kojima's ``answer_cleansing``
for AQuA (``re.findall(r'A|B|C|D|E', pred)``, first after the trigger / last otherwise)
but stricter, to avoid false positives such as the article in "A farmer has ...":
explicit ``Answer:`` / ``answer is`` segments first, then ``\\boxed{}``, then the
reply's last line (a letter form or an option's text), then ``(B)`` / ``B)`` /
``**B**``, then a standalone capital letter at the very end. A reply whose answer is
exactly one option's content (case/whitespace-insensitive; numerically equal for
numeric options) maps to that option's letter; an option text shared by several
options is ambiguous and maps to nothing.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Sequence

# ----------------------------------------------------------------------------- numbers

# A number: optional sign, thousands-separated or plain digits, optional decimals, or a
# bare ".5"; optionally a fraction "/d". Not preceded by a letter/digit/dot.
_NUM = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+"
_NUMBER_RE = re.compile(rf"(?<![\w.])(?:{_NUM})(?:\s*/\s*(?:\d+))?(?![\d])")
_ANSWER_TRIGGER_RE = re.compile(
    r"(?i)(?:\bfinal\s+answer|\banswer)(?:\s*\(arabic numerals\))?\s*(?:is|:|=)|"
    r"\banswer\s*\*\*\s*:?")
_BOXED_RE = re.compile(r"\\boxed\s*\{((?:[^{}]|\{[^{}]*\})*)\}")
_HASHES_RE = re.compile(r"####\s*([^\n]*)")


def parse_number(text: str | float | int) -> Fraction | None:
    """Parse one number (``"$1,000"``, ``"72.00"``, ``"3/4"``, ``"-5"``) to a Fraction."""
    if isinstance(text, (int, float)):
        if isinstance(text, float) and not math.isfinite(text):
            return None
        return Fraction(text)
    s = str(text).strip()
    m = _NUMBER_RE.search(s.replace("$", "").replace("\\$", ""))
    if not m:
        return None
    token = re.sub(r"\s+", "", m.group(0)).replace(",", "")
    try:
        return Fraction(token)
    except (ValueError, ZeroDivisionError):
        return None


def canonical_number(value: Fraction) -> str:
    """``Fraction(72) -> '72'``, ``Fraction(3, 4) -> '0.75'``, ``Fraction(1, 3) -> '1/3'``."""
    if value.denominator == 1:
        return str(value.numerator)
    den = value.denominator
    for p in (2, 5):
        while den % p == 0:
            den //= p
    if den == 1:  # terminating decimal
        text = f"{float(value):.12f}".rstrip("0").rstrip(".")
        if Fraction(text) == value:
            return text
    return f"{value.numerator}/{value.denominator}"


def _numbers(text: str):
    """Every parseable number in the text, in order (dollar signs and thousands separators dropped)."""
    text = text.replace("\\$", "").replace("$", "")
    for m in _NUMBER_RE.finditer(text):
        token = re.sub(r"\s+", "", m.group(0)).replace(",", "")
        try:
            yield Fraction(token)
        except (ValueError, ZeroDivisionError):
            continue


def _first_number(segment: str) -> Fraction | None:
    return next(_numbers(segment), None)


def _last_number(text: str) -> Fraction | None:
    last = None
    for last in _numbers(text):
        pass
    return last


def _segments_after(pattern: re.Pattern, text: str) -> list[str]:
    """Text after each match of ``pattern`` up to the end of its line; if that is empty,
    the next non-empty line (e.g. ``"Answer:\\n\\n72"``)."""
    out = []
    for m in pattern.finditer(text):
        rest = text[m.end():]
        line, _, tail = rest.partition("\n")
        if not line.strip():
            nxt = next((ln for ln in tail.split("\n") if ln.strip()), "")
            line = nxt
        out.append(line)
    return out


def extract_number(text: str | None) -> str | None:
    """Extract a model's final numeric answer as a canonical string, or ``None``."""
    if not text:
        return None
    text = str(text)
    for seg in reversed(_segments_after(_ANSWER_TRIGGER_RE, text)):
        val = _first_number(_strip_boxed(seg))
        if val is not None:
            return canonical_number(val)
    for content in reversed(_BOXED_RE.findall(text)):
        val = _first_number(_strip_latex(content))
        if val is not None:
            return canonical_number(val)
    for seg in reversed(_HASHES_RE.findall(text)):
        val = _first_number(seg)
        if val is not None:
            return canonical_number(val)
    val = _last_number(text)
    return None if val is None else canonical_number(val)


def _strip_latex(s: str) -> str:
    # \frac{3}{4} -> 3/4 ; \dfrac likewise; drop \text{...} wrappers and \,
    s = re.sub(r"\\d?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}", r"\1/\2", s)
    s = re.sub(r"\\text\s*\{([^{}]*)\}", r"\1", s)
    return s.replace("\\,", "").replace("\\!", "")


def _strip_boxed(seg: str) -> str:
    m = _BOXED_RE.search(seg)
    return _strip_latex(m.group(1)) if m else seg


def numbers_match(pred: str | float | int | None, gold: str | float | int | None,
                  rel_tol: float = 1e-9, abs_tol: float = 1e-6) -> bool:
    """Numeric equality: exact when both are integers (so 192000001 != 192000000), else
    ``math.isclose`` with a small tolerance for float round-off (0.1 + 0.2 == 0.3)."""
    if pred is None or gold is None:
        return False
    p, g = parse_number(pred), parse_number(gold)
    if p is None or g is None:
        return False
    if p == g:
        return True
    if p.denominator == 1 and g.denominator == 1:
        return False
    return math.isclose(float(p), float(g), rel_tol=rel_tol, abs_tol=abs_tol)


# ----------------------------------------------------------------------------- letters

def normalize_text(s: str) -> str:
    """Lower-case, collapse whitespace, strip surrounding markup and a trailing period."""
    s = re.sub(r"\s+", " ", str(s)).strip().lower()
    s = s.strip("*`_ ").strip() or s  # keep an option that is only markup, e.g. "**"
    s = re.sub(r"[.\s]+$", "", s) or s
    return s


_LETTER_TRIGGER_RE = re.compile(
    r"(?i)\b(?:final\s+)?answer(?:\s+(?:choice|option))?\s*(?:\*\*)?\s*(?:is|:|=)?"
    r"\s*(?:\*\*)?\s*:?")
_BARE_LETTER_RE = re.compile(r"^[\s(\[*{`'\"]*([A-Ea-e])[\s)\]*}`'\".,:;!]*$")
_DELIM_LETTER_RE = re.compile(r"^[\s*`]*(?:\(([A-Ea-e])\)|\[([A-Ea-e])\]|([A-E])\s*[).:])")
_LEAD_WORDS_RE = re.compile(
    r"(?i)^\s*(?:[:=\-]\s*)?(?:(?:is|the|correct|right|best|final)\s+)*"
    r"(?:(?:option|choice|letter)\s*)?[:\-]?\s*")


def _option_index(content: str, options: Sequence[str]) -> int | None:
    """Index of the unique option whose text equals ``content`` (normalised, or
    numerically for numeric options); ``None`` if none or ambiguous."""
    if not options:
        return None
    norm = normalize_text(content)
    if not norm:
        return None
    hits = [i for i, o in enumerate(options) if normalize_text(o) == norm]
    if len(hits) == 1:
        return hits[0]
    if hits:
        return None
    val = parse_number(content) if re.fullmatch(r"[\s$\\\d,./%-]+", content.strip("* ."))\
        else None
    if val is not None:
        hits = [i for i, o in enumerate(options)
                if re.fullmatch(r"[\s$\d,./%-]+", o.strip(" .")) and
                parse_number(o) == val]
        if len(hits) == 1:
            return hits[0]
    return None


def _parse_letter_segment(seg: str, letters: str, options: Sequence[str]) -> str | None:
    """Interpret the text right after an answer trigger (or a whole line)."""
    raw = _strip_boxed(seg).strip()
    seg = _LEAD_WORDS_RE.sub("", raw, count=1).strip()
    # the raw text first, so option texts such as "-5" or "The mental nerve" are not
    # mangled by dropping lead words ("the", "is", "option", ":" / "-")
    for cand in dict.fromkeys((raw, seg)):
        if not cand:
            continue
        m = _BARE_LETTER_RE.match(cand)
        if m and m.group(1).upper() in letters:
            return m.group(1).upper()
        idx = _option_index(cand, options)
        if idx is not None and idx < len(letters):
            return letters[idx]
    if not seg:
        return None
    m = _DELIM_LETTER_RE.match(seg)
    if m:
        letter = next(g for g in m.groups() if g).upper()
        if letter in letters:
            return letter
    # "B 21" where "21" is option B's text
    m = re.match(r"^([A-E])\s+(.+)$", seg)
    if m and m.group(1) in letters and options:
        idx = _option_index(m.group(2), options)
        if idx is not None and letters[idx] == m.group(1):
            return m.group(1)
    return None


def extract_letter(text: str | None, options: Sequence[str] = (),
                   letters: str = "ABCDE") -> str | None:
    """Extract a multiple-choice letter (``letters``) from a reply, or ``None``."""
    if not text:
        return None
    text = str(text)
    letters = letters[: len(options)] if options else letters
    # 1. explicit answer triggers, last first (an option's text may span several lines)
    triggers = list(_LETTER_TRIGGER_RE.finditer(text))
    segments = _segments_after(_LETTER_TRIGGER_RE, text)
    for m, seg in zip(reversed(triggers), reversed(segments)):
        if options:  # option text right after a minimal "answer:" / "answer is"
            rest = re.sub(r"(?i)^[a-z ]*?answer\s*(?:is\b|:)?[ \t]*", "", text[m.start():])
            for cand in (rest, rest.split("\n", 1)[0], text[m.end():]):
                bare = _BARE_LETTER_RE.match(cand)
                if bare and bare.group(1).upper() in letters:  # a letter beats an option
                    return bare.group(1).upper()             # whose text is "c" or "B"
                idx = _option_index(cand, options)
                if idx is not None and idx < len(letters):
                    return letters[idx]
        got = _parse_letter_segment(seg, letters, options)
        if got:
            return got
    # 2. \boxed{B}
    for content in reversed(_BOXED_RE.findall(text)):
        got = _parse_letter_segment(content, letters, options)
        if got:
            return got
    # 3. the whole reply / its last non-empty line is a letter form or an option's text
    lines = [ln for ln in text.strip().split("\n") if ln.strip()]
    for candidate in (text.strip(), lines[-1] if lines else ""):
        got = _parse_letter_segment(candidate, letters, options)
        if got:
            return got
    # 4. last "(B)", "B)" at a word start, or "**B**"
    cls = "".join(sorted(set(letters)))
    pat = re.compile(rf"(?<!\w)\(([{cls}])\)|(?<![\w(])([{cls}])\)|\*\*([{cls}])\*\*")
    found = list(pat.finditer(text))
    if found:
        return next(g for g in found[-1].groups() if g)
    # 5. a standalone capital letter at the very end ("... so I pick C.")
    m = re.search(rf"(?<![\w'])([{cls}])[\s.!)\]*]*$", text)
    if m:
        return m.group(1)
    return None
