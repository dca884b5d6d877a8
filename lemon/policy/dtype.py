"""Which float format the policy samples in on CPU, detected rather than assumed.

bf16 matmuls are fast only where the CPU has native bf16 dot products (AVX512_BF16 or AMX) and oneDNN (mkldnn) uses
them; elsewhere torch emulates bf16 and it is slower than fp32.

On an AVX512_BF16 CPU (LOG.md, 2026-12-01; bench/grammar_bench.py --dtype: Qwen2.5-Coder-0.5B, batch 8 = 1 prompt x 8,
32 new tokens, 2 torch threads, other jobs running, so noisy): fp32 weights 17.8 tok/s end to end, bf16 weights 28.7,
fp32 + torch.autocast(bf16) 5.5 (autocast re-casts every weight at every decoding step, which dominates a memory-bound
decode; it pays off for training's long forward+backward instead). So sampling never autocasts by default, and on
a native-bf16 CPU ('auto' -> 'bf16_merged') it runs on a bf16 copy of the policy with the LoRA adapters merged in
(merged_copy, made afresh per rollout; 1.6x the fp32 decode, see there); the trainer's fp32 model is never converted.
'bf16_copy' (SamplingCopy: unmerged adapters, only LoRA weights re-copied) stays as an option. Elsewhere: the fp32
model. The trainer recomputes old log-probs with its own (fp32) model, so bf16 sampling only shifts which tokens are
drawn.
"""
from __future__ import annotations

import contextlib
import copy
from pathlib import Path

# how generate() computes: the model's own dtype; bf16 autocast; a bf16 SamplingCopy of the policy; a bf16 merged_copy
# (both made by lemon.train.episodes); 'auto' resolves (resolve_sample_dtype) to bf16_merged on a native-bf16 CPU, else
# 'model'
SAMPLING_DTYPES = ("model", "autocast_bf16", "bf16_copy", "bf16_merged")


def resolve_sample_dtype(choice: str, device="cpu") -> str:
    """'auto' -> 'bf16_merged' on a CPU with native bf16 (measured 1.6x faster decoding, module docstring), else 'model'
    (CUDA policies are loaded in bf16 already); any other choice is returned as given."""
    if choice != "auto":
        return choice
    return "bf16_merged" if str(device).startswith("cpu") and cpu_bf16_native() else "model"


def merged_copy(model, dtype=None):
    """A plain (no peft) copy of a peft `model` with its LoRA adapters merged into the weights, in `dtype` (default
    sampling_weights_dtype), in eval mode: what 'bf16_merged' samples. Made afresh for each rollout (the adapters change
    every step): ~3.6 s for the 0.5B here, against ~20% of every decoding step that unmerged LoRA layers cost
    (LOG.md, 2026-12-01: 0.5B, batch 8, 100 tokens, 2 threads: fp32 + LoRA 533 ms/step, bf16 + LoRA (SamplingCopy)
    398, bf16 merged 326). A model without adapters is copied as it is."""
    dtype = dtype or sampling_weights_dtype(model.device)
    m = copy.deepcopy(model)
    if hasattr(m, "merge_and_unload"):
        m = m.merge_and_unload()
    m = m.to(dtype).eval()
    for p in m.parameters():
        p.requires_grad_(False)
    return m


def cpu_bf16_flags(cpuinfo: str | None = None) -> set[str]:
    """The native-bf16 CPU flags present (avx512_bf16, amx_bf16) per /proc/cpuinfo; empty where it is unreadable."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[1].split())
    return flags & {"avx512_bf16", "amx_bf16"}


def cpu_bf16_native(cpuinfo: str | None = None) -> bool:
    """True when bf16 on CPU is native: oneDNN is available and reports bf16 support, and the CPU has a bf16 flag.
    (The flag alone is not enough: a VM may report AMX it does not enable; oneDNN probes what actually runs.)"""
    import torch
    try:
        mkldnn_bf16 = torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        mkldnn_bf16 = False
    return mkldnn_bf16 and bool(cpu_bf16_flags(cpuinfo))


def sampling_weights_dtype(device="cpu"):
    """torch.bfloat16 where sampling in bf16 is faster (a CPU with native bf16; CUDA), else torch.float32."""
    import torch
    return torch.bfloat16 if not str(device).startswith("cpu") or cpu_bf16_native() else torch.float32


def sampling_context(dtype: str, device):
    """The context generate() runs in: bf16 autocast for 'autocast_bf16', nothing for 'model'."""
    import torch
    # bf16_copy / bf16_merged: the caller makes the copy, sampled as 'model'
    if dtype not in ("model", "autocast_bf16"):
        raise ValueError(f"dtype={dtype!r}; valid: {', '.join(SAMPLING_DTYPES)}")
    if dtype == "autocast_bf16":
        return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


class SamplingCopy:
    """A frozen copy of the policy in `dtype` for generate(), kept in step with the trained model by copying only its
    trainable parameters (the LoRA adapters; the base is frozen, so it was copied once). ~1 GB for the 0.5B in bf16.

        shadow = SamplingCopy(policy)                       # once
        samples = sample_specs(shadow.sync(policy), ...)    # every rollout
    """

    def __init__(self, model, dtype=None):
        import torch
        self.dtype = dtype or sampling_weights_dtype(model.device)
        self.names = tuple(n for n, p in model.named_parameters() if p.requires_grad)
        self.model = copy.deepcopy(model).to(self.dtype).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self._torch = torch

    def sync(self, model):
        """Copy `model`'s trainable parameters in (cast to self.dtype) and return the copy, ready to sample."""
        src = dict(model.named_parameters())
        now = tuple(n for n, p in src.items() if p.requires_grad)
        if now != self.names:
            raise ValueError("the model's trainable parameters changed since this SamplingCopy was made "
                             "(another adapter or unfrozen weights): make a new SamplingCopy")
        dst = dict(self.model.named_parameters())
        with self._torch.no_grad():
            for n in self.names:
                dst[n].copy_(src[n])
        return self.model
