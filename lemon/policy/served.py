"""The orchestrator policy served by `llama-server` for fast greedy evaluation: the trained policy's exact base weights
(the shipped GGUF dequantized to F32), its LoRA converted to GGUF, and the spec grammar applied HERE, token by token, by
the same llguidance matcher the transformers sampler uses. Why: on 2 cores transformers writes one greedy spec of the
0.5B policy in ~30-50 s (LOG.md, 2026-12-02); evaluating a trained policy on 150+ questions needs it much cheaper.

What is the same as the transformers policy (lemon.policy.model, lemon.eval.orchestrator.PolicySpecWriter):
  - base weights: `base_gguf(weights='f32')` dequantizes the shipped GGUF with gguf-py, the function transformers uses;
  - LoRA: the saved peft adapter, converted by llama.cpp's own convert_lora_to_gguf.py (vendored source tree, f32);
  - arithmetic: f32 weights, f32 KV cache, flash attention off (with llama.cpp's defaults, f16 KV and flash attention,
    token log-probs differed from transformers' by up to 0.02; with these, by <= 2e-4: bench/served_policy_bench.py);
  - prompt: the HF tokenizer's chat template, sent to the server as TOKEN IDS;
  - constraint: llguidance's mask, including its canonical tokenization of forced text. A GBNF grammar on the server
    was tried first and rejected: same language, but the server may spell forced text with other tokens (' ' + 'a'
    where llguidance forces ' a'), which changed 2 of 8 greedy specs of the testbed's SFT policy.
What differs: summation order in f32 (ties closer than ~2e-4 in log-prob can break the other way).
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from lemon.policy.model import converted_dir
from lemon.run.models import SHIPPED, cache_dir, get_model
from lemon.run.servers import ServerConfig, ServerError, ServerManager, build_info, find_binary


class AdapterConversionError(RuntimeError):
    """convert_lora_to_gguf.py failed (its stderr tail is in the message) or the llama.cpp source tree is missing."""


def llama_source(binary: str | Path | None = None) -> Path:
    """The llama.cpp source tree the server was built from (setup.sh records it beside the binary)."""
    info = build_info(find_binary(binary))
    src = Path(info.get("source", ""))
    if not (src / "convert_lora_to_gguf.py").is_file():
        raise AdapterConversionError(f"no llama.cpp source tree with convert_lora_to_gguf.py at {src!s} (from the "
                                     "build record beside llama-server); rerun `bash scripts/setup.sh`")
    return src


def _digest(adapter: Path) -> str:
    h = hashlib.sha256()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        h.update((adapter / name).read_bytes())
    return h.hexdigest()[:16]


def adapter_to_gguf(adapter: str | Path, base_model: str, *, out: str | Path | None = None,
                    timeout_s: float = 600.0) -> Path:
    """The peft adapter folder as an f32 LoRA GGUF (default <adapter>/lora-<digest>.gguf; reused when the digest of
    adapter_config.json + adapter_model.safetensors matches). base_model: the shipped model name the adapter was trained
    on (the converter reads its config from lemon.policy.model.converted_dir, never its weights)."""
    adapter = Path(adapter)
    if not (adapter / "adapter_model.safetensors").is_file():
        raise FileNotFoundError(f"{adapter} is not a saved peft adapter (no adapter_model.safetensors)")
    target = Path(out) if out else adapter / f"lora-{_digest(adapter)}.gguf"
    if target.is_file():
        return target
    src = llama_source()
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src / "gguf-py"), str(src)]), "NO_LOCAL_GGUF": ""}
    r = subprocess.run([sys.executable, str(src / "convert_lora_to_gguf.py"), "--base", str(converted_dir(base_model)),
                        "--outtype", "f32", "--outfile", str(tmp), str(adapter)], capture_output=True, text=True,
                       timeout=timeout_s, env=env)
    if r.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        raise AdapterConversionError(f"convert_lora_to_gguf.py exited {r.returncode} for "
                                     f"{adapter}:\n{r.stderr[-3000:]}")
    os.replace(tmp, target)  # atomic: a half-written GGUF is never reused
    return target


def base_gguf(base_model: str, weights: str = "f32") -> Path:
    """The base model file the server loads. weights='shipped': the shipped quantized GGUF (fastest; llama.cpp then
    multiplies with Q4 weights, not the trained policy's fp32 ones). weights='f32': the shipped GGUF with every tensor
    dequantized to F32 by gguf-py's `dequantize`, the very function transformers uses when lemon.policy.model loads the
    shipped file, so the server holds exactly the trained policy's base weights (metadata and tokenizer copied as they
    are). Written once into the model cache."""
    if weights not in ("f32", "shipped"):
        raise ValueError(f"weights={weights!r}; valid: 'f32' (the trained policy's exact weights) or "
                         "'shipped' (quantized)")
    src = get_model(base_model)
    if weights == "shipped":
        return src
    target = cache_dir() / f"{base_model}-{SHIPPED[base_model].sha256[:12]}-f32.gguf"
    if not target.is_file():
        dequantize_gguf(src, target)
    return target


def dequantize_gguf(src: Path, target: Path) -> Path:
    """Copy GGUF `src` to `target` with every tensor in F32 (general.file_type = ALL_F32); atomic."""
    import numpy as np
    from gguf import GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType, dequantize
    r = GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    w = GGUFWriter(str(tmp), arch)  # writes general.architecture itself
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = GGUFValueType(f.types[0])
        sub = GGUFValueType(f.types[1]) if vtype == GGUFValueType.ARRAY else None
        val = int(LlamaFileType.ALL_F32) if key == "general.file_type" else f.contents()
        w.add_key_value(key, val, vtype, sub_type=sub)
    for t in r.tensors:
        w.add_tensor(t.name, np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, target)
    return target


@dataclass(frozen=True)
class ServedCompletion:
    """One completion from the served policy."""

    token_ids: tuple[int, ...]
    """Completion token ids (the EOS that ended it is not included; llama-server drops it)."""
    text: str
    """The completion text."""
    finished: bool
    """Stopped by EOS; False when max_tokens cut it."""


class ServedPolicy:
    """One llama-server running the policy (base GGUF + optional LoRA GGUF). Use as a context manager.
    `greedy_constrained`: greedy under the spec grammar's llguidance matcher; `complete`: free decoding (no grammar)."""

    def __init__(self, base_model: str, adapter: str | Path | None = None, *, weights: str = "f32", slots: int = 1,
                 ctx_per_slot: int = 4096, log_dir: str | Path | None = None, binary: str | Path | None = None,
                 timeout_s: float = 600.0):
        self.base_model, self.weights, self.timeout_s = base_model, weights, timeout_s
        self.lora = adapter_to_gguf(adapter, base_model) if adapter is not None else None
        self.adapter = Path(adapter) if adapter is not None else None
        extra = ("--lora", str(self.lora)) if self.lora else ()
        if weights == "f32":  # llama.cpp's KV cache is f16 by default: keep keys / values in f32 as transformers does
            extra += ("--cache-type-k", "f32", "--cache-type-v", "f32", "--flash-attn", "off")
        self.manager = ServerManager(log_dir, binary=binary)
        self.manager.add("policy", base_gguf(base_model, weights), ServerConfig(slots=slots, ctx_per_slot=ctx_per_slot,
                                                                         extra_args=extra))
        self.manager.start()
        self.name = f"served:{base_model}[{weights}]" + (f"+{self.adapter.name}" if self.adapter else "")

    def describe(self) -> dict:
        return {"name": self.name, "lora_gguf": str(self.lora) if self.lora else None,
                **self.manager.describe_server("policy")}

    def complete(self, prompt_ids: list[int], *, max_tokens: int, temperature: float = 0.0,
                 seed: int = 0) -> ServedCompletion:
        """Free (unconstrained) decoding: the unconstrained-policy ablation. Constrained greedy: greedy_constrained."""
        out = self._post({"prompt": [int(t) for t in prompt_ids], "n_predict": int(max_tokens),
                          "temperature": float(temperature), "top_k": 0, "top_p": 1.0, "min_p": 0.0, "typical_p": 1.0,
                          "repeat_penalty": 1.0, "seed": int(seed), "return_tokens": True, "cache_prompt": True,
                          "stream": False})
        return ServedCompletion(tuple(out.get("tokens") or ()), out["content"], out.get("stop_type") == "eos")

    def n_vocab(self) -> int:
        """The model's vocabulary (logits) width, as llama-server reports it."""
        url = self.manager.ensure("policy").removesuffix("/") + "/models"
        with urllib.request.urlopen(url, timeout=60) as resp:
            return int(json.loads(resp.read())["data"][0]["meta"]["n_vocab"])

    def _post(self, body: dict) -> dict:
        # ensure() gives the OpenAI base URL (.../v1); /completion (token-id prompts, n_probs) is llama-server's native
        # endpoint
        url = self.manager.ensure("policy").removesuffix("/").removesuffix("/v1") + "/completion"
        req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as e:
            raise ServerError(f"served policy: HTTP {e.code} from {url}: {e.read()[:500]!r}") from e

    def greedy_constrained(self, prompt_ids: list[int], matcher, *, max_tokens: int, eos_ids: set[int], n_vocab: int,
                           top_n: int = 64) -> tuple[tuple[int, ...], bool]:
        """Greedy decoding under an llguidance matcher held HERE, token for token what lemon.policy.rollout.sample_specs
        does at temperature 0: forced tokens (llguidance's canonical tokenization of forced text, compute_ff_tokens, or
        a mask with one token) are appended without a model call; at a free position the server returns its top_n
        log-probs and the best one the mask allows is taken. That is exact: an allowed token outside the top_n has a
        lower logit than all of them, so when one of the top_n is allowed the best allowed is among them; when none is,
        the request is repeated with every disallowed token banned (logit_bias). The prompt is resent each call;
        llama-server's prompt cache (cache_prompt) evaluates only the new tokens. Returns (completion ids without the
        EOS, finished: EOS taken before max_tokens)."""
        import numpy as np
        out: list[int] = []
        finished = False
        while len(out) < max_tokens:
            ff = [int(t) for t in matcher.compute_ff_tokens()][:max_tokens - len(out)]
            if ff:  # a forced run (never EOS): take it whole, no model call
                for t in ff:
                    if not matcher.consume_token(t):
                        raise ServerError(f"served policy: forced token {t} refused by the grammar "
                                          f"({matcher.get_error()})")
                out += ff
                continue
            mask = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint32)  # (ceil(V/32),) one bit per token
            allowed_ids = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))  # (n_allowed,)
            allowed = set(allowed_ids.tolist())
            if len(allowed_ids) == 1:  # one choice (e.g. EOS once the spec is complete)
                pick = int(allowed_ids[0])
            else:
                body = {"prompt": list(prompt_ids) + out, "n_predict": 1, "temperature": 0.0, "n_probs": top_n,
                        "top_k": 0, "min_p": 0.0, "cache_prompt": True, "stream": False, "return_tokens": True}
                r = self._post(body)
                cands = [c["id"] for c in r["completion_probabilities"][0]["top_logprobs"]]
                pick = next((t for t in cands if t in allowed), None)
                if pick is None:
                    banned = [[t, False] for t in range(n_vocab) if t not in allowed]
                    r = self._post({**body, "n_probs": 0, "logit_bias": banned})
                    pick = int(r["tokens"][0])
            if pick in eos_ids:
                finished = True
                break
            if not matcher.consume_token(pick):
                raise ServerError(f"served policy: token {pick} was not allowed by the grammar ({matcher.get_error()})")
            out.append(pick)
        return tuple(out), finished

    def close(self) -> None:
        self.manager.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
