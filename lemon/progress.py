"""Progress bars that stay visible when notebooks run headless.

Inside a Jupyter kernel `tqdm.auto` draws an ipywidget; under papermill that widget never reaches the console, so a
two-hour study would look frozen. `lemon.study.runner.run_study` sets LEMON_TEXT_PROGRESS=1 for its kernels, and then
every bar is a plain text bar on stderr (papermill streams the kernel's stderr to the console), refreshed at most every
10 s.
"""
from __future__ import annotations

import os
import sys

TEXT_ENV = "LEMON_TEXT_PROGRESS"


def text_mode() -> bool:
    return os.environ.get(TEXT_ENV, "") not in ("", "0")


def bar(iterable=None, **kw):
    """tqdm.auto's bar in an interactive session, a text bar on stderr under a headless study."""
    if text_mode():
        from tqdm.std import tqdm
        kw.setdefault("mininterval", 10.0)
        return tqdm(iterable, file=sys.stderr, dynamic_ncols=False, ncols=100, **kw)
    from tqdm.auto import tqdm
    return tqdm(iterable, **kw)
