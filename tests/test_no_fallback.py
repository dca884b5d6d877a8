"""No silent fallbacks on the GPU path: a policy config that asks for Unsloth without it installed is an error naming
the install command (never a quiet switch to transformers), and the SFT warm start honours gradient checkpointing on
every backend. CPU doubles only: the unsloth import is made to fail, CUDA is faked, TRL's SFT classes are recorders."""
import sys
from types import SimpleNamespace

import pytest

from lemon.policy.model import PolicyConfig, UnslothMissingError, load_policy, resolve_backend


@pytest.fixture
def no_unsloth(monkeypatch):
    monkeypatch.setitem(sys.modules, "unsloth", None)  # `import unsloth` raises ImportError


def test_auto_on_cuda_without_unsloth_is_an_error_naming_the_install(no_unsloth):
    with pytest.raises(UnslothMissingError) as e:
        resolve_backend(PolicyConfig(model="Qwen/Qwen2.5-7B-Instruct", backend="auto"), cuda=True)
    msg = str(e.value)
    assert "bash scripts/setup-gpu.sh" in msg and "--set train.policy.backend=transformers" in msg
    assert "policy backend 'auto' on CUDA needs Unsloth" in msg and isinstance(e.value, ImportError)
    assert resolve_backend(PolicyConfig(backend="transformers"), cuda=True) == "transformers"  # asked for: no Unsloth
    assert resolve_backend(PolicyConfig(backend="auto"), cuda=False) == "transformers"  # a CPU never runs Unsloth


def test_unsloth_is_used_when_it_imports(monkeypatch):
    monkeypatch.setitem(sys.modules, "unsloth", SimpleNamespace())
    assert resolve_backend(PolicyConfig(backend="auto"), cuda=True) == "unsloth"


@pytest.mark.parametrize("backend", ["auto", "unsloth"])
def test_load_policy_asking_for_unsloth_without_it_stops_before_loading(no_unsloth, monkeypatch, backend):
    import torch
    import transformers
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(transformers, "AutoModelForCausalLM", None)  # the transformers fallback would fail differently
    with pytest.raises(UnslothMissingError, match=f"policy backend '{backend}'.* `bash scripts/setup-gpu.sh`"):
        load_policy(PolicyConfig(model="Qwen/Qwen2.5-7B-Instruct", backend=backend))


class _Recorder:
    """Stands in for trl.SFTConfig (keeps its kwargs) and trl.SFTTrainer (trains nothing)."""

    def __init__(self, **kw):
        self.__dict__.update(kw)
        self.kw = kw


class _Trainer:
    seen = []

    def __init__(self, model, args, train_dataset, processing_class):
        self.model, self.args = model, args
        self.state = SimpleNamespace(global_step=0, log_history=[])
        _Trainer.seen.append(args)

    def train(self):
        pass


def _sft_args(monkeypatch, tmp_path, cuda: bool, **cfg) -> dict:
    import torch
    import trl
    from lemon.train.sft import SFTConfig, run_sft
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(trl, "SFTConfig", _Recorder)
    monkeypatch.setattr(trl, "SFTTrainer", _Trainer)
    saver = SimpleNamespace(save_pretrained=lambda out: None)
    rows = [{"prompt": [{"role": "user", "content": "q"}], "completion": [{"role": "assistant", "content": "a"}]}]
    run_sft(saver, saver, rows, SFTConfig(**cfg), tmp_path, progress=False)
    return _Trainer.seen[-1].kw


@pytest.mark.parametrize("cuda", [False, True])
def test_sft_honours_the_configs_gradient_checkpointing_on_every_device(monkeypatch, tmp_path, cuda):
    assert _sft_args(monkeypatch, tmp_path, cuda, gradient_checkpointing=True)["gradient_checkpointing"] is True
    assert _sft_args(monkeypatch, tmp_path, cuda, gradient_checkpointing=False)["gradient_checkpointing"] is False


def test_sft_checkpoints_by_default_on_cuda_only(monkeypatch, tmp_path):
    assert _sft_args(monkeypatch, tmp_path, True)["gradient_checkpointing"] is True
    assert _sft_args(monkeypatch, tmp_path, False)["gradient_checkpointing"] is False
