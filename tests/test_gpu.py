"""CUDA paths on a tiny randomly initialised model (no weights can be carried to the GPU machine). What needs only CUDA
(CF advantages and their loss on the GPU; the trainer's CUDA branch on the transformers backend) runs wherever
torch.cuda.is_available(); only the Unsloth test also needs unsloth (requirements-gpu.txt; the CPU stack never installs
it), and on a CUDA machine without it that skip says so loudly (reason and warning). Run on a GPU box: pytest -rs
tests/test_gpu.py"""
import importlib.util
import json
import warnings

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the CUDA paths are tested only on a GPU machine", allow_module_level=True)

pytestmark = pytest.mark.gpu
NO_UNSLOTH = ("CUDA IS AVAILABLE BUT UNSLOTH IS NOT INSTALLED: the paper profile's Unsloth trainer was NOT tested "
              "(pip install -r requirements-gpu.txt)")
HAVE_UNSLOTH = importlib.util.find_spec("unsloth") is not None
if not HAVE_UNSLOTH:
    warnings.warn(NO_UNSLOTH)  # in the warnings summary as well, not only under -rs

from _tiny import tiny_model as _tiny_model  # noqa: E402  (tests/_tiny.py)


def _train_tiny(tmp_path, backend: str, steps: int = 3) -> dict:
    """`lemon train` on CUDA with `backend`, from a warm-start adapter with non-zero LoRA weights (saved the way
    lemon.train.sft saves it); fake workers. Returns the manifest."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from lemon.prompts import default_prompts
    from lemon.train.config import train_preset
    from lemon.train.pipeline import train
    from lemon.policy.model import PolicyConfig, load_policy
    _tiny_model(tmp_path / "tiny")
    pcfg = PolicyConfig(model=str(tmp_path / "tiny"), backend=backend, lora_r=4, lora_alpha=8, max_seq_length=4096)
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "tiny")
    warm = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=list(pcfg.target_modules),
                                           task_type="CAUSAL_LM"))
    for n, p in warm.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.02)
    warm.save_pretrained(tmp_path / "warm")
    model, _ = load_policy(pcfg, adapter=tmp_path / "warm")
    got = {k: v for k, v in model.state_dict().items() if "lora_B" in k}
    assert got and all(v.abs().sum() > 0 for v in got.values())  # the warm start is in, not fresh zero-init adapters
    del model
    fake = {"backend": "fake", "model": "fake", "reply": "Answer: 18"}
    # the tiny character-level tokenizer has no byte fallback for the grammar: unconstrained sampling here
    cfg = train_preset("smoke", policy=pcfg, workers={c: fake for c in ("small", "medium", "large")},
                       max_completion_length=64, max_steps=steps, constrained=False)
    torch.cuda.reset_peak_memory_stats()
    res = train(cfg, tmp_path / "run", default_prompts(), init_adapter=tmp_path / "warm", progress=False)
    assert res["steps"] == steps
    logs = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sum("reward" in l for l in logs) == steps
    assert torch.cuda.max_memory_allocated() > 0  # the steps ran on the GPU, not on a CPU fallback
    return json.loads((tmp_path / "run" / "manifest.json").read_text())


def test_cf_advantages_and_their_loss_on_cuda():
    """TRL's completion_mask lives on the GPU: the CF advantages must follow it and a policy-gradient loss over them
    backprop there (issue 29, finding 1 on real CUDA; tests/test_device_placement.py checks it on the meta device)."""
    from lemon.train.cf import step_advantages
    cmask = torch.ones(4, 6, device="cuda")
    smask = torch.zeros(4, 6)
    smask[0, 2:4] = 1  # rollout 0's edited span
    adv, keep, _ = step_advantages([1.0, 0.0, None, 0.5], [0, 0, 1, 1], [0.3, 0.0, 0.0, 0.0], cmask, smask, lam=1.0)
    assert adv.is_cuda and keep.is_cuda and adv.shape == (4, 6)
    assert adv[0, 2] != adv[0, 0]  # the counterfactual contrast reached the span
    logp = torch.randn(4, 6, device="cuda", requires_grad=True)  # stand-in per-token log-probs
    loss = -(adv * logp * cmask * keep[:, None]).sum() / cmask.sum()
    loss.backward()
    assert torch.isfinite(loss) and logp.grad.is_cuda and logp.grad[2].abs().sum() == 0  # the errored rollout is out


def test_cuda_cf_grpo_steps_without_unsloth(tmp_path):
    """The trainer's CUDA branch (bf16 weights, no use_cpu) on the plain transformers backend: needs CUDA only."""
    assert _train_tiny(tmp_path, "transformers", steps=2)["policy_backend"] == "transformers"


@pytest.mark.skipif(not HAVE_UNSLOTH, reason=NO_UNSLOTH)
def test_unsloth_cf_grpo_steps_with_a_warm_start(tmp_path):
    """Exactly what `lemon train` builds on CUDA: trainer_class('unsloth') (a subclass of the GRPOTrainer trl exports
    after unsloth is imported, defect 3), with a warm-start adapter loaded into Unsloth's LoRA modules (defect 2)."""
    from lemon.train.grpo import trainer_class
    cls = trainer_class("unsloth")  # imports unsloth before trl
    import trl
    assert issubclass(cls, trl.GRPOTrainer) and "unsloth" in (trl.GRPOTrainer.__module__
                                                              + trl.GRPOTrainer.__name__).lower()
    assert _train_tiny(tmp_path, "unsloth")["policy_backend"] == "unsloth"
