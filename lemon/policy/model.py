"""The orchestrator policy model: transformers + peft LoRA on CPU (from the shipped GGUF), Unsloth on CUDA.

transformers reads the shipped GGUF files (qwen2 / llama) and dequantizes them, but that takes tens of seconds and the
result refuses `save_pretrained` while its GGUF quantizer is attached. So the first load converts once to a plain fp32
transformers folder in the cache (quantizer and quantization_config cleared) and later loads read that folder (~1-3 s).
Base weights stay fp32 on CPU and load in bf16 on CUDA (PolicyConfig.dtype); the trainer runs the loss under bf16
autocast where the CPU supports it and sampling picks its dtype by measurement (lemon.policy.dtype,
lemon.policy.rollout).

On CUDA with Unsloth, an SFT adapter is loaded INTO the Unsloth peft model (load_adapter_weights): Unsloth builds its
own LoRA modules, so a warm start must be copied into them and checked key by key, never dropped silently.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from lemon.run.models import SHIPPED, cache_dir, get_model


@dataclass(frozen=True)
class PolicyConfig:
    """Which model the orchestrator policy is and how LoRA is attached."""

    model: str = "qwen2.5-coder-0.5b"
    """A shipped model name (lemon.run.models.SHIPPED) or a HF hub id / local folder (paper profile:
    Qwen/Qwen2.5-7B-Instruct)."""
    backend: str = "auto"
    """'auto' (Unsloth on CUDA, where it must be installed; transformers on a CPU), 'transformers' or 'unsloth'."""
    lora_r: int = 16
    """LoRA rank."""
    lora_alpha: int = 32
    """LoRA scaling numerator."""
    lora_dropout: float = 0.0
    """LoRA dropout (0 keeps GRPO's old/new log-probs consistent)."""
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    """Projection layers that get adapters."""
    load_in_4bit: bool = False
    """Unsloth only: 4-bit base weights."""
    max_seq_length: int = 2048
    """Unsloth only: maximum sequence length."""
    dtype: str = "auto"
    """Base weights: 'auto' (bf16 on CUDA, fp32 on CPU where the trainer autocasts), 'bf16' or 'fp32'. LoRA weights stay
    fp32."""

    def __post_init__(self):
        if self.backend not in ("auto", "transformers", "unsloth"):
            raise ValueError(f"backend={self.backend!r}; valid: auto, transformers, unsloth")
        if self.lora_r < 1 or self.lora_alpha < 1:
            raise ValueError("lora_r and lora_alpha must be >= 1")
        if self.dtype not in ("auto", "bf16", "fp32"):
            raise ValueError(f"dtype={self.dtype!r}; valid: auto, bf16, fp32")
        if self.load_in_4bit and self.backend == "transformers":
            raise ValueError("load_in_4bit needs the unsloth backend (bitsandbytes on CUDA)")


UNSLOTH_INSTALL = "bash scripts/setup-gpu.sh"
"""How Unsloth gets installed: the GPU environment .venv-gpu (requirements-gpu.txt)."""


class UnslothMissingError(ImportError):
    """The policy config asks for Unsloth (backend 'unsloth', or 'auto' on CUDA) and it cannot be imported."""


def import_unsloth(cfg: PolicyConfig):
    """The unsloth module, or an UnslothMissingError naming the install command: never a quiet switch to transformers,
    whose memory and speed differ (only backend='transformers' runs without Unsloth on CUDA)."""
    try:
        import unsloth
    except ImportError as e:
        raise UnslothMissingError(
            f"policy backend {cfg.backend!r}{' on CUDA' if cfg.backend == 'auto' else ''} needs Unsloth, which cannot "
            f"be imported ({type(e).__name__}: {e}); install the GPU environment with `{UNSLOTH_INSTALL}` and run in "
            ".venv-gpu, or ask for the transformers backend explicitly (--set train.policy.backend=transformers)"
        ) from e
    return unsloth


def resolve_backend(cfg: PolicyConfig, cuda: bool | None = None) -> str:
    """The backend the policy loads with: 'auto' is Unsloth on CUDA (which must then import: import_unsloth) and
    transformers on a CPU; 'unsloth' is checked when load_policy imports it."""
    if cfg.backend != "auto":
        return cfg.backend
    if cuda is None:
        import torch
        cuda = torch.cuda.is_available()
    if not cuda:
        return "transformers"
    import_unsloth(cfg)
    return "unsloth"


def weights_dtype(cfg: PolicyConfig, cuda: bool | None = None):
    """The dtype the base weights load in. fp32 on a CPU (the trainer autocasts the loss to bf16 where that is native);
    bf16 on CUDA: an fp32 7B policy is 30 GB before activations."""
    import torch
    if cfg.dtype != "auto":
        return torch.bfloat16 if cfg.dtype == "bf16" else torch.float32
    cuda = torch.cuda.is_available() if cuda is None else cuda
    return torch.bfloat16 if cuda else torch.float32


def converted_dir(name: str) -> Path:
    """fp32 transformers folder for a shipped GGUF model, converted on first use."""
    m = SHIPPED[name]
    out = cache_dir().parent / "hf" / f"{name}-{m.sha256[:12]}"
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    gguf = get_model(name)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None  # the GGUF quantizer blocks save_pretrained; the weights are already dequantized
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.replace(tmp, out)  # atomic: a half-written folder is never mistaken for a converted model
    return out


TINY_QWEN2 = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)


def random_policy(tokenizer_dir: str | Path, out: str | Path, seed: int = 0, **shape) -> Path:
    """A randomly initialised Qwen2-shaped policy (TINY_QWEN2 unless `shape` says otherwise) with the REAL tokenizer of
    tokenizer_dir, saved to out: the spec grammar compiles against a real vocabulary, so the whole trainer (rollouts,
    edits, spans, loss) runs on a model that costs nothing to carry or to step (bench/gpu_check.py, the learning
    test)."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=len(tok), max_position_embeddings=4096, tie_word_embeddings=True,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id or tok.eos_token_id,
                      **{**TINY_QWEN2, **shape})
    Qwen2ForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return Path(out)


def cached_random_policy(seed: int, initializer_range: float = 0.2, tokenizer: str = "smollm2-135m",
                         tokenizer_dir: str | Path | None = None) -> Path:
    """random_policy(converted_dir(tokenizer), ..., seed, initializer_range) built once into the cache and reused: the
    draw is a pure function of its arguments (torch.manual_seed), so the folder name says everything about it. The
    testbed's many-seed study gives each training seed its own random policy this way. Init std 0.2, not HF's 0.02: at
    0.02 the logits span ~1 nat after the final norm and LoRA cannot sharpen them (LOG.md, 2026-12-04)."""
    # tokenizer_dir: a tokenizer folder of the caller's (e.g. the testbed's small BPE, lemon.testbed.vocab); the folder
    # name (which carries its digest there) then names the draw instead of `tokenizer`
    name = Path(tokenizer_dir).name if tokenizer_dir is not None else tokenizer
    out = cache_dir().parent / "random-policy" / f"tiny-{name}-init{initializer_range:g}-seed{seed}"
    if (out / "config.json").exists():
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    random_policy(tokenizer_dir or converted_dir(tokenizer), tmp, seed=seed, initializer_range=initializer_range)
    try:
        os.replace(tmp, out)  # atomic, as converted_dir
    except OSError:  # another process (the study's other chain) finished the same draw first: keep its copy
        if not (out / "config.json").exists():
            raise
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_adapter_weights(model, adapter: str | Path) -> int:
    """Copy a saved peft adapter (adapter_model.safetensors) into `model`, a peft model with the same LoRA layout.
    Raises ValueError when a saved tensor has no matching LoRA parameter or a shape differs (a warm start that would be
    half-applied); returns the number of tensors loaded."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file
    f = Path(adapter) / "adapter_model.safetensors"
    if not f.exists():
        raise FileNotFoundError(f"{f} is missing: {adapter} is not a saved peft adapter")
    state = load_file(str(f))
    res = set_peft_model_state_dict(model, state)
    unexpected = list(getattr(res, "unexpected_keys", []) or [])
    if unexpected:
        raise ValueError(f"adapter {adapter}: {len(unexpected)} tensors match no LoRA parameter of the model "
                         f"(e.g. {unexpected[:3]}); rank / target modules differ from the policy config")
    lora = {k for k in model.state_dict() if "lora_" in k}
    if not lora:
        raise ValueError("the model has no LoRA parameters to load an adapter into")
    return len(state)


def load_policy(cfg: PolicyConfig, *, lora: bool = True, adapter: str | Path | None = None, seed: int | None = None):
    """(model, tokenizer). With lora=True the model is a peft model with fresh adapters (or `adapter` loaded,
    trainable). `seed` seeds torch before fresh adapters are drawn (LoRA A is random; B is zero): without it two
    processes start from different LoRA weights, so an SFT warm start could not be rebuilt bit for bit (LOG.md
    2026-12-03)."""
    import torch
    backend = resolve_backend(cfg)
    if seed is not None:
        torch.manual_seed(seed)
    path = str(converted_dir(cfg.model)) if cfg.model in SHIPPED else cfg.model
    if backend == "unsloth":
        FastLanguageModel = import_unsloth(cfg).FastLanguageModel
        # use_exact_model_name: Unsloth otherwise remaps a hub id to its own re-upload (unsloth/...), a second download
        # that fails offline and silently changes which weights a run used
        model, tok = FastLanguageModel.from_pretrained(path, max_seq_length=cfg.max_seq_length,
                                                       load_in_4bit=cfg.load_in_4bit, dtype=weights_dtype(cfg),
                                                       use_exact_model_name=True)
        if lora or adapter is not None:
            # random_state: Unsloth reseeds torch with it (default 3407) before drawing LoRA A, overriding the run's
            # seed
            model = FastLanguageModel.get_peft_model(model, r=cfg.lora_r, lora_alpha=cfg.lora_alpha,
                                                     lora_dropout=cfg.lora_dropout,
                                                     target_modules=list(cfg.target_modules),
                                                     random_state=seed if seed is not None else 3407)
            if adapter is not None:
                load_adapter_weights(model, adapter)  # the warm start, into Unsloth's own LoRA modules
        return model, tok
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=weights_dtype(cfg))
    if not lora:
        return model, tok
    from peft import LoraConfig, PeftModel, get_peft_model
    if adapter is not None:
        return PeftModel.from_pretrained(model, str(adapter), is_trainable=True), tok
    lcfg = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=list(cfg.target_modules), task_type="CAUSAL_LM")
    return get_peft_model(model, lcfg), tok
