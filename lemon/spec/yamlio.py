"""YAML plumbing of spec parsing: find the spec inside a model completion, and read PyYAML's node tree safely (character
spans of values, no aliases, no duplicate or non-string keys). lemon.spec builds and validates the Spec on top of
this."""
from __future__ import annotations

import re

import yaml

from lemon.spec.errors import NoYamlError, NotMappingError, UnknownFieldError, WrongTypeError, YamlSyntaxError

Span = tuple[int, int]  # [start, end) character offsets into Spec.text
_STR_TAG = "tag:yaml.org,2002:str"


# ---- extraction of the YAML from a model completion ---------------------------------------------------------------
_FENCE = re.compile(r"```[ \t]*(?:ya?ml|YAML)?[ \t]*\n")
_TOP = re.compile(r"^(agents|final)[ \t]*:", re.M)


def extract_yaml(text: str) -> tuple[str, int]:
    """Return (yaml_text, offset of yaml_text in text). Accepts a bare spec, a ```yaml fenced block (closing fence
    optional: a truncated completion still parses or fails on its own), or a spec with lines of prose before / after
    it."""
    m = _FENCE.search(text)
    if m:
        start = m.end()
        end = text.find("```", start)
        return text[start:end if end >= 0 else len(text)], start
    brace = re.search(r"^[ \t]*\{", text, re.M)
    top = _TOP.search(text)
    # a JSON/flow document (e.g. schema-constrained decoding)
    if brace and (top is None or brace.start() < top.start()):
        start = brace.end() - 1
        end = text.rfind("}") + 1
        return text[start:end if end > start else len(text)], start
    lines = text.splitlines(keepends=True)
    pos, start, end = 0, None, None
    for line in lines:
        if start is None:
            if _TOP.match(line):
                start = pos
        elif line.strip() and not (line[0] in " \t-#" or _TOP.match(line)):
            end = pos  # first column-0 line that cannot continue the spec: trailing prose
            break
        pos += len(line)
    if start is None:
        raise NoYamlError("no line starting with `agents:` and no ```yaml fence", "text")
    return text[start:end if end is not None else len(text)], start



def _span(node, off: int) -> Span:
    # A block collection's end mark sits at the start of the next token: trim the trailing whitespace/newlines so the
    # span covers the value's own characters only (the CF loss must not touch the next key's tokens).
    buf = node.end_mark.buffer or ""
    end = node.end_mark.index
    if buf:
        while end > node.start_mark.index and buf[end - 1] in " \t\r\n":
            end -= 1
    return (off + node.start_mark.index, off + end)


def _mapping(node, where: str, seen: set[int]) -> dict[str, tuple]:
    """A mapping node -> {key: (key_node, value_node)}, rejecting aliases, non-string keys and duplicate keys."""
    if not isinstance(node, yaml.MappingNode):
        raise NotMappingError(f"expected a mapping, got {_kind(node)}", where)
    if node.tag != "tag:yaml.org,2002:map":
        raise WrongTypeError(f"explicit tag {node.tag!r} is not allowed on a mapping", where)
    _no_alias(node, where, seen)
    out: dict[str, tuple] = {}
    for k, v in node.value:
        _no_alias(v, where, seen)
        if not isinstance(k, yaml.ScalarNode) or k.tag != _STR_TAG:
            raise WrongTypeError(f"keys must be strings, got {_kind(k)}", where)
        if k.value in out:
            raise UnknownFieldError(f"key {k.value!r} appears twice", where)
        out[k.value] = (k, v)
    return out


def _no_alias(node, where: str, seen: set[int]) -> None:
    # compose() returns the *same* node object for an alias; the spans of a shared node would be ambiguous.
    if id(node) in seen:
        raise YamlSyntaxError("anchors/aliases are not allowed in a spec", where)
    seen.add(id(node))


def _kind(node) -> str:
    if isinstance(node, yaml.MappingNode):
        return "a mapping"
    if isinstance(node, yaml.SequenceNode):
        return "a list"
    return f"a scalar {node.tag.rsplit(':', 1)[-1]} {node.value[:30]!r}"
