"""Served policy vs transformers policy (lemon.policy.served, lemon.eval.served): do they write the same greedy specs,
how close are their token log-probs, and how much faster is the server?

    .venv/bin/python bench/served_policy_bench.py --model smollm2-135m --adapter outputs/testbed/sft-smoke-tiny --n 8
    .venv/bin/python bench/served_policy_bench.py --model qwen2.5-coder-0.5b --random-lora 0.05 --n 4 --max-agents 4
    .venv/bin/python bench/served_policy_bench.py ... --weights shipped      # the quantized GGUF instead of exact F32

Questions: the first --n of GSM8K's train pool shuffled with --seed (never eval-pool questions). --random-lora S builds
a LoRA with every B ~ N(0, S^2) (seed 0; peft's fresh B is zero, which would test nothing) in a temp folder. Both
writers are greedy under the spec grammar; transformers runs first for all questions, then the server, so neither
competes with the other for the 2 cores (other jobs on the machine still do: say so when quoting times). Prints one line
per question and a summary; --json writes it all.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path



def random_lora(model_name: str, scale: float, out: Path, r: int = 8) -> Path:
    import torch
    from lemon.policy.model import PolicyConfig, load_policy
    torch.manual_seed(0)
    model, tok = load_policy(PolicyConfig(model=model_name, lora_r=r, lora_alpha=2 * r))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, scale)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def logprob_gap(model, tok, served, prompt_ids: list[int], n: int = 40) -> float:
    """max |log p_hf - log p_server| over the server's first n unconstrained greedy tokens (same token ids fed to
    both)."""
    import torch
    out = served._post({"prompt": prompt_ids, "n_predict": n, "temperature": 0.0, "n_probs": 1, "return_tokens": True,
                        "top_k": 0, "min_p": 0.0, "cache_prompt": False})
    toks, lps = out["tokens"], [c["logprob"] for c in out["completion_probabilities"]]
    with torch.no_grad():
        lg = model(torch.tensor([prompt_ids + toks])).logits[0].float().log_softmax(-1)  # (T, V)
    return max(abs(float(lg[len(prompt_ids) - 1 + i, t]) - lp) for i, (t, lp) in enumerate(zip(toks, lps)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="shipped policy model (lemon.run.models.SHIPPED)")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--adapter", type=Path, help="a saved peft adapter of --model")
    src.add_argument("--random-lora", type=float, metavar="S", help="a random LoRA with B ~ N(0, S^2)")
    ap.add_argument("--weights", choices=("f32", "shipped"), default="f32")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-agents", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=286)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    from lemon.benchmarks import get_benchmark
    from lemon.benchmarks.pools import pool
    from lemon.eval.orchestrator import OrchestratorConfig, PolicySpecWriter
    from lemon.eval.served import ServedPolicySpecWriter
    from lemon.prompts import default_prompts
    from lemon.policy.served import ServedPolicy
    from lemon.policy.model import PolicyConfig, load_policy
    import random
    prompts, bench = default_prompts(), get_benchmark("gsm8k")
    qs = list(pool("gsm8k", "train"))
    random.Random(a.seed).shuffle(qs)
    qs = qs[:a.n]
    tmp = tempfile.TemporaryDirectory(prefix="lemon-served-bench-")
    adapter = a.adapter or random_lora(a.model, a.random_lora, Path(tmp.name) / "lora")
    oc = OrchestratorConfig(max_tokens=a.max_tokens, max_agents=a.max_agents)
    model, tok = load_policy(PolicyConfig(model=a.model), adapter=adapter)
    model.eval()
    hf_writer, rows = PolicySpecWriter(model, tok, oc), []
    for e in qs:
        t0 = time.perf_counter()
        p = hf_writer.propose(e.question, bench.domain, prompts)
        rows.append({"id": e.id, "hf_s": time.perf_counter() - t0, "hf_text": p.text, "hf_valid": p.spec is not None,
                     "hf_tokens": p.completion_tokens})
    t0 = time.perf_counter()
    with ServedPolicy(a.model, adapter, weights=a.weights) as served:
        start_s = time.perf_counter() - t0
        w = ServedPolicySpecWriter(served, tok, oc)
        for e, r in zip(qs, rows):
            t0 = time.perf_counter()
            p = w.propose(e.question, bench.domain, prompts)
            r.update(served_s=time.perf_counter() - t0, served_text=p.text, served_tokens=p.completion_tokens,
                     same=p.text == r["hf_text"])
            print(f"{e.id}: transformers {r['hf_s']:.1f} s, served {r['served_s']:.1f} s, {r['served_tokens']} tokens, "
                  f"same={r['same']}", flush=True)
        gap = logprob_gap(model, tok, served, w.prompt_ids(qs[0].question, bench.domain, prompts))
        desc = served.describe()
    hf_med, sv_med = statistics.median(r["hf_s"] for r in rows), statistics.median(r["served_s"] for r in rows)
    summary = {"model": a.model, "adapter": str(a.adapter) if a.adapter else f"random B~N(0,{a.random_lora}^2)",
               "weights": a.weights, "n": len(rows), "identical": sum(r["same"] for r in rows),
               "same_tokens": sum(r["hf_tokens"] == r["served_tokens"] for r in rows), "median_hf_s": hf_med,
               "median_served_s": sv_med, "speedup": hf_med / sv_med, "server_start_s": start_s,
               "max_logprob_gap": gap, "server": desc["name"], "command": "python " + " ".join(sys.argv)}
    print(json.dumps(summary, indent=1))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
