"""HumanEval: turn a model reply into a program and run it in :mod:`lemon.run.sandbox`.

Program assembly (cf. OpenAI ``human-eval/execution.py::check_correctness``, which runs
``prompt + completion + "\\n" + test + "\\n" + f"check({entry_point})"``):

* code = the ```python fenced block that defines ``entry_point`` (else the last
  ```python / ``` block, else the raw reply);
* if the code defines ``def <entry_point>(``, program = the full prompt (imports *and*
  helper functions such as ``is_palindrome`` / ``encode_cyclic`` / ``poly``) + the code.
  Every HumanEval prompt is valid Python on its own (a function whose body is its
  docstring), so the completion's later ``def`` simply overrides it;
* otherwise the reply is treated as a function body: program = prompt + code (re-indented
  by four spaces if it does not compile as given);
* then ``test`` + ``check(entry_point)`` + a print of a per-call random sentinel, which
  the sandbox must see on stdout (so ``os._exit(0)`` / ``sys.exit(0)`` can't fake a pass).
"""

from __future__ import annotations

import re
import textwrap
import uuid
from typing import Any

from lemon.run.sandbox import SandboxLimits, run_python

from .data import Example

DEFAULT_TIMEOUT_S = 10.0

_FENCE_RE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)


def extract_code(text: str, entry_point: str | None = None) -> str:
    """The code in a reply: prefer a fenced block defining ``entry_point``."""
    text = text or ""
    blocks = [(lang.lower(), body) for lang, body in _FENCE_RE.findall(text)]
    if not blocks:
        return text
    if entry_point:
        pat = re.compile(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", re.M)
        for _lang, body in reversed(blocks):
            if pat.search(body):
                return body
    py = [b for lang, b in blocks if lang in ("python", "py", "python3")]
    return (py or [b for _l, b in blocks])[-1]


def defines_entry_point(code: str, entry_point: str) -> bool:
    return re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", code, re.M) is not None


def _compiles(src: str) -> bool:
    try:
        compile(src, "<humaneval>", "exec")
    except (SyntaxError, ValueError):
        return False
    return True


def build_solution(prompt: str, completion: str, entry_point: str) -> str:
    """Prompt + completion as one module defining ``entry_point`` (no tests)."""
    code = extract_code(completion, entry_point)
    if defines_entry_point(code, entry_point):
        return prompt.rstrip("\n") + "\n\n\n" + textwrap.dedent(code).strip("\n") + "\n"
    body = code if code.strip() else "    pass\n"
    candidate = prompt + body
    if not _compiles(candidate):
        # a dedented body (e.g. from a code fence): indent it under the signature
        reindented = prompt + textwrap.indent(textwrap.dedent(body).strip("\n") + "\n",
                                              "    ")
        if _compiles(reindented):
            return reindented
    return candidate


def build_program(example: Example, completion: str, sentinel: str) -> str:
    meta = example.meta
    solution = build_solution(meta["prompt"], completion, meta["entry_point"])
    return (f"{solution}\n\n{meta['test']}\n\n"
            f"check({meta['entry_point']})\nprint({sentinel!r})\n")


def run_humaneval(example: Example, completion: str, limits: Any = None) -> Any:
    """Run the assembled program in the sandbox; returns the ``SandboxResult``."""
    if limits is None:
        limits = SandboxLimits(timeout_s=DEFAULT_TIMEOUT_S)
    sentinel = f"__LEMON_HUMANEVAL_PASSED_{uuid.uuid4().hex}__"
    program = build_program(example, completion, sentinel)
    return run_python(program, limits, require_sentinel=sentinel)


def score_humaneval(example: Example, completion: str, limits: Any = None) -> float:
    if not completion or not str(completion).strip():
        return 0.0
    return 1.0 if run_humaneval(example, completion, limits).passed else 0.0
