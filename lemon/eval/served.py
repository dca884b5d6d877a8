"""The trained orchestrator written by a llama-server (lemon.policy.served) instead of transformers: the same interface
as lemon.eval.orchestrator.PolicySpecWriter (propose -> SpecProposal), the same prompt token ids and, constrained, the
same llguidance matcher applied token by token, so a greedy spec is the one the transformers writer would give up to f32
summation order. Agreement and speed: bench/served_policy_bench.py."""
from __future__ import annotations

from lemon.eval.orchestrator import OrchestratorConfig, SpecProposal, orchestrator_messages
from lemon.policy.model import converted_dir
from lemon.policy.rollout import eos_ids_of
from lemon.prompts import Prompts
from lemon.run.models import SHIPPED
from lemon.spec import SpecError, parse_spec
from lemon.spec.grammar import GrammarCache, SpecGrammar


def policy_eos_ids(base_model: str, tokenizer) -> set[int]:
    """The ids transformers' generate() stops on for this policy: lemon.policy.rollout's rule on the generation_config
    saved beside the policy's weights (none saved: the tokenizer's EOS)."""
    from transformers import GenerationConfig
    try:
        gen = GenerationConfig.from_pretrained(str(converted_dir(base_model) if base_model in SHIPPED else base_model))
    except OSError:
        gen = None
    return set(eos_ids_of(gen, tokenizer))


class ServedPolicySpecWriter:
    """Spec writer over a ServedPolicy. `tokenizer` is the policy's HF tokenizer (its chat template makes the prompt
    ids; the grammar is compiled against it). Greedy only when constrained (cfg.temperature must be 0)."""

    def __init__(self, served, tokenizer, cfg: OrchestratorConfig = OrchestratorConfig(), *, constrained: bool = True):
        if constrained and cfg.temperature != 0:
            raise ValueError("ServedPolicySpecWriter samples constrained specs greedily only "
                             f"(temperature={cfg.temperature}); use lemon.eval.orchestrator.PolicySpecWriter for "
                             "constrained sampling at T > 0")
        self.served, self.tok, self.cfg, self.constrained = served, tokenizer, cfg, constrained
        self.name = served.name
        self.eos = policy_eos_ids(served.base_model, tokenizer)
        self.n_vocab = served.n_vocab()
        self.cache = GrammarCache()  # compiled once per writer, as PolicySpecWriter does

    def prompt_ids(self, task: str, domain: str, prompts: Prompts) -> list[int]:
        msgs = orchestrator_messages(task, domain, prompts, self.cfg.max_agents)
        return list(self.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                                 return_dict=True)["input_ids"])

    def propose(self, task: str, domain: str, prompts: Prompts, seed: int = 0) -> SpecProposal:
        ids = self.prompt_ids(task, domain, prompts)
        if self.constrained:
            g = SpecGrammar.for_domain(prompts, domain, max_agents=self.cfg.max_agents)
            m = self.cache.matcher(self.tok, g, n_vocab=self.n_vocab, eos_ids=sorted(self.eos))
            toks, finished = self.served.greedy_constrained(ids, m, max_tokens=self.cfg.max_tokens, eos_ids=self.eos,
                                                            n_vocab=self.n_vocab)
            text = self.tok.decode(list(toks), skip_special_tokens=True)  # exactly how sample_specs decodes Sample.text
        else:
            c = self.served.complete(ids, max_tokens=self.cfg.max_tokens, temperature=self.cfg.temperature, seed=seed)
            toks, text, finished = c.token_ids, c.text, c.finished
        n_out = len(toks) + int(finished)  # metered like Sample.n_tokens: the EOS generated counts
        try:
            spec = parse_spec(text, base_roles=prompts.roles_for(domain), max_agents=self.cfg.max_agents)
            return SpecProposal(text, spec, None, None, len(ids), n_out)
        except SpecError as e:
            return SpecProposal(text, None, str(e), e.code, len(ids), n_out)
