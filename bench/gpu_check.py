"""The device check (issue 29): the CF-GRPO trainer's CUDA path WITHOUT Unsloth, checked and measured in one run.

    python bench/gpu_check.py --out DIR [--device auto|cpu|cuda] [--tokenizer DIR] [--probe paper|tiny]
    bash scripts/gpu_check.sh              # the same on a bare GPU machine (carried wheels, tokenizer and data)

Five checks, each recorded in DIR/gpu_check.json (pass / fail, figures) and printed as it ends; one failing check does
not stop the others; the exit code is 1 when any failed.
1. env       torch / CUDA / GPU / package versions, CPU SIMD flags.
2. cf_loss   lemon.train.cf.step_advantages + TRL's token-level loss on a tiny random Qwen2 (fp32) on the device against
             the same on the CPU: loss and LoRA gradients must agree (finding 1 was a device mismatch in exactly this
             path).
3. rollouts  grammar-constrained sampling (lemon.policy.rollout.sample_specs + llguidance) on the device: every spec
             parses, the same seed gives the same specs.
4. trainer   lemon.train.pipeline.train (TRL GRPOTrainer + CF mixin, transformers backend) on the tiny testbed world
             with the exact simulated scorer: 3 steps, then checkpoint-3 removed and the run resumed from checkpoint-2;
             finite losses, the LoRA moved, the resumed run reaches step 3.
5. probe     a random-init policy at the paper's shape (Qwen2.5-7B dims in bf16, LoRA r=16 on the 7 projections), one CF
             step (forward, TRL's per-token loss with (B, T) CF advantages, backward, AdamW) at batch 16 with prompt 970
             + completion 740 tokens, gradient checkpointing off and on; the largest micro-batch that fits (16, 8, 4, 2,
             1 with gradient accumulation to 16): seconds per step and peak GiB. '--probe tiny' (the default on a CPU)
             runs the same code at a toy shape, so the README suite keeps it alive.
The tiny policy uses a real tokenizer (--tokenizer; default: the converted SmolLM2-135M's) so the spec grammar compiles.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import sys
import time
import traceback
from pathlib import Path

import torch

from lemon.policy.model import TINY_QWEN2, random_policy

PAPER_SHAPE = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                   num_attention_heads=28, num_key_value_heads=4)  # Qwen2.5-7B-Instruct's config.json
# the paper profile's measured prompt / spec lengths (DESIGN.md)
PAPER_BATCH = dict(batch=16, prompt=970, completion=740)
TINY_BATCH = dict(batch=4, prompt=24, completion=16)
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def env_report(dev: torch.device) -> dict:
    import importlib.metadata as md
    vers = {}
    for p in ("torch", "transformers", "peft", "trl", "accelerate", "datasets", "llguidance", "unsloth", "vllm"):
        try:
            vers[p] = md.version(p)
        except md.PackageNotFoundError:
            vers[p] = None
    flags = set()
    try:
        flags = {f for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")
                 for f in line.split(":", 1)[1].split()} & {"avx2", "avx512f", "avx512_bf16", "amx_bf16"}
    except OSError:
        pass
    rep = {"device": str(dev), "python": platform.python_version(), "versions": vers, "cpu_flags": sorted(flags),
           "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        rep.update(gpu=p.name, gpu_mem_gib=round(p.total_memory / 2**30, 1), capability=f"{p.major}.{p.minor}",
                   bf16=torch.cuda.is_bf16_supported())
    return rep


def _lora(model, r: int):
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(1)
    m = get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=list(PROJ),
                                         task_type="CAUSAL_LM"))
    with torch.no_grad():  # LoRA B starts at 0; give it values so LoRA A gets a gradient too
        g = torch.Generator().manual_seed(2)
        for n, p in m.named_parameters():
            if "lora_B" in n:
                p.copy_((torch.randn(p.shape, generator=g) * 0.01).to(p.dtype))
    return m


def cf_step_loss(model, ids, cmask, smask, rewards, deltas, *, lam=1.0, micro=None):
    """One CF-GRPO loss + backward the way TRL computes it (token-level 'dapo' loss at ratio 1, beta 0): per-token
    log-probs of the completion, (B, T) advantages from lemon.train.cf.step_advantages, loss = -sum(A * logp * mask) /
    sum(mask), accumulated over micro-batches. ids (B, P + T); cmask / smask (B, T). Returns the loss (float)."""
    from trl.trainer.utils import selective_log_softmax
    from lemon.train.cf import step_advantages
    B, T = cmask.shape
    # (B, T) on device
    adv, keep, _ = step_advantages(rewards, [i // 4 for i in range(B)], deltas, cmask, smask, lam=lam)
    mask = cmask * keep[:, None].to(cmask.dtype)  # (B, T)
    n_tok = mask.sum()
    micro = micro or B
    total = 0.0
    for s in range(0, B, micro):
        sl = slice(s, s + micro)
        logits = model(input_ids=ids[sl], logits_to_keep=T + 1).logits[:, :-1]  # (b, T, V): predicts completion tokens
        logp = selective_log_softmax(logits, ids[sl, -T:])  # (b, T)
        loss = -(adv[sl] * logp * mask[sl]).sum() / n_tok
        loss.backward()
        total += float(loss)
    return total


def _batch(vocab: int, batch: int, prompt: int, completion: int, dev, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, prompt + completion), generator=g)  # (B, P + T)
    cmask = torch.ones(batch, completion)  # (B, T)
    cmask[1, completion // 2:] = 0  # a shorter completion (padding)
    smask = torch.zeros(batch, completion)  # (B, T)
    smask[0, 2:5] = 1  # rollout 0's edited span
    rewards = [1.0, 0.0, 0.5, 0.5] * (batch // 4)
    rewards[-1] = None  # an errored execution: out of the loss
    deltas = [0.8] + [0.0] * (batch - 1)
    return ids.to(dev), cmask.to(dev), smask.to(dev), rewards, deltas


def check_cf_loss(dev, tiny: Path) -> dict:
    from transformers import AutoModelForCausalLM
    res = {}
    for d in ("cpu", str(dev)):
        model = _lora(AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32), r=4).to(d)
        ids, cmask, smask, rewards, deltas = _batch(model.config.vocab_size, **TINY_BATCH, dev=d)
        loss = cf_step_loss(model, ids, cmask, smask, rewards, deltas)
        grads = torch.cat([p.grad.detach().float().cpu().flatten() for n, p in sorted(model.named_parameters())
                           if "lora_" in n])
        res[d] = (loss, grads)
    (l0, g0), (l1, g1) = res["cpu"], res[str(dev)]
    cos = float(torch.nn.functional.cosine_similarity(g0, g1, dim=0))
    rel = float((g0 - g1).norm() / g0.norm())
    ok = math.isfinite(l1) and abs(l0 - l1) <= 1e-4 * max(1.0, abs(l0)) and rel < 1e-3 and float(g0.abs().max()) > 0
    return {"ok": ok, "loss_cpu": l0, "loss_device": l1, "grad_cosine": cos, "grad_rel_diff": rel}


def check_rollouts(dev, tiny: Path, n: int = 4) -> dict:
    from lemon.benchmarks import pool
    from lemon.eval.orchestrator import orchestrator_messages
    from lemon.prompts import default_prompts
    from lemon.spec.grammar import GrammarCache, SpecGrammar
    from lemon.spec.schema import parse_spec
    from lemon.policy.model import PolicyConfig, load_policy
    from lemon.policy.rollout import GrammarConstraint, sample_specs
    prompts = default_prompts()
    model, tok = load_policy(PolicyConfig(model=str(tiny), backend="transformers", lora_r=4, lora_alpha=8), seed=0)
    model = model.to(dev)
    qs = [orchestrator_messages(e.question, "math", prompts, 3) for e in pool("gsm8k", "train")[:2]]
    g = SpecGrammar.for_domain(prompts, "math", max_agents=3, role_chars=24, duty_chars=48)
    con = GrammarConstraint(g, GrammarCache())
    t = time.perf_counter()
    a = sample_specs(model, tok, qs, n=n, temperature=1.0, max_new_tokens=400, seed=3, constraint=con)
    secs = time.perf_counter() - t
    b = sample_specs(model, tok, qs, n=n, temperature=1.0, max_new_tokens=400, seed=3, constraint=con)
    parsed = 0
    for s in a:
        try:
            parse_spec(s.text, base_roles=g.base_roles, max_agents=3)
            parsed += 1
        except Exception:  # noqa: BLE001 (counted: a spec that does not parse fails the check)
            pass
    same = [x.text for x in a] == [x.text for x in b]
    return {"ok": parsed == len(a) and all(s.finished for s in a) and same, "specs": len(a), "parsed": parsed,
            "same_seed_same_specs": same, "tokens": sum(s.n_tokens for s in a), "seconds": round(secs, 2),
            "example": a[0].text[:400]}


def check_trainer(dev, tiny: Path, out: Path, quick: bool = False) -> dict:
    from lemon.prompts import default_prompts
    from lemon.testbed.experiment import ExperimentConfig, run_arm
    from lemon.testbed.world import tiny_world
    from lemon.policy.model import PolicyConfig
    from safetensors.torch import load_file
    prompts = default_prompts()
    world = tiny_world(prompts, n=64)
    over = {"num_generations": 2 if quick else 4, "batch_size": 4 if quick else 8, "learning_rate": 5e-3, "resample": 0,
            "save_steps": 1, "role_chars": 12 if quick else 24, "duty_chars": 16 if quick else 48,
            "policy": PolicyConfig(model=str(tiny), backend="transformers", lora_r=4, lora_alpha=8)}
    exp = ExperimentConfig(world="tiny", profile="smoke", arms=("cf",), seeds=(0,), max_steps=3, train_questions=8,
                           heldout_questions=2, eval_every=1, train_overrides=over)
    run = out / "trainer"
    t = time.perf_counter()
    first = run_arm("cf", 0, run, world, exp, prompts, progress=False)
    t_first = time.perf_counter() - t
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    losses = [m["loss"] for m in metrics if "loss" in m]
    if len(losses) != 3:
        raise RuntimeError(f"metrics.jsonl logged {len(losses)} losses for 3 steps")
    lora_b = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    moved = any(float(v.abs().max()) > 0 for k, v in lora_b.items() if "lora_B" in k)  # B starts at exactly 0
    # resume: forget step 3 as a run killed after checkpoint-2 would, then run again
    shutil.rmtree(run / "grpo" / "checkpoint-3")
    shutil.rmtree(run / "adapter")
    (run / "train.json").unlink()
    t = time.perf_counter()
    again = run_arm("cf", 0, run, world, exp, prompts, progress=False)
    t_resume = time.perf_counter() - t
    after = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    resumed = [m["loss"] for m in after if "loss" in m]
    # the resumed run keeps steps 1-2 (checkpointed) and redoes step 3 from checkpoint-2's optimizer and RNG state
    ok = (first["steps"] == 3 and again["steps"] == 3 and all(math.isfinite(x) for x in losses + resumed) and moved
          and len(resumed) == 3 and resumed[:2] == losses[:2])
    return {"ok": ok, "steps": first["steps"], "resumed_steps": again["steps"], "losses": losses,
            "resumed_step3_loss": resumed[-1] if resumed else None, "lora_moved": moved,
            "seconds_3_steps": round(t_first, 1), "seconds_resume_1_step": round(t_resume, 1),
            "step_s": [round(m.get("time/step_s", float("nan")), 2) for m in metrics if "loss" in m],
            "device_of_model": str(dev)}


def probe(dev, shape: dict, batch: dict, gc: bool) -> dict:
    """One CF step of a random-init policy of `shape` (bf16 on CUDA, fp32 on CPU) with LoRA r=16: the largest
    micro-batch that fits (OOM -> halve, gradient accumulation to the full batch). Seconds of the step and peak GiB."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    cfg = Qwen2Config(max_position_embeddings=4096, tie_word_embeddings=False, **{"vocab_size": 49152, **shape})
    t = time.perf_counter()
    prev = torch.get_default_dtype()
    try:  # built directly in its dtype on the device: a 7B fp32 detour would cost 30 GB and the init time twice
        torch.set_default_dtype(dtype)
        with torch.device(dev):
            torch.manual_seed(0)
            base = Qwen2ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    build_s = time.perf_counter() - t
    model = _lora(base, r=16)
    if gc:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    ids, cmask, smask, rewards, deltas = _batch(cfg.vocab_size, dev=dev, **batch)
    rec = {"gradient_checkpointing": gc, "params_b": round(sum(p.numel() for p in base.parameters()) / 1e9, 3),
           "lora_params_m": round(sum(p.numel() for p in model.parameters() if p.requires_grad) / 1e6, 2),
           "build_s": round(build_s, 1), "tried": []}
    micro = batch["batch"]
    while micro >= 1:
        opt.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        try:
            t = time.perf_counter()
            loss = cf_step_loss(model, ids, cmask, smask, rewards, deltas, micro=micro)
            opt.step()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            rec.update(micro_batch=micro, step_s=round(time.perf_counter() - t, 2), loss=loss, ok=math.isfinite(loss),
                       peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 1) if dev.type == "cuda" else None)
            rec["tried"].append(micro)
            break
        except torch.OutOfMemoryError:
            rec["tried"].append(f"{micro}:OOM")
            opt.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            micro //= 2
    else:
        rec["ok"] = False
    del model, base, opt
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="auto", help="auto (cuda when available), cpu or cuda")
    ap.add_argument("--tokenizer", type=Path, default=None, help="tokenizer folder (default: converted SmolLM2-135M)")
    ap.add_argument("--probe", default=None, choices=("paper", "tiny"),
                    help="probe shape (default: paper on cuda, else tiny)")
    ap.add_argument("--only", default=None, help="comma-separated subset of env,cf_loss,probe,rollouts,trainer")
    ap.add_argument("--quick", action="store_true",
                    help="smaller rollouts and trainer batch (the CPU test in the suite)")
    a = ap.parse_args(argv)
    dev = torch.device("cuda" if a.device == "auto" and torch.cuda.is_available() else
                       ("cpu" if a.device == "auto" else a.device))
    if a.tokenizer is None:
        from lemon.policy.model import converted_dir
        a.tokenizer = converted_dir("smollm2-135m")
    a.out.mkdir(parents=True, exist_ok=True)
    shape, batch = (PAPER_SHAPE, PAPER_BATCH) if (a.probe or ("paper" if dev.type == "cuda" else "tiny")) == "paper" \
        else (TINY_QWEN2, TINY_BATCH)
    tiny = random_policy(a.tokenizer, a.out / "tiny-policy")
    checks = {"env": lambda: {"ok": True, **env_report(dev)},
              "cf_loss": lambda: check_cf_loss(dev, tiny),
              "probe": lambda: {"ok": None, "shape": shape, **batch,
                                "runs": [probe(dev, shape, batch, gc) for gc in (False, True)]},
              "rollouts": lambda: check_rollouts(dev, tiny, n=2 if a.quick else 4),
              "trainer": lambda: check_trainer(dev, tiny, a.out, quick=a.quick)}
    only = a.only.split(",") if a.only else list(checks)
    report, t0 = {}, time.perf_counter()
    for name in only:
        t = time.perf_counter()
        try:
            r = checks[name]()
            if name == "probe":
                r["ok"] = all(x.get("ok") for x in r["runs"])
        except Exception as e:  # noqa: BLE001 (recorded and reported; the next check still runs)
            r = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        r["check_s"] = round(time.perf_counter() - t, 1)
        report[name] = r
        print(f"[gpu_check] {name:9s} {'PASS' if r['ok'] else 'FAIL'}  {r['check_s']:.0f} s  "
              f"{json.dumps({k: v for k, v in r.items() if k not in ('ok', 'traceback', 'example', 'check_s')})[:900]}",
              flush=True)
        if not r["ok"] and "traceback" in r:
            print(r["traceback"], file=sys.stderr, flush=True)
        (a.out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    failed = [n for n, r in report.items() if not r["ok"]]
    print(f"[gpu_check] {len(report) - len(failed)}/{len(report)} passed in {time.perf_counter() - t0:.0f} s on {dev}"
          + (f"; FAILED: {', '.join(failed)}" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
