"""Counterfactual GRPO (paper §3.3) on TRL's GRPOTrainer: rollouts are specs sampled by the policy (grammar-constrained
by default), executed by the worker pool, and — when cf_lambda > 0 — edited once each, re-executed through the node
cache, with the reward contrast put on the edited span's tokens only.

One step, in the order it runs:
1. TRL hands `SpecRollouts` (its `rollout_func`) the step's prompts: Q questions, each repeated G times in a row.
2. `SpecRollouts` samples G specs per question (lemon.policy.rollout.sample_specs), scores them (lemon.train.scoring:
   parse, execute, reward), and resamples up to `resample` times every group whose rewards have no spread (DAPO-style
   dynamic sampling: such a group has no global GRPO gradient). Then it adds one counterfactual per valid rollout and
   writes every rollout to rollouts.jsonl.
3. TRL calls our reward functions (they read the scored records by `rollout_index`; an errored execution returns None,
   which TRL treats as unscorable), then `_generate_and_score_completions` below REPLACES TRL's advantages with ours
   (lemon.train.cf.rollout_advantages: one scale for the global and the counterfactual term, forced tokens zeroed;
   errored rollouts masked out of the loss) and TRL's loss does the rest.
The counterfactual term lives in (B, T) advantages rather than in a loss override. TRL's loss takes them as they are;
Unsloth's loss (it replaces compute_loss on CUDA) scores its own token window, so lemon.train.unsloth_compat re-lays
them out for it and refuses the one split (micro-batches under cf_lambda > 0) where that window cannot be known in
advance.
cf_lambda = 0 gives plain GRPO with the same sampling, scoring and scaling.

The trainer class is BUILT (trainer_class) rather than defined at import: Unsloth swaps trl.GRPOTrainer for its patched
class when unsloth is imported, so on CUDA we must import unsloth first and subclass what trl exports then.
"""
from __future__ import annotations

import contextlib
import json
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch
from transformers import TrainerCallback

from lemon.train.cf import forced_mask, rollout_advantages  # noqa: F401  (forced_mask: old import path)
from lemon.train.edits import FAMILIES
from lemon.train.episodes import CurriculumSampler, SpecRollouts
from lemon.train.unsloth_compat import is_unsloth_trainer, unsloth_advantages

CF_STATE = "cf_state.json"
MIN_TRL = (0, 26)  # TRL <= 0.25 unsqueezes advantages unconditionally: (B, T) would broadcast silently to (B, B, T)


def check_trl(version: str | None = None) -> None:
    """Refuse a TRL whose loss would silently mis-broadcast (B, T) advantages."""
    import trl
    v = version or trl.__version__
    parts = tuple(int(x) for x in v.split(".")[:2] if x.isdigit())
    if parts < MIN_TRL:
        raise ImportError(f"trl {v} is too old for CF-GRPO: versions before {'.'.join(map(str, MIN_TRL))} unsqueeze "
                          "(B, T) advantages into (B, B, T) without an error; "
                          "install the pinned trl (requirements.txt)")


CPU_MIN_TRL = (1, 16)  # trl 1.15 computes GRPO log-probs through its Triton fused LM head whatever the device (below)


def check_trl_cpu(version: str | None = None) -> None:
    """Refuse CPU training on a trl whose GRPO loss needs Triton on CUDA. trl 1.15's _get_per_token_logps_and_entropies
    always calls the fused LM head (trl/trainer/utils.py _ChunkedLogProbFunction): on a CPU-only torch that is None
    ("'NoneType' object has no attribute 'apply'"), on a CUDA host training on the CPU Triton refuses the CPU tensors.
    Seen 2026-12-04 (outputs/reference/gpu-check-20261204): the GPU environment (requirements-gpu.txt: trl 1.15, the
    newest Unsloth allows) trains fine on CUDA; CPU training needs requirements.txt's trl 1.16."""
    import trl
    v = version or trl.__version__
    parts = tuple(int(x) for x in v.split(".")[:2] if x.isdigit())
    if parts < CPU_MIN_TRL:
        raise ImportError(f"trl {v} cannot run the GRPO loss on a CPU (its fused LM head needs Triton on CUDA); "
                          f"CPU training needs trl >= {'.'.join(map(str, CPU_MIN_TRL))} "
                          "(requirements.txt, scripts/setup.sh)")


@contextlib.contextmanager
def completion_only_lm_head():
    """Score only the completion tokens in trl's chunked LM head on a CPU, as it already does on CUDA.

    trl 1.16 (trl/trainer/utils.py, add_fused_lm_head's `_fused_forward`) scores just the labelled positions where
    Triton runs (`compact = _use_triton(device)`) and EVERY position elsewhere, because a changing number of positions
    would recompile the tiles on Neuron. On a CPU that means the 49k-vocabulary log-softmax, forward and backward, over
    the whole orchestrator prompt (~85% of each sequence), whose labels are -100 and whose results are thrown away.
    Measured on the testbed's 2-layer policy (2-core AVX2): 6.9 s of a 14 s step in the head's backward (LOG.md
    2026-12-05). Per-position log-probs do not depend on which other positions are scored, so the compact path gives the
    same loss and gradients (tests/test_cf_trainer.py checks both against the full path). Only the name `_use_triton`
    inside trl.trainer.utils is swapped (the kernels keep their own), for the duration of the block; a trl without it is
    left alone."""
    try:
        import trl.trainer.utils as U
    except ImportError:
        yield False
        return
    real = getattr(U, "_use_triton", None)
    if real is None:
        yield False
        return
    U._use_triton = lambda device: True if torch.device(device).type == "cpu" else real(device)
    try:
        yield True
    finally:
        U._use_triton = real


class CFGRPOMixin:
    """Overrides of TRL's GRPOTrainer (mixed into whichever GRPOTrainer class trl exports: TRL's own or Unsloth's)."""

    def __init__(self, *args, rollouts: SpecRollouts, **kw):
        super().__init__(*args, rollout_func=rollouts, **kw)
        self.rollouts = rollouts

    def _get_train_sampler(self, dataset=None):
        if self.rollouts.curriculum_ids is None:
            return super()._get_train_sampler(dataset)
        return CurriculumSampler(self.rollouts.curriculum_ids, self.rollouts.labels,
                                 questions=self.args.generation_batch_size // self.num_generations,
                                 generations=self.num_generations,
                                 repeat=self.num_iterations * self.args.steps_per_generation, seed=self.args.seed,
                                 strata=self.rollouts.strata, weighted=self.rollouts.weighted)

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        recs = self.rollouts.batch
        cmask = out["completion_mask"]  # (B, T)
        if len(recs) != cmask.shape[0]:
            raise RuntimeError(f"rollouts hold {len(recs)} records for a batch of {cmask.shape[0]}; CF-GRPO supports "
                               "one process (no multi-GPU data parallelism)")
        adv, keep, scale = rollout_advantages(recs, cmask, lam=self.rollouts.cf_lambda,
                                              scale=self.rollouts.scale_rewards,
                                              std_floor=self.rollouts.std_floor,
                                              mask_forced=getattr(self.rollouts, "mask_forced", False),
                                              cf_baseline=getattr(self.rollouts, "cf_baseline", "none"))  # (B, T)
        out["advantages"] = adv.to(out["advantages"].dtype)  # (B, T)
        out["completion_mask"] = cmask * keep[:, None].to(cmask.dtype)  # errored rollouts leave the loss entirely
        out["num_items_in_batch"] = out["completion_mask"].sum()
        # Unsloth's loss scores its own token window and rebuilds the mask (unsloth_compat's doc)
        if is_unsloth_trainer(self):
            out["advantages"] = unsloth_advantages(out, cmask, pad_id=self.processing_class.pad_token_id,
                                                   cf_lambda=self.rollouts.cf_lambda,
                                                   steps_per_generation=self.args.steps_per_generation)
        self._log_rollouts(recs, scale)
        return out

    def _log_rollouts(self, recs, scale: float):
        m = self._metrics["train"]
        valid = [r for r in recs if r.valid and not r.errored]
        n = max(1, len(recs))
        m["spec/valid_rate"].append(sum(r.valid for r in recs) / n)
        m["spec/agents"].append(sum(r.agents for r in valid) / max(1, len(valid)))
        m["spec/edges"].append(sum(r.edges for r in valid) / max(1, len(valid)))
        m["spec/distinct"].append(len({r.text for r in recs}) / n)
        m["rollouts/success"].append(sum(r.reward.success for r in valid) / max(1, len(valid)))
        m["rollouts/errored"].append(sum(r.errored for r in recs))
        m["tokens/worker_nominal"].append(sum(r.reward.worker_tokens for r in valid) / max(1, len(valid)))
        m["tokens/worker_spent"].append(sum(r.tokens_spent for r in recs))
        m["tokens/cf_spent"].append(sum(r.cf_tokens_spent for r in recs))
        m["tokens/cf_nominal"].append(sum(r.cf_tokens_nominal for r in recs))
        m["adv/scale"].append(scale)
        st = self.rollouts.last_stats
        for k in ("groups", "zero_spread_groups", "resampled_groups", "resample_attempts", "sample_s", "score_s",
                  "cf_s"):
            m[f"step/{k}"].append(st.get(k, 0))
        status = Counter(r.cf_status for r in recs)
        m["cf/edits"].append(sum(1 for r in recs if r.family))
        m["cf/active"].append(sum(1 for r in recs if r.cf_status == "ok" and r.delta) * (self.rollouts.cf_lambda > 0))
        # a delta of 1e-4 (a token-efficiency wobble) is "active" above; this counts the contrasts that move a success
        m["cf/active_001"].append(sum(1 for r in recs if r.cf_status == "ok" and r.delta and abs(r.delta) >= 0.01)
                                  * (self.rollouts.cf_lambda > 0))
        m["cf/edit_errors"].append(status.get("edit_error", 0))
        m["cf/errored"].append(status.get("cf_errored", 0))
        m["cf/dropped"].append(sum(k for s, k in status.items() if s.startswith("span_dropped")))
        m["cf/no_site"].append(status.get("no_site", 0))
        for code, k in Counter(r.error for r in recs if not r.valid).items():  # why rollouts were invalid
            m[f"spec/invalid_{code}"].append(k / n)
        per = defaultdict(list)
        for r in recs:
            if r.cf_status == "ok":
                per[r.family].append(r.delta)
        probs = self.rollouts.scorer.sampler.probs()
        for f in FAMILIES:
            m[f"cf/prob_{f}"].append(probs[f])
            if per[f]:
                m[f"cf/delta_{f}"].append(sum(per[f]) / len(per[f]))
                m[f"cf/absdelta_{f}"].append(sum(abs(d) for d in per[f]) / len(per[f]))
        stats = self.rollouts.scorer.cache.stats()  # cumulative counters -> this step's hits and misses
        prev = getattr(self, "_cache_prev", {"hits": 0, "misses": 0})
        hits, misses = stats["hits"] - prev["hits"], stats["misses"] - prev["misses"]
        m["cache/hits"].append(hits)
        m["cache/misses"].append(misses)
        m["cache/hit_rate"].append(hits / (hits + misses) if hits + misses else 0.0)
        m["cache/entries"].append(stats["entries"])
        self._cache_prev = stats


def trainer_class(backend: str = "transformers") -> type:
    """The CF-GRPO trainer class for a policy backend. 'unsloth': import unsloth FIRST (it patches trl), then subclass
    the GRPOTrainer trl exports afterwards — exactly what `lemon train` builds on CUDA and what tests/test_gpu.py
    tests."""
    if backend == "unsloth":
        import unsloth  # noqa: F401  (side effect: trl.GRPOTrainer becomes Unsloth's patched class)
    import trl
    check_trl()
    base = trl.GRPOTrainer
    if backend == "unsloth" and "unsloth" not in (base.__module__ + base.__name__).lower():
        raise RuntimeError(f"unsloth is imported but trl.GRPOTrainer is {base.__module__}.{base.__name__}, not "
                           "Unsloth's patched class: this unsloth/trl pair does not patch GRPO "
                           "(see requirements-gpu.txt pins)")
    return type("CFGRPOTrainer", (CFGRPOMixin, base), {"__doc__": CFGRPOMixin.__doc__})


def config_class(backend: str = "transformers") -> type:
    """trl.GRPOConfig as the trainer of `backend` expects it. Unsloth replaces trl.GRPOConfig with its own subclass
    (extra fields its patched trainer reads) when it is imported, so for 'unsloth' it must be imported first: a `from
    trl import GRPOConfig` earlier in a fresh process (notebook 03, a resumed run, --no-sft) handed the patched trainer
    a plain config (issue 29, finding 4)."""
    if backend == "unsloth":
        import unsloth  # noqa: F401
    import trl
    return trl.GRPOConfig


def reward_functions(rollouts: SpecRollouts):
    """The four reward functions TRL logs (their names become TRL's log keys) and their weights. Each reads the scored
    record by the `rollout_index` column our rollout_func returns; None (unscorable) for errored executions."""
    c = rollouts.scorer.reward_cfg

    def get(rollout_index, attr):
        recs = [rollouts.batch[i] for i in rollout_index]
        return [None if r.errored else attr(r) for r in recs]

    # the gated form scales costs by success
    gate = (lambda r: r.reward.success) if c.form == "gated" else (lambda r: 1.0)

    def success(completions, rollout_index, **kw):
        return get(rollout_index, lambda r: r.reward.success if r.valid else 0.0)

    def token_efficiency(completions, rollout_index, **kw):
        return get(rollout_index, lambda r: r.reward.token_efficiency * gate(r) if r.valid else 0.0)

    def graph_cost(completions, rollout_index, **kw):
        return get(rollout_index, lambda r: r.reward.graph_cost * gate(r) if r.valid else 0.0)

    def invalid(completions, rollout_index, **kw):
        return get(rollout_index, lambda r: 0.0 if r.valid else r.total)

    return [success, token_efficiency, graph_cost, invalid], [c.w_success, c.w_tokens, -c.w_graph, 1.0]


class CFStateCallback(TrainerCallback):
    """Saves the family sampler (and the curriculum's labels) with every checkpoint; the step clock and JSONL metrics
    too."""

    def __init__(self, rollouts: SpecRollouts, metrics_path: Path, verbose: bool = False):
        self.rollouts, self.metrics_path, self._t, self.verbose = rollouts, Path(metrics_path), None, verbose

    def on_step_begin(self, args, state, control, **kw):
        self._t = time.perf_counter()

    def on_log(self, args, state, control, logs=None, **kw):
        if logs is None:
            return
        if self._t is not None:
            logs["time/step_s"] = time.perf_counter() - self._t
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps({"step": state.global_step, **logs}) + "\n")
        if self.verbose and "reward" in logs:  # one line per step: the headless console's progress (lemon.progress)
            g = lambda k: logs.get(k, float("nan"))  # noqa: E731
            print(f"[cf-grpo] step {state.global_step}/{state.max_steps}  reward {g('reward'):+.3f}  "
                  f"success {g('rollouts/success'):.2f}  valid {g('spec/valid_rate'):.2f}  zero-spread "
                  f"{g('step/zero_spread_groups'):.0f}/{g('step/groups'):.0f}  cf active {g('cf/active'):.0f}  "
                  f"worker tok {g('tokens/worker_spent'):.0f} (+cf {g('tokens/cf_spent'):.0f})  "
                  f"{g('time/step_s'):.0f} s",
                  file=sys.stderr, flush=True)

    def on_save(self, args, state, control, **kw):
        d = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        d.mkdir(parents=True, exist_ok=True)
        (d / CF_STATE).write_text(json.dumps(self.rollouts.state_dict()))


def load_cf_state(rollouts: SpecRollouts, checkpoint: Path) -> bool:
    p = Path(checkpoint) / CF_STATE
    if not p.exists():
        return False
    rollouts.load_state_dict(json.loads(p.read_text()))
    return True

