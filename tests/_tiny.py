"""A tiny randomly initialised Qwen2 model with a character-level tokenizer built in code (no files to download or
carry): for tests of the policy / adapter plumbing on CPU and of the Unsloth path on a GPU machine."""


def tiny_model(path):
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
