"""The real-worker CF-GRPO vs global-GRPO comparison (issue 13, deliverable 2) as a chain of session-sized legs.

One run of the comparison is ~10 h of 2 cores; a session here has 3 h and keeps nothing but git. So the work is cut where
what crosses a session boundary is small text: the SFT corpus (both arms rebuild the same warm start from it, and the
adapter's sha256 is checked against the first leg's), each arm's training record (metrics, rollouts) and each trained
policy's greedy specs for the evaluation and dev questions (a spec is ~150 tokens of YAML). Executing specs on the
workers, the baselines and the comparison need no adapter and run in any later leg, resumably. The logic lives in
lemon.study.duel; this script is its command line.

    .venv/bin/python bench/duel.py train --arm cf       # leg 1: SFT corpus + warm start, 10 CF-GRPO steps, greedy specs
    .venv/bin/python bench/duel.py train --arm global   # leg 2: the same warm start (from the committed corpus), lambda = 0
    .venv/bin/python bench/duel.py status               # what is done, what is missing, and the command for each
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lemon.study.duel import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
