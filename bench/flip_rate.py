"""How often does the SAME greedy worker call give a different reply? (issue 30, "deterministic scoring")

    python bench/flip_rate.py [--model qwen2.5-coder-0.5b] [--repeats 20] [--max-tokens 128] [--out DIR]

One embedded llama-server (4 slots, continuous batching, as the trainer's pool runs it). The same request (a GSM8K train
question, temperature 0, fixed seed) is sent `repeats` times under three conditions:
  c1     one request at a time (the server's other slots idle);
  c8     8 requests in flight: the repeats interleaved with as many OTHER questions, so the batch each repeat is decoded
         in differs from repeat to repeat (what a training step's concurrent executions do);
  det    8 callers as in c8, through lemon's deterministic client (lemon.run.servers.DETERMINISTIC: one request in
         flight per server and llama-server's prompt cache off), which the trainer's scoring uses.
Printed per condition: distinct replies, flip rate (share of repeats whose reply differs from the most common one),
distinct final answers, seconds. Written to DIR/flip_rate.json when --out is given.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from lemon.benchmarks import pool as bench_pool
from lemon.benchmarks.answers import extract_number
from lemon.run.backends import SamplingParams
from lemon.run.servers import DETERMINISTIC, ServerConfig, ServerManager

SOLVE = "Solve the problem step by step, briefly. End with a line 'Answer: <number>'.\n\n"


def run_condition(backend, target, others, repeats: int, in_flight: int, params: SamplingParams) -> dict:
    msgs = lambda q: [{"role": "user", "content": SOLVE + q}]  # noqa: E731
    jobs = []
    for i in range(repeats):
        jobs.append(("target", target))
        if in_flight > 1:
            jobs.append(("other", others[i % len(others)]))
    t = time.perf_counter()
    with ThreadPoolExecutor(max_workers=in_flight) as ex:
        outs = list(ex.map(lambda j: (j[0], backend.chat(msgs(j[1]), params).text), jobs))
    secs = time.perf_counter() - t
    replies = [o for kind, o in outs if kind == "target"]
    counts = Counter(replies)
    answers = Counter(str(extract_number(r)) for r in replies)
    return {"repeats": len(replies), "in_flight": in_flight, "distinct_replies": len(counts),
            "flip_rate": round(1 - counts.most_common(1)[0][1] / len(replies), 3), "distinct_answers": dict(answers),
            "seconds": round(secs, 1), "requests": len(jobs), "mode_reply": counts.most_common(1)[0][0]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--question", default="gsm8k/train/626", help="the repeated question (the duel saw it flip)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    exs = {e.id: e for e in bench_pool("gsm8k", "train")}
    if a.question not in exs:
        raise SystemExit(f"flip_rate: {a.question} is not in the gsm8k train pool")
    target = exs[a.question].question
    others = [e.question for e in list(exs.values())[:50] if e.id != a.question][:a.repeats]
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, seed=0)
    res = {"model": a.model, "question": a.question, "max_tokens": a.max_tokens, "conditions": {}}
    with ServerManager() as m:
        m.add_shipped(a.model, ServerConfig(slots=4), alias=a.model)
        m.start()
        plain = m.backend(a.model)
        det = m.backend(a.model, **DETERMINISTIC)
        for name, backend, flight in (("c1", plain, 1), ("c8", plain, 8), ("det", det, 8)):
            r = res["conditions"][name] = run_condition(backend, target, others, a.repeats, flight, params)
            print(f"[flip_rate] {name:4s} in flight {flight}: {r['distinct_replies']} distinct replies of "
                  f"{r['repeats']}, flip rate {r['flip_rate']:.2f}, answers {r['distinct_answers']}, "
                  f"{r['seconds']:.0f} s for {r['requests']} requests", flush=True)
        res["server"] = m.describe_server(a.model)
    c = res["conditions"]
    # deterministic = the reply it gets alone
    res["det_mode_equals_c1"] = c["det"]["mode_reply"] == c["c1"]["mode_reply"]
    print(f"[flip_rate] det's reply {'==' if res['det_mode_equals_c1'] else '!='} the reply alone (c1)")
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "flip_rate.json").write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
