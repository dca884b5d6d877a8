"""Memory plan of the paper profile on ONE GPU: three vLLM workers (scripts/vllm_workers.sh) beside the 7B LoRA policy.

Arithmetic from checkpoint sizes and model shapes, plus the one measured policy step
(outputs/reference/gpu-check-20261204: random-init Qwen2.5-7B shape, 7.656B params, bf16, LoRA r=16 = 40.37M params,
micro-batch 16 x (970 + 740) tokens, gradient checkpointing on, transformers backend: torch.cuda.max_memory_allocated
34.1 GiB). Check the workers' lines against vLLM's startup log ("model weights took X GiB", "KV cache ... tokens").
The plan is the first strategy that fits with `margin_gib` to spare, most preferred first:
  resident    bf16 policy at micro-batch 16 beside the three workers;
  4bit        the policy's base in 4-bit (Unsloth, bitsandbytes nf4) + LoRA;
  microbatch  bf16 policy at micro-batch 4 (x4 accumulation) on the transformers backend (Unsloth's CF loss takes one
              micro-batch per step: lemon.train.unsloth_compat); activations taken as linear in the micro-batch;
  sleep       workers asleep (vLLM sleep level 1: weights to CPU RAM, KV cache dropped) during the policy's update;
  4bit+sleep  both. The sleep plans need a trainer that sleeps and wakes the servers, which lemon's does not do
              yet: they are offered only with runnable_only=False (`plan-gpu --all-strategies`).
  python -m lemon plan-gpu [--gib N]     (no --gib: the card torch or nvidia-smi sees; --shell: the scripts' form)
"""
from __future__ import annotations

import argparse
import math
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from lemon.run.workers import load_worker_config

GIB = 2**30
CAPS = ("small", "medium", "large")
PAPER_WORKERS = Path(__file__).resolve().parents[2] / "configs" / "workers-paper.yaml"
MAX_MODEL_LEN = 8192
"""vllm_workers.sh's --max-model-len; vLLM starts only if its KV cache holds one such sequence."""
MAX_KV_TOKENS = 131072
"""KV tokens per server past which spare memory stays free (16 full-length or ~90 typical 1.5k-token sequences)."""
RUNTIME_GIB = 2.0
"""Per vLLM server inside its fraction besides weights and KV: profiling activations and CUDA graphs (estimate; it
stays on the card while a server sleeps)."""
CONTEXT_GIB = 0.75
"""Per process (3 servers + the policy), outside every fraction: the CUDA context (~0.5-1 GiB)."""
POLICY_PARAMS_B, POLICY_EMBED_B = 7.656, 1.090
"""The probe's parameters (billions) and its embedding + lm_head share (2 x 152064 x 3584), which 4-bit keeps bf16."""
LORA_STATE_GIB = 40.37e6 * 16 / GIB
"""LoRA r=16 on every projection: 40.37M fp32 params x (weight + grad + 2 Adam moments) = 16 bytes each."""
POLICY_PEAK_GIB = 34.1
"""Measured update peak at micro-batch 16 (module doc); its activations = this - bf16 weights - LoRA state."""
NF4_BYTES = 0.516
"""bitsandbytes nf4 with double-quantised absmax, bytes a weight (unsloth/Qwen2.5-7B-Instruct-bnb-4bit: 5.55 GB)."""
SAMPLING_GIB = 2.0
"""The policy's rollout sampling between updates: KV of 16 x 1710 tokens at 56 KiB a token (1.5 GiB) plus logits."""
MIN_DRIVER = {13: 580, 12: 525, 11: 450}
"""Oldest NVIDIA driver (major) for a CUDA major version (NVIDIA's CUDA release notes, minor-version compatibility)."""


@dataclass(frozen=True)
class Checkpoint:
    """What vLLM loads for one worker: weight bytes and the shape that sizes its bf16 KV cache."""

    weights_gb: float
    """Checkpoint size in GB (10^9 bytes): its safetensors files on the Hugging Face hub."""
    layers: int
    """Transformer layers (config.json num_hidden_layers)."""
    kv_heads: int
    """Key/value heads (config.json num_key_value_heads); head_dim is 128 for every Qwen2.5 size."""

    def __post_init__(self):
        if self.weights_gb <= 0 or self.layers < 1 or self.kv_heads < 1:
            raise ValueError(f"a checkpoint needs positive weights_gb, layers and kv_heads, got {self}")

    @property
    def weights_gib(self) -> float:
        return self.weights_gb * 1e9 / GIB

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * 128 * 2  # K and V, bf16


CHECKPOINTS = {  # sizes: the hub's safetensors totals; shapes: each config.json
    "Qwen/Qwen2.5-7B-Instruct": Checkpoint(15.23, 28, 4),  # bf16, 7.62B params
    "Qwen/Qwen2.5-14B-Instruct-AWQ": Checkpoint(9.98, 48, 8),  # AWQ 4-bit, 14.7B params
    "Qwen/Qwen2.5-32B-Instruct-AWQ": Checkpoint(19.3, 64, 8),  # AWQ 4-bit, 32.8B params
    "Qwen/Qwen2.5-14B-Instruct": Checkpoint(29.5, 48, 8),  # bf16
    "Qwen/Qwen2.5-32B-Instruct": Checkpoint(65.5, 64, 8),  # bf16
}
ONE_GPU_FORM = {"Qwen/Qwen2.5-14B-Instruct": "Qwen/Qwen2.5-14B-Instruct-AWQ",
                "Qwen/Qwen2.5-32B-Instruct": "Qwen/Qwen2.5-32B-Instruct-AWQ"}
"""Served name (the workers YAML's model) -> the checkpoint loaded under it on one GPU (vllm_workers.sh's default)."""


@dataclass(frozen=True)
class Strategy:
    """One way to share the card between the policy and the workers."""

    name: str
    """Short name (printed, and STRATEGY= in --shell output)."""
    about: str
    """One line on what it changes."""
    four_bit: bool = False
    """The policy's base weights in 4-bit (Unsloth) instead of bf16."""
    micro_batch: int = 16
    """Rows per forward/backward pass of the policy's update (the paper preset's batch is 16)."""
    sleep: bool = False
    """Workers sleep (vLLM level 1) during the policy's update."""
    sets: tuple[str, ...] = ()
    """--set overrides of scripts/main.sh that apply it."""
    runnable: bool = True
    """lemon does everything it needs today."""
    caveat: str = ""
    """What its arithmetic assumes beyond the measurement."""


STRATEGIES = (
    Strategy("resident", "everything resident: bf16 policy at micro-batch 16 beside the three workers"),
    Strategy("4bit", "the policy's base in 4-bit (Unsloth nf4) + LoRA, beside the three workers", four_bit=True,
             sets=("train.policy.backend=unsloth", "train.policy.load_in_4bit=true"),
             caveat="nf4 weights from the checkpoint size; activations as measured in bf16"),
    Strategy("microbatch", "bf16 policy at micro-batch 4 (x4 accumulation) on the transformers backend; SFT batch 2",
             micro_batch=4, sets=("train.policy.backend=transformers", "train.micro_batch=4", "sft.batch_size=2"),
             caveat="activations scaled linearly from micro-batch 16, the only one measured"),
    Strategy("sleep", "workers asleep (vLLM sleep level 1) during the policy's update", sleep=True, runnable=False),
    Strategy("4bit+sleep", "4-bit policy base, workers asleep during its update", four_bit=True, sleep=True,
             runnable=False),
)


class GPUPlanError(ValueError):
    """No plan fits the card (the message says how much is missing and what would fit), or there is no card."""


class CudaUnusableError(RuntimeError):
    """CUDA cannot run here: a CPU torch build, a driver too old for torch's CUDA, or a failing device."""


@dataclass(frozen=True)
class WorkerPlan:
    """One vLLM server of the plan."""

    capacity: str
    """small / medium / large."""
    served: str
    """--served-model-name (the workers YAML's model)."""
    checkpoint: str
    """What vLLM loads."""
    weights_gib: float
    """Checkpoint weights."""
    kv_gib: float
    """KV cache the fraction leaves after weights and RUNTIME_GIB."""
    kv_tokens: int
    """Tokens that KV cache holds."""
    util: float
    """--gpu-memory-utilization: a fraction of the WHOLE card."""


@dataclass(frozen=True)
class GPUPlan:
    """The chosen strategy for a card, with the arithmetic behind it."""

    card_gib: float
    """Card memory as torch reports it (what vLLM's fractions multiply; an 80 GB H100: 79.2, an H200: 139.8)."""
    strategy: Strategy
    """The first strategy (in STRATEGIES order) that fits."""
    workers: tuple[WorkerPlan, ...]
    """The three servers, small to large."""
    rows: tuple[tuple[str, float], ...]
    """(component, GiB) of the busiest phase, the last row its total."""
    margin_gib: float
    """Card minus that total."""
    needs: tuple[tuple[str, float], ...]
    """(strategy, GiB it needs including the margin) for every strategy considered."""

    def __post_init__(self):
        if self.margin_gib < 0 or len(self.workers) != 3:
            raise ValueError(f"a plan needs 3 workers and a non-negative margin, got {len(self.workers)} workers and "
                             f"margin {self.margin_gib}")

    def table(self) -> str:
        s, w = self.strategy, 74
        lines = [f"GPU plan for a {self.card_gib:.1f} GiB card: strategy '{s.name}': {s.about}",
                 f"{'component':<{w}}   GiB"]
        lines += [f"{name:<{w}} {gib:5.1f}" for name, gib in self.rows + (("margin left", self.margin_gib),)]
        lines += [f"vLLM {x.capacity:<6} --gpu-memory-utilization {x.util:.2f}  {x.checkpoint} "
                  f"(KV {x.kv_tokens} tokens)" for x in self.workers]
        lines.append("strategies (GiB needed with the margin): " + ", ".join(f"{n} {g:.1f}" for n, g in self.needs))
        lines.append(f"assumes: CUDA context {CONTEXT_GIB} GiB/process, vLLM runtime {RUNTIME_GIB:g} GiB/server"
                     + (f"; {s.caveat}" if s.caveat else "") + "; the SFT warm start is not planned (unmeasured)")
        if s.sets:
            lines.append("train with: " + " ".join(f"--set {x}" for x in s.sets)
                         + " (scripts/main.sh --profile paper adds them; `lemon train` needs them too)")
        if s.sleep:
            lines.append("needs: servers with --enable-sleep-mode (VLLM_SERVER_DEV_MODE=1) and a trainer that sleeps "
                         "them around each update and empties its CUDA cache (lemon's does not yet)")
        return "\n".join(lines)

    def shell(self) -> str:
        """bash assignments for scripts/vllm_workers.sh and scripts/main.sh (eval'd there)."""
        def arr(xs):
            return "(" + " ".join(shlex.quote(str(x)) for x in xs) + ")"
        return "\n".join([f"STRATEGY={shlex.quote(self.strategy.name)}", f"NAMES={arr(w.served for w in self.workers)}",
                          f"MODELS={arr(w.checkpoint for w in self.workers)}",
                          f"UTIL={arr(f'{w.util:.2f}' for w in self.workers)}", f"SETS={arr(self.strategy.sets)}"])


def paper_served(path: str | Path = PAPER_WORKERS) -> tuple[str, str, str]:
    """The served model names of small, medium and large in a workers YAML (configs/workers-paper.yaml)."""
    cfg = load_worker_config(path)
    missing = [c for c in CAPS if not isinstance(cfg.get(c), dict) or "model" not in cfg[c]]
    if missing:
        raise GPUPlanError(f"{path}: no model for {missing}; the one-GPU plan needs small, medium and large")
    return tuple(str(cfg[c]["model"]) for c in CAPS)


def _policy(s: Strategy) -> tuple[float, float]:
    """(GiB during the update, GiB between updates) of the policy's process, CUDA context excluded."""
    bf16 = POLICY_PARAMS_B * 1e9 * 2 / GIB
    nf4 = (POLICY_EMBED_B * 2 + (POLICY_PARAMS_B - POLICY_EMBED_B) * NF4_BYTES) * 1e9 / GIB
    weights = (nf4 if s.four_bit else bf16) + LORA_STATE_GIB
    return weights + (POLICY_PEAK_GIB - bf16 - LORA_STATE_GIB) * s.micro_batch / 16, weights + SAMPLING_GIB


def _phases(s: Strategy, ckpts, kv_gib) -> list[list[tuple[str, float]]]:
    """Rows of each phase that must fit: one, or (rollouts, update) when the workers sleep during the update."""
    train, idle = _policy(s)
    awake = [(f"worker {cap} {n.split('/')[-1]}: weights {c.weights_gib:.1f} + runtime {RUNTIME_GIB:g} + KV {kv:.1f}",
              c.weights_gib + RUNTIME_GIB + kv)
             for cap, n, c, kv in zip(CAPS, ckpts, map(CHECKPOINTS.get, ckpts), kv_gib)]
    ctx = [("CUDA contexts (4 processes)", 4 * CONTEXT_GIB)]
    pol = f"policy {'4-bit' if s.four_bit else 'bf16'} 7B + LoRA"
    if not s.sleep:
        return [awake + [(f"{pol}, update at micro-batch {s.micro_batch} (peak)", max(train, idle))] + ctx]
    return [awake + [(f"{pol}, between updates (weights, LoRA, sampling)", idle)] + ctx,
            [("3 sleeping workers (runtime)", 3 * RUNTIME_GIB), (f"{pol}, update at micro-batch 16 (peak)", train)]
            + ctx]


def _total(rows) -> float:
    return sum(g for _, g in rows)


def plan_gpu(card_gib: float, *, checkpoints: tuple[str, ...] | None = None, workers: str | Path = PAPER_WORKERS,
             margin_gib: float = 4.0, runnable_only: bool = True) -> GPUPlan:
    """The first strategy that fits `card_gib` with `margin_gib` to spare; the spare goes to the workers' KV caches (the
    same tokens each, up to MAX_KV_TOKENS). `checkpoints`: what vLLM loads (default: the workers YAML's models in their
    one-GPU form). Raises GPUPlanError when none fits."""
    if not card_gib > 0 or margin_gib < 0:
        raise GPUPlanError(f"card_gib must be > 0 and margin_gib >= 0, got {card_gib}, {margin_gib}")
    served = paper_served(workers)
    ckpts = tuple(checkpoints or (ONE_GPU_FORM.get(n, n) for n in served))
    unknown = [c for c in ckpts if c not in CHECKPOINTS]
    if len(ckpts) != 3 or unknown:
        raise GPUPlanError(f"need 3 known checkpoints (small medium large), got {list(ckpts)}; unknown: {unknown}; "
                           f"known: {', '.join(CHECKPOINTS)} (add a size to lemon.run.gpuplan.CHECKPOINTS)")
    per_tok = [CHECKPOINTS[c].kv_bytes_per_token for c in ckpts]
    weights = [CHECKPOINTS[c].weights_gib for c in ckpts]
    kv_min = [MAX_MODEL_LEN * b / GIB for b in per_tok]
    needs, skipped = [], []
    for s in STRATEGIES:
        need = max(map(_total, _phases(s, ckpts, kv_min))) + margin_gib
        (skipped if runnable_only and not s.runnable else needs).append((s.name, need))
        if (runnable_only and not s.runnable) or need > card_gib:
            continue
        extra = min(MAX_KV_TOKENS - MAX_MODEL_LEN, int((card_gib - need) * GIB / sum(per_tok)))  # tokens per server
        least = [w + RUNTIME_GIB + k for w, k in zip(weights, kv_min)]
        util = [max(math.ceil(lo / card_gib * 100), math.floor((lo + extra * b / GIB) / card_gib * 100)) / 100
                for lo, b in zip(least, per_tok)]  # whole percents, never below the minimum KV
        kv = [u * card_gib - w - RUNTIME_GIB for u, w in zip(util, weights)]
        busiest = max(_phases(s, ckpts, kv), key=_total)
        ws = tuple(WorkerPlan(*row, int(k * GIB / b), u) for row, k, b, u
                   in zip(zip(CAPS, served, ckpts, weights, kv), kv, per_tok, util))
        return GPUPlan(card_gib, s, ws, tuple(busiest) + (("total (busiest phase)", _total(busiest)),),
                       card_gib - _total(busiest), tuple(needs))
    name, least = min(needs, key=lambda t: t[1])
    alone = _policy(STRATEGIES[0])[0] + CONTEXT_GIB + margin_gib
    later = "".join(f"; '{n}' would need {g:.1f} GiB but lemon's trainer cannot sleep the workers yet"
                    for n, g in skipped)
    raise GPUPlanError(
        f"a {card_gib:.1f} GiB GPU holds no plan of the paper profile (3 vLLM workers + the 7B policy): the smallest, "
        f"'{name}', needs {least:.1f} GiB with the {margin_gib:g} GiB margin, {least - card_gib:.1f} GiB more than "
        f"this card{later}. What would fit: a card of >= {least:.1f} GiB (an 80 GB H100 reports 79.2 GiB; everything "
        f"resident needs {needs[0][1]:.0f}), or only the policy on this card ({alone:.1f} GiB) with the workers served "
        f"from other GPUs or machines (their base_url in {Path(workers).name}; scripts/vllm_workers.sh is for one GPU)")


def _smi(query: str, error):
    """The first line of `nvidia-smi --query-gpu=QUERY`, or `error` raised with why there is none."""
    try:
        return subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=30, check=True).stdout.splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError) as e:
        raise error(f"nvidia-smi gave no {query} ({type(e).__name__}: {e})") from None


def query_card_gib() -> tuple[float, str]:
    """(GiB, description) of the first visible GPU: torch's figure when CUDA works here, else nvidia-smi's."""
    try:
        import torch
        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info(0)
            return total / GIB, f"{torch.cuda.get_device_name(0)} (torch; {free / GIB:.1f} GiB free now)"
    except ImportError:
        pass
    try:
        name, mib = _smi("name,memory.total", GPUPlanError).rsplit(",", 1)
        return float(mib) / 1024, f"{name.strip()} (nvidia-smi)"
    except (GPUPlanError, ValueError) as e:
        raise GPUPlanError(f"no GPU to plan for: torch sees no CUDA device and {e}; pass --gib N to plan for a card of "
                           "N GiB") from None


def check_cuda(driver: str | None = None) -> str:
    """Raise CudaUnusableError unless torch is a CUDA build, the driver is new enough for it and a matmul runs on the
    GPU. `driver`: nvidia-smi's driver_version (queried when None). Returns a one-line summary for setup-gpu.sh."""
    import torch
    cuda = torch.version.cuda
    if not cuda:
        raise CudaUnusableError(f"torch {torch.__version__} is a CPU build (torch.version.cuda is None): the GPU "
                                "environment needs the CUDA wheel of requirements-gpu.txt")
    driver = (driver if driver is not None else _smi("driver_version", CudaUnusableError)).strip()
    m, need = re.match(r"(\d+)", driver), MIN_DRIVER.get(int(cuda.split(".")[0]), 0)
    if not m or int(m.group(1)) < need:
        raise CudaUnusableError(f"NVIDIA driver {driver!r} is too old for torch {torch.__version__} (CUDA {cuda} needs "
                                f"driver >= {need}): upgrade the driver")
    if not torch.cuda.is_available():
        raise CudaUnusableError(f"torch.cuda.is_available() is False (driver {driver}, torch CUDA {cuda}): check "
                                "CUDA_VISIBLE_DEVICES and that the driver is loaded (nvidia-smi)")
    x = torch.full((64, 64), 1.0, device="cuda")
    if (x @ x).sum().item() != 64**3:
        raise CudaUnusableError("a 64x64 matmul on the GPU gave a wrong result")
    return f"CUDA ok: {torch.cuda.get_device_name(0)}, driver {driver}, torch {torch.__version__} (CUDA {cuda})"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gib", type=float, help="card memory in GiB as torch reports it (default: this machine's GPU)")
    p.add_argument("--margin", type=float, default=4.0, help="GiB left free (default 4)")
    p.add_argument("--workers", default=str(PAPER_WORKERS), help="workers YAML whose models are served")
    p.add_argument("--checkpoints", nargs=3, metavar="CKPT", help="what vLLM loads for small medium large")
    p.add_argument("--all-strategies", action="store_true", help="also the sleep plans lemon's trainer cannot run yet")
    p.add_argument("--shell", action="store_true", help="table to stderr, bash assignments to stdout")


def cmd_plan(args) -> int:
    gib, where = (args.gib, "as given by --gib") if args.gib is not None else query_card_gib()
    plan = plan_gpu(gib, checkpoints=tuple(args.checkpoints) if args.checkpoints else None, workers=args.workers,
                    margin_gib=args.margin, runnable_only=not args.all_strategies)
    print(f"card: {gib:.1f} GiB, {where}\n{plan.table()}", file=sys.stderr if args.shell else sys.stdout)
    if args.shell:
        print(plan.shell())
    return 0


def main(argv=None) -> int:
    """`python -m lemon.run.gpuplan [plan-gpu args]` or `--check-cuda`: the scripts' entry (lighter than lemon.cli)."""
    p = argparse.ArgumentParser(prog="python -m lemon.run.gpuplan", description=__doc__.splitlines()[0])
    add_arguments(p)
    p.add_argument("--check-cuda", action="store_true", help="check that CUDA works here (scripts/setup-gpu.sh)")
    args = p.parse_args(argv)
    try:
        print(check_cuda()) if args.check_cuda else cmd_plan(args)
        return 0
    except (GPUPlanError, CudaUnusableError) as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
