"""Issue 29, findings 4, 6 and 8: the one-GPU paper path's set-up decisions, checked on a CPU.
- 4: Unsloth swaps trl.GRPOConfig for its own subclass when imported; the config must be built after that, in a fresh
  process too (a stand-in `unsloth` package that patches trl the same way, on PYTHONPATH of a subprocess).
- 6: on CUDA the policy loads in bf16 (not fp32), sampling does not deep-copy a merged model each step, and gradient
  checkpointing is a config field (on for the paper profile), not hard-coded off.
- 8: Unsloth is told the exact model name (no remap to its re-upload) and the run's seed (not its random_state 3407)."""
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("trl")

from lemon.train.config import train_preset  # noqa: E402
from lemon.policy.model import PolicyConfig, weights_dtype  # noqa: E402

FAKE_UNSLOTH = '''
import trl
class UnslothGRPOConfig(trl.GRPOConfig):
    unsloth_num_chunks: int = -1
class UnslothGRPOTrainer(trl.GRPOTrainer):
    pass
trl.GRPOConfig, trl.GRPOTrainer = UnslothGRPOConfig, UnslothGRPOTrainer
'''


def test_grpo_config_is_built_after_unsloth_patches_trl_in_a_fresh_process(tmp_path):
    (tmp_path / "unsloth").mkdir()
    (tmp_path / "unsloth" / "__init__.py").write_text(FAKE_UNSLOTH)
    code = textwrap.dedent(f"""
        from pathlib import Path
        from lemon.train.config import train_preset
        from lemon.train.pipeline import grpo_args
        from lemon.train.grpo import trainer_class
        cfg = train_preset("smoke")
        args = grpo_args(cfg, Path({str(tmp_path)!r}), [1.0, 1.0, -1.0, 1.0], False, "unsloth")
        print(type(args).__name__, trainer_class("unsloth").__mro__[2].__name__)
    """)
    root = Path(__file__).resolve().parents[1]  # lemon importable without an install too (the bare GPU machine)
    paths = [str(tmp_path), str(root), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {"PYTHONPATH": os.pathsep.join(paths), "PATH": "/usr/bin:/bin",
           **{k: v for k, v in os.environ.items() if k.startswith("LEMON_")}}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["UnslothGRPOConfig", "UnslothGRPOTrainer"]


def test_policy_weights_are_bf16_on_cuda_and_fp32_on_cpu():
    assert weights_dtype(PolicyConfig(), cuda=True) == torch.bfloat16
    assert weights_dtype(PolicyConfig(), cuda=False) == torch.float32
    assert weights_dtype(PolicyConfig(dtype="fp32"), cuda=True) == torch.float32
    with pytest.raises(ValueError, match="dtype"):
        PolicyConfig(dtype="fp16")


def test_sampling_on_cuda_never_makes_a_merged_copy(monkeypatch):
    import lemon.policy.dtype as D
    from lemon.train.pipeline import sample_dtype_for
    monkeypatch.setattr(D, "cpu_bf16_native", lambda cpuinfo=None: True)  # a GPU host whose CPU has native bf16
    cfg = train_preset("smoke")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert sample_dtype_for(cfg) == "bf16_merged"  # the CPU choice stays what was measured there
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert sample_dtype_for(cfg) == "model"


def test_gradient_checkpointing_is_a_config_field_and_on_for_the_paper_profile(tmp_path):
    from lemon.train.pipeline import grpo_args
    assert train_preset("paper").gradient_checkpointing and not train_preset("smoke").gradient_checkpointing
    args = grpo_args(train_preset("smoke", gradient_checkpointing=True), tmp_path, [1.0] * 4, False, "transformers")
    assert args.gradient_checkpointing


def test_unsloth_gets_the_exact_model_name_and_the_run_seed(monkeypatch):
    calls = {}

    class FastLanguageModel:
        @staticmethod
        def from_pretrained(path, **kw):
            calls["load"] = kw
            return object(), object()

        @staticmethod
        def get_peft_model(model, **kw):
            calls["peft"] = kw
            return model
    monkeypatch.setitem(sys.modules, "unsloth", types.SimpleNamespace(FastLanguageModel=FastLanguageModel))
    from lemon.policy.model import load_policy
    load_policy(PolicyConfig(model="Qwen/Qwen2.5-7B-Instruct", backend="unsloth"), seed=7)
    assert calls["load"]["use_exact_model_name"] is True
    assert calls["peft"]["random_state"] == 7


def test_unsloth_with_cf_and_micro_batches_is_refused_before_loading(tmp_path):
    from lemon.prompts import default_prompts
    from lemon.train.pipeline import _train
    cfg = train_preset("smoke", policy=PolicyConfig(model="smollm2-135m", backend="unsloth"), batch_size=4,
                       micro_batch=2)
    with pytest.raises(ValueError, match="micro_batch = batch_size"):
        _train(cfg, tmp_path, default_prompts(), pool=types.SimpleNamespace(describe=lambda: {}), init_adapter=None,
               examples=[], progress=False)


def test_cpu_training_refuses_a_trl_whose_loss_needs_triton():
    """trl 1.15 (the GPU environment's, capped by Unsloth) trains on CUDA but its loss fails on a CPU (device check
    2026-12-04): a clear error instead of "'NoneType' object has no attribute 'apply'" at the first step."""
    from lemon.train.grpo import check_trl_cpu
    with pytest.raises(ImportError, match="trl 1.15.0 cannot run the GRPO loss on a CPU"):
        check_trl_cpu("1.15.0")
    check_trl_cpu("1.16.0")
