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


def _tiny_model(path):
    # a character-level tokenizer built in code: no tokenizer files need to travel to the GPU machine
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {chr(i): i - 32 for i in range(32, 127)}
    vocab.update({"<pad>": 95, "<eos>": 96})
    t = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    t.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=t, pad_token="<pad>", eos_token="<eos>")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    cfg = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=4096, eos_token_id=96, pad_token_id=95)
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)


def test_unsloth_cf_grpo_steps(tmp_path):
    from lemon.train.config import train_preset
    from lemon.train.policy import PolicyConfig
    from lemon.prompts import default_prompts
    from lemon.train.pipeline import train
    _tiny_model(tmp_path / "tiny")
    fake = {"backend": "fake", "model": "fake", "reply": "Answer: 18"}
    cfg = train_preset("smoke", policy=PolicyConfig(model=str(tmp_path / "tiny"), backend="unsloth", lora_r=4, lora_alpha=8,
                                                    max_seq_length=4096),
                       workers={c: fake for c in ("small", "medium", "large")}, max_completion_length=64, max_steps=3)
    res = train(cfg, tmp_path / "run", default_prompts(), progress=False)
    assert res["steps"] == 3
    logs = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sum("reward" in l for l in logs) == 3
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["policy_backend"] == "unsloth"
