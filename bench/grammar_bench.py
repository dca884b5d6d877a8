"""Grammar-constrained rollouts of the orchestrator policy (issue 11, "Learning signal" / "Policy speed on CPU").

Three measurements, each printing figures (nothing asserted):
  valid (default)  valid-spec rate of sampled specs at T=1, constrained vs unconstrained, with tokens/s and mean
                   completion tokens, on seeded train-pool questions (gsm8k -> math; --extra adds one mmlu and one
                   humaneval row set)
  --dtype          generate throughput at batch 8 for fp32 weights, bf16 weights and fp32 + bf16 autocast, with/without
                   the grammar (lemon.policy.dtype chooses the sampling default from this)
  --libs           llguidance vs xgrammar on the spec grammar: tokenizer + grammar compile time per tokenizer, mask
                   time per decoding step at batch 8 (teacher-forced along real spec texts), agreement on accepted and
                   rejected texts. xgrammar is not a project dependency: run this mode with a Python that has it.

    .venv/bin/python bench/grammar_bench.py --questions 8 --n 8            # 64 samples per arm
    .venv/bin/python bench/grammar_bench.py --adapter outputs/train-cpu/sft  # after SFT
    .venv/bin/python bench/grammar_bench.py --dtype --max-new-tokens 32
    /path/to/python-with-xgrammar bench/grammar_bench.py --libs
Timings on the shared 2-core machine are pessimistic when other jobs run; --threads sets torch's thread count.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time


from lemon.prompts import default_prompts
from lemon.spec import Agent, Spec, SpecError, parse_spec
from lemon.spec.schema import clean_text
from lemon.spec.grammar import GrammarCache, SpecGrammar

POLICY, SMALL = "qwen2.5-coder-0.5b", "smollm2-135m"


def _messages(bench: str, k: int, seed: int, max_agents: int):
    from lemon.benchmarks import get_benchmark, pool
    from lemon.eval.orchestrator import orchestrator_messages
    qs = random.Random(seed).sample(pool(bench, "train"), k)
    dom = get_benchmark(bench).domain
    return [orchestrator_messages(q.question, dom, default_prompts(), max_agents) for q in qs], dom


def _load(name: str, adapter: str | None = None):
    from lemon.policy.model import PolicyConfig, load_policy
    model, tok = load_policy(PolicyConfig(model=name), lora=False)
    if adapter:
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, adapter)
    return model, tok


def run_valid(a):
    from lemon.policy.rollout import GrammarConstraint, sample_specs
    arms = a.arms.split(",")
    bad = set(arms) - {"constrained", "unconstrained"}
    if bad:  # before the model loads
        raise SystemExit(f"--arms: unknown arm(s) {sorted(bad)} (constrained, unconstrained)")
    model, tok = _load(a.model, a.adapter)
    if a.bf16_copy:
        import torch
        from lemon.policy.dtype import SamplingCopy
        model = SamplingCopy(model, torch.bfloat16).sync(model)
    cache = GrammarCache()
    sets = [("gsm8k", a.questions)] + ([("mmlu", max(1, a.questions // 4)), ("humaneval", max(1, a.questions // 4))]
                                       if a.extra else [])
    print(f"model {a.model} adapter {a.adapter} | T=1 | n={a.n} per question | max_new_tokens {a.max_new_tokens} | "
          f"max_agents {a.max_agents} | seed {a.seed} | dtype {a.sampling_dtype} bf16 copy {a.bf16_copy} | "
          f"torch threads {a.threads}")
    print(f"{'set':10} {'arm':13} {'samples':>7} {'valid':>6} {'rate':>6} {'finished':>8} {'mean tok':>8} {'tok/s':>6} "
          f"{'wall s':>7}  errors")
    for bench, k in sets:
        msgs, dom = _messages(bench, k, a.seed, a.max_agents)
        roles = default_prompts().roles_for(dom)
        for arm in arms:
            con = GrammarConstraint(SpecGrammar.for_domain(default_prompts(), dom, max_agents=a.max_agents), cache) \
                if arm == "constrained" else None
            out, wall = [], 0.0
            for i in range(0, len(msgs), a.batch_prompts):  # one generate call per batch of prompts (x n rows)
                t0 = time.perf_counter()
                out += sample_specs(model, tok, msgs[i:i + a.batch_prompts], n=a.n, temperature=1.0,
                                    max_new_tokens=a.max_new_tokens, seed=a.seed + i, constraint=con,
                                    dtype=a.sampling_dtype)
                wall += time.perf_counter() - t0
                print(f"  [{bench} {arm}] {len(out)}/{len(msgs) * a.n} samples, {wall:.0f} s", file=sys.stderr,
                      flush=True)
            ok, errs = 0, {}
            for s in out:
                try:
                    parse_spec(s.text, base_roles=roles, max_agents=a.max_agents)
                    ok += 1
                except SpecError as e:
                    errs[e.code] = errs.get(e.code, 0) + 1
            ntok = sum(s.n_tokens for s in out)
            print(f"{bench:10} {arm:13} {len(out):7d} {ok:6d} {ok / len(out):6.3f} {sum(s.finished for s in out):8d} "
                  f"{ntok / len(out):8.1f} {ntok / wall:6.1f} {wall:7.0f}  {errs or ''}", flush=True)
    print(f"grammar compile (tokenizer + grammars): {cache.compile_s:.1f} s")


def run_dtype(a):
    from lemon.policy.dtype import SamplingCopy, cpu_bf16_flags, cpu_bf16_native
    from lemon.policy.rollout import GrammarConstraint, sample_specs
    import torch
    msgs, dom = _messages("gsm8k", 1, a.seed, a.max_agents)
    print(f"cpu bf16 flags {sorted(cpu_bf16_flags())} native {cpu_bf16_native()} | {a.model} | batch {a.n} (1 "
          f"prompt x n) | {a.max_new_tokens} new tokens | torch threads {a.threads}")
    grammar = SpecGrammar.for_domain(default_prompts(), dom, max_agents=a.max_agents)
    cache = GrammarCache()
    policy, tok = _load(a.model)
    t0 = time.perf_counter()
    shadow = SamplingCopy(policy, torch.bfloat16)
    t_copy = time.perf_counter() - t0
    t0 = time.perf_counter()
    shadow.sync(policy)
    print(f"SamplingCopy: made in {t_copy:.1f} s, sync {1e3 * (time.perf_counter() - t0):.1f} ms (no trainable "
          "params here)")
    cache.matcher(tok, grammar, n_vocab=policy.get_output_embeddings().weight.shape[0], eos_ids=[tok.eos_token_id])
    runs: dict = {}
    configs = [(w, m, d, c) for w, m, d in (("fp32", policy, "model"), ("bf16", shadow.model, "model"),
                                            ("fp32", policy, "autocast_bf16"))
                                            for c in (None, GrammarConstraint(grammar, cache))]
    for _ in range(a.rounds):  # interleaved rounds; the minimum is the figure least disturbed by other jobs
        for weights, model, mode, con in configs:
            t0 = time.perf_counter()  # prefill (shared prompt) + 1 token: subtracted to get the decode rate
            sample_specs(model, tok, msgs, n=a.n, temperature=1.0, max_new_tokens=1, seed=a.seed, dtype=mode)
            pre = time.perf_counter() - t0
            t0 = time.perf_counter()
            out = sample_specs(model, tok, msgs, n=a.n, temperature=1.0, max_new_tokens=a.max_new_tokens, seed=a.seed,
                               constraint=con, dtype=mode)
            wall = time.perf_counter() - t0
            steps = max(s.n_tokens for s in out)
            runs.setdefault((weights, mode, con is not None), []).append(
                (wall, sum(s.n_tokens for s in out), pre, (wall - pre) / max(1, steps - 1)))
    print(f"{a.rounds} interleaved rounds; min (median) over rounds")
    for (weights, mode, g), rs in runs.items():
        wall = min(r[0] for r in rs)
        med = statistics.median(r[0] for r in rs)
        print(f"weights {weights} {mode:14} grammar {'yes' if g else 'no ':3}  {rs[0][1]:4d} tokens  wall "
              f"{wall:5.1f} s ({med:5.1f})  {rs[0][1] / wall:5.1f} tok/s | prefill {min(r[2] for r in rs):4.1f} s | "
              f"decode step {1e3 * min(r[3] for r in rs):4.0f} ms ({1e3 * statistics.median(r[3] for r in rs):4.0f})",
              flush=True)


# ---- --libs ----------------------------------------------------------------------------------------------------------
def _random_canonical(rng: random.Random, roles, max_agents: int) -> str:
    words = ("plan solve check the and numbers result carefully step total (each) one, two; price = 3 + 4 * x / 2 "
             "is it?").split()
    agents = []
    for k in range(1, rng.randint(1, max_agents) + 1):
        text = lambda lo, hi, m: (clean_text(" ".join(rng.choice(words) for _ in range(rng.randint(lo, hi))), m)  # noqa
                                  or "R")
        deps = tuple(f"a{j}" for j in range(1, k) if rng.random() < 0.4)
        agents.append(Agent(f"a{k}", rng.choice(roles), text(1, 5, 48), text(3, 30, 200),
                            rng.choice(("small", "medium", "large")), deps))
    return Spec(tuple(agents), agents[-1].id).to_yaml()


def _corrupt(text: str, rng: random.Random) -> str:
    """A near-miss the grammar must reject (each stays valid YAML; most would even parse)."""
    fixes = [lambda t: t.replace("role: \"", "role: \"X: ", 1), lambda t: t.replace("id: a1", "id: plan", 1),
             lambda t: t.replace("depends_on: []", "depends_on: [a1]", 1),
             lambda t: t.replace("final: a", "final: a0", 1),
             lambda t: t.replace("capacity: small", "capacity: huge", 1),
             lambda t: t.replace("duty: \"", "duty: \"" + "x" * 201, 1),
             lambda t: t.replace("base_role: ", "base_role: wizard", 1), lambda t: t.replace("\"\n", "\" \n", 1)]
    return next(t for t in (f(text) for f in rng.sample(fixes, len(fixes))) if t != text)


def run_libs(a):
    import numpy as np
    from transformers import AutoTokenizer
    from lemon.policy.model import converted_dir
    try:
        import xgrammar as xgr
    except ImportError:
        xgr = None
        print("xgrammar not importable here: llguidance rows only")
    import llguidance as llg
    import llguidance.numpy as llg_np
    P, rng = default_prompts(), random.Random(a.seed)
    roles = tuple(P.roles_for("math"))
    texts = [_random_canonical(rng, roles, 4) for _ in range(64)]
    bad = [_corrupt(t, rng) for t in texts]
    for name in (POLICY, SMALL):
        path = converted_dir(name)
        tok = AutoTokenizer.from_pretrained(path)
        import json
        V = json.loads((path / "config.json").read_text())["vocab_size"]
        eos = [tok.eos_token_id]
        for max_agents in (4, 8):
            g = SpecGrammar(roles, max_agents=max_agents)
            cache = GrammarCache()
            t0 = time.perf_counter()
            cache.tokenizer(tok, n_vocab=V, eos_ids=eos)
            t_tok = time.perf_counter() - t0
            t0 = time.perf_counter()
            cache.matcher(tok, g, n_vocab=V, eos_ids=eos)
            t_gram = time.perf_counter() - t0
            row = {"llguidance": (t_tok, t_gram)}
            if xgr is not None:
                t0 = time.perf_counter()
                info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=V, stop_token_ids=eos)
                t_tok = time.perf_counter() - t0
                t0 = time.perf_counter()
                cg = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False).compile_grammar(
                    xgr.Grammar.from_lark(g.lark()))
                row["xgrammar"] = (t_tok, time.perf_counter() - t0)
            for lib, (tt, tg) in row.items():
                print(f"{name:20} max_agents {max_agents}  {lib:10}  tokenizer {tt:5.2f} s  grammar {tg:5.2f} s")
            if max_agents != 4:
                continue
            ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
            bad_ids = [tok(t, add_special_tokens=False)["input_ids"] for t in bad]

            def ll_run(seqs, batch=8):  # teacher-forced: mask + consume per step for `batch` rows at once
                acc, step_s = [], []
                ex = llg.LLExecutor(num_threads=2)
                mask = llg_np.allocate_token_bitmask(batch, V)
                for i in range(0, len(seqs), batch):
                    rows = seqs[i:i + batch]
                    ms = [cache.matcher(tok, g, n_vocab=V, eos_ids=eos) for _ in rows]
                    ok = [True] * len(rows)
                    for t in range(max(map(len, rows)) + 1):
                        live = [(m, b) for b, m in enumerate(ms) if ok[b] and t <= len(rows[b])]
                        if not live:
                            break
                        t0 = time.perf_counter()
                        llg_np.fill_next_token_bitmask_par(ex, live, mask)
                        for m, b in live:
                            tid = rows[b][t] if t < len(rows[b]) else eos[0]
                            ok[b] = ok[b] and bool((mask[b, tid // 32] >> (tid % 32)) & 1) and m.consume_token(tid)
                        step_s.append(time.perf_counter() - t0)
                    acc += ok
                return acc, step_s

            def xg_run(seqs, batch=8):
                acc, step_s = [], []
                bm = xgr.BatchGrammarMatcher(2)
                mask = xgr.allocate_token_bitmask(batch, V)
                for i in range(0, len(seqs), batch):
                    rows = seqs[i:i + batch]
                    ms = [xgr.GrammarMatcher(cg) for _ in rows]
                    ok = [True] * len(rows)
                    for t in range(max(map(len, rows)) + 1):
                        live = [b for b in range(len(rows)) if ok[b] and t <= len(rows[b])]
                        if not live:
                            break
                        t0 = time.perf_counter()
                        bm.batch_fill_next_token_bitmask([ms[b] for b in live], mask, live)
                        for b in live:
                            tid = rows[b][t] if t < len(rows[b]) else eos[0]
                            ok[b] = (ok[b] and bool((int(mask[b, tid // 32]) >> (tid % 32)) & 1)
                                     and ms[b].accept_token(tid))
                        step_s.append(time.perf_counter() - t0)
                    acc += ok
                return acc, step_s

            runs = [("llguidance", ll_run)] + ([("xgrammar", xg_run)] if xgr is not None else [])
            parsed = [_parses(t, roles) for t in bad]
            for lib, fn in runs:
                good, st = fn(ids)
                rej, _ = fn(bad_ids)
                print(f"{name:20} {lib:10}  mask+consume per step at batch 8: mean {1e3 * statistics.mean(st):.2f} ms, "
                      f"p95 {1e3 * float(np.percentile(st, 95)):.2f} ms | accepts {sum(good)}/{len(good)} "
                      f"canonical texts, rejects {len(rej) - sum(rej)}/{len(rej)} near-misses ({sum(parsed)} of which "
                      "parse_spec accepts)")


def _parses(text: str, roles) -> bool:
    try:
        parse_spec(text, base_roles=roles)
        return True
    except SpecError:
        return False


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--libs", action="store_true", help="compare llguidance and xgrammar")
    ap.add_argument("--dtype", action="store_true", help="generate throughput per dtype")
    ap.add_argument("--model", default=POLICY)
    ap.add_argument("--adapter", default=None, help="a LoRA adapter folder (e.g. the SFT warm start)")
    ap.add_argument("--questions", type=int, default=8, help="gsm8k train questions (valid mode)")
    ap.add_argument("--n", type=int, default=8, help="samples per question (valid) / batch size (dtype)")
    ap.add_argument("--batch-prompts", type=int, default=1, help="questions per generate call (x n rows)")
    ap.add_argument("--extra", action="store_true", help="also one mmlu and one humaneval row set")
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--arms", default="constrained,unconstrained", help="valid mode: which arms to sample")
    ap.add_argument("--max-agents", type=int, default=4)
    ap.add_argument("--sampling-dtype", default="model", help="'model' or 'autocast_bf16' (lemon.policy.dtype)")
    ap.add_argument("--bf16-copy", action="store_true", help="valid mode: sample a bf16 SamplingCopy of the policy")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--rounds", type=int, default=3, help="dtype mode: interleaved repetitions")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    import torch
    if a.threads:
        torch.set_num_threads(a.threads)
    a.threads = torch.get_num_threads()
    run_libs(a) if a.libs else run_dtype(a) if a.dtype else run_valid(a)


if __name__ == "__main__":
    main()
