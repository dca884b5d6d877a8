"""CUDA / Unsloth path: a few CF-GRPO steps through Unsloth's FastLanguageModel on a tiny randomly initialised model (no
weights can be carried to the GPU machine). Skips cleanly without a GPU or without unsloth (the CPU stack never installs it;
see requirements-gpu.txt). Run on a GPU box with: pytest -m gpu tests/test_gpu.py"""
import json

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the Unsloth path is tested only on a GPU machine", allow_module_level=True)
pytest.importorskip("unsloth")

pytestmark = pytest.mark.gpu

from _tiny import tiny_model as _tiny_model  # noqa: E402  (tests/_tiny.py)


def test_unsloth_cf_grpo_steps_with_a_warm_start(tmp_path):
    """Exactly what `lemon train` builds on CUDA: trainer_class('unsloth') (a subclass of the GRPOTrainer trl exports after
    unsloth is imported, defect 3), with a warm-start adapter loaded into Unsloth's LoRA modules (defect 2)."""
    import trl
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from lemon.train.config import train_preset
    from lemon.train.grpo import trainer_class
    from lemon.train.policy import PolicyConfig, load_policy
    from lemon.prompts import default_prompts
    from lemon.train.pipeline import train
    _tiny_model(tmp_path / "tiny")
    pcfg = PolicyConfig(model=str(tmp_path / "tiny"), backend="unsloth", lora_r=4, lora_alpha=8, max_seq_length=4096)
    # a warm start with non-zero LoRA weights, saved the way lemon.train.sft saves it
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "tiny")
    warm = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=list(pcfg.target_modules), task_type="CAUSAL_LM"))
    for n, p in warm.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.02)
    warm.save_pretrained(tmp_path / "warm")
    model, _ = load_policy(pcfg, adapter=tmp_path / "warm")
    got = {k: v for k, v in model.state_dict().items() if "lora_B" in k}
    assert got and all(v.abs().sum() > 0 for v in got.values())  # the warm start is in, not fresh zero-init adapters
    cls = trainer_class("unsloth")
    assert issubclass(cls, trl.GRPOTrainer) and "unsloth" in (trl.GRPOTrainer.__module__ + trl.GRPOTrainer.__name__).lower()
    fake = {"backend": "fake", "model": "fake", "reply": "Answer: 18"}
    # the tiny character-level tokenizer has no byte fallback for the grammar: unconstrained sampling here
    cfg = train_preset("smoke", policy=pcfg, workers={c: fake for c in ("small", "medium", "large")},
                       max_completion_length=64, max_steps=3, constrained=False)
    res = train(cfg, tmp_path / "run", default_prompts(), init_adapter=tmp_path / "warm", progress=False)
    assert res["steps"] == 3
    logs = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sum("reward" in l for l in logs) == 3
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["policy_backend"] == "unsloth"
