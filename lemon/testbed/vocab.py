"""A small byte-level BPE tokenizer for the testbed's random policies, trained here from the project's own text.

Why: a random 2-layer policy with SmolLM2's 49,152-token vocabulary spends most of a testbed step on the vocabulary, not
the model: the LM head and its log-softmax (forward and backward), the sampler and the grammar mask each touch every
token at every position (on 2 cores, LOG.md 2026-12-07: ~4 s of a ~15 s step in the loss's LM-head backward, ~10 ms of
each ~30 ms decoding step in the sampler). The testbed's policy is random anyway, so its vocabulary is a free choice; a
few thousand tokens learned from the texts the policy reads and writes make every vocabulary-sized operation ~20x
cheaper.

The corpus is deterministic (the prompts file, the orchestrator prompt of every question of the testbed's benchmarks'
train pools, canonical specs of every base role and capacity), and so is the BPE trainer given it (`tokenizers`, byte
level like SmolLM2's, so every string stays encodable and llguidance reads it like any HF byte-level tokenizer). The
chat template and the special tokens (<|im_start|>, <|im_end|>, <|endoftext|>) are SmolLM2's, so prompts are laid out
the same way. Built once into the cache, keyed by the corpus's sha256 and the vocabulary size.

One thing transformers does on top: a random policy's folder (lemon.policy.model.random_policy, a Qwen2 config) reloads
this tokenizer as Qwen2Tokenizer, whose pre-tokenizer also splits digits and newlines apart (a spec takes ~20% more
tokens than with the trained one: 51 vs 43 on a one-agent spec). The vocabulary and merges are the same, the policy
always loads through its own folder (sampling, the trainer, the grammar), so all of them agree; SmolLM2's random-tiny
base does the same.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from lemon.benchmarks import pool
from lemon.eval.orchestrator import orchestrator_messages
from lemon.prompts import CAPACITIES, Prompts, default_prompts
from lemon.run.models import cache_dir

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
                 "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                 "{% endif %}")
BENCHMARKS = ("gsm8k", "multiarith", "svamp")  # the testbed's worlds draw from these train pools


def corpus(prompts: Prompts, max_agents: int = 4) -> list[str]:
    """The texts the tokenizer is trained on, in a fixed order."""
    texts = [Path(prompts.path).read_text()] if prompts.path else []
    for b in BENCHMARKS:
        for e in pool(b, "train"):
            texts += [m["content"] for m in orchestrator_messages(e.question, "math", prompts, max_agents)]
    roles = prompts.roles_for("math")
    for i, (role, duty) in enumerate(roles.items()):
        for c in CAPACITIES:
            texts.append(f'agents:\n  - id: a1\n    base_role: {role}\n    role: "{role.title()} {i}"\n'
                         f'    duty: "{duty}"\n    capacity: {c}\n    depends_on: []\n  - id: a2\n'
                         f'    base_role: solver\n    role: "S"\n    duty: "Solve it."\n    capacity: {c}\n'
                         f'    depends_on: [a1]\nfinal: a2\n')
    return texts


def small_tokenizer_dir(vocab_size: int = 2048, prompts: Prompts | None = None) -> Path:
    """A saved HF fast tokenizer (byte-level BPE, `vocab_size` tokens with the specials), trained on `corpus`;
    cached."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    if not 300 <= vocab_size <= 65536:
        raise ValueError(f"vocab_size={vocab_size}: a byte-level BPE needs >= 259 tokens (256 bytes + specials); "
                         "use 300..65536")
    prompts = prompts or default_prompts()
    texts = corpus(prompts)
    digest = hashlib.sha256("\x00".join(texts).encode()).hexdigest()[:12]
    out = cache_dir().parent / "tokenizers" / f"testbed-bpe{vocab_size}-{digest}"
    if (out / "tokenizer.json").exists():
        return out
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|im_end|>",
                                   bos_token="<|im_start|>", unk_token=None)
    fast.chat_template = CHAT_TEMPLATE
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    fast.save_pretrained(tmp)
    try:
        os.replace(tmp, out)  # atomic: two chains building the same tokenizer keep one copy
    except OSError:
        if not (out / "tokenizer.json").exists():
            raise
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    return out
