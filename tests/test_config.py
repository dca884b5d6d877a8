"""Presets are sized from measured tokens (issue 11 defect 8): the constants in lemon.train.config are re-measured here
with the real Qwen2.5 tokenizer (the 7B/14B/32B workers of the paper profile share it), and every preset can hold its
largest spec, keeps token efficiency informative for multi-agent specs and normalises graph cost by its own
max_agents."""
import pytest

from lemon import benchmarks as B
from lemon.prompts import default_prompts
from lemon.run.executor import build_messages, domain_reply_caps
from lemon.spec import Agent, Spec, parse_spec
from lemon.spec.schema import DUTY_CHARS, ROLE_CHARS
from lemon.train import config as C
from lemon.train.rewards import compute_reward

P = default_prompts()


@pytest.fixture(scope="module")
def qwen():
    from transformers import AutoTokenizer
    from lemon.policy.model import converted_dir
    return AutoTokenizer.from_pretrained(converted_dir("qwen2.5-coder-0.5b"))


def _longest_spec(n: int) -> Spec:
    """n agents with the grammar's longest role and duty (word-like text: tokenizes like real duties) and every edge."""
    role = ("Careful step planner " * 5)[:ROLE_CHARS].rstrip()
    duty = ("Break the word problem into numbered sub steps and check each quantity twice, " * 5)[:DUTY_CHARS].rstrip()
    agents = tuple(Agent(f"a{i + 1}", "verifier", role, duty, "medium", tuple(f"a{j + 1}" for j in range(i)))
                   for i in range(n))
    return Spec(agents, f"a{n}")


def test_spec_token_constants_hold_the_longest_spec(qwen):
    for n in (1, 4, 8):
        text = _longest_spec(n).to_yaml()
        parse_spec(text)
        tokens = len(qwen(text)["input_ids"])
        assert tokens <= C.SPEC_TOKENS_FIXED + n * C.SPEC_TOKENS_PER_AGENT, (n, tokens)
    per_agent = (len(qwen(_longest_spec(8).to_yaml())["input_ids"])
                 - len(qwen(_longest_spec(1).to_yaml())["input_ids"])) / 7
    assert per_agent > 0.6 * C.SPEC_TOKENS_PER_AGENT  # the constant is not wildly oversized either


def test_worker_prompt_constant_covers_a_long_question(qwen):
    gsm = B.pool("gsm8k", "train")
    q = max(gsm, key=lambda e: len(e.question))  # the longest GSM8K train question
    spec = _longest_spec(1)
    msgs = build_messages(spec.agents[0], [], q.question, P,
                          answer_convention=B.get_benchmark("gsm8k").answer_convention)
    n = len(qwen.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
    assert n > 150  # a real count, not the length of a dict
    assert n <= C.WORKER_PROMPT_TOKENS, n


@pytest.mark.parametrize("profile", ["smoke", "cpu", "paper"])
def test_presets_hold_their_largest_spec_and_keep_efficiency_informative(profile, qwen):
    cfg = C.train_preset(profile)
    n = cfg.max_agents
    assert len(qwen(_longest_spec(n).to_yaml())["input_ids"]) <= cfg.max_completion_length
    assert cfg.reward.max_agents == n  # graph cost normalised by what training allows
    b = C.size_budgets(n, cfg.worker_max_tokens)
    assert cfg.task_token_budget == b["task"] and cfg.reward.token_budget == b["efficiency"]
    # where max_agents >= 4: a 3-agent chain whose every agent uses its whole reply cap keeps a clearly non-zero
    # efficiency term (the old paper preset zeroed it for most multi-agent specs)
    if n >= 4:
        reply = max(cfg.worker_max_tokens.values())
        chain = 3 * (C.WORKER_PROMPT_TOKENS + reply) + 2 * reply
        spec = parse_spec(Spec(_longest_spec(3).agents, "a3").to_yaml())
        assert compute_reward(spec, 1.0, chain, cfg.reward).token_efficiency >= 0.25


def test_overriding_max_agents_alone_is_refused():
    with pytest.raises(ValueError, match="reward.max_agents"):
        C.train_preset("cpu", max_agents=6)
    with pytest.raises(ValueError, match="cannot hold"):
        C.train_preset("cpu", max_completion_length=100)


def test_code_benchmarks_get_longer_reply_caps():
    """Defect 9: evaluation used the training reply caps, which cut every HumanEval reply of the coder workers."""
    from lemon.study.runner import study_preset
    from lemon.study.stages import eval_caps
    cfg = study_preset("cpu")
    assert eval_caps(cfg, "humaneval").max_tokens["medium"] >= 512 > cfg.train.worker_max_tokens["medium"]
    assert eval_caps(cfg, "gsm8k").max_tokens == domain_reply_caps(cfg.train.worker_max_tokens, "math")
    with pytest.raises(ValueError, match="domain"):
        domain_reply_caps({"small": 1}, "poetry")


def test_grammar_text_bounds_are_checked_and_reach_the_grammar():
    from lemon.spec.grammar import SpecGrammar
    from lemon.spec.schema import MAX_LEN
    with pytest.raises(ValueError, match="role_chars=1"):
        C.train_preset("smoke", role_chars=1)
    with pytest.raises(ValueError, match="duty_chars"):
        C.train_preset("smoke", duty_chars=MAX_LEN["duty"] + 1)
    cfg = C.train_preset("smoke", role_chars=12, duty_chars=24)
    g = SpecGrammar(("solver",), role_chars=cfg.role_chars, duty_chars=cfg.duty_chars)
    assert "{0,10}" in g.lark() and "{0,22}" in g.lark()  # the regex bounds the grammar compiles from


ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def test_paper_workers_are_written_once_in_the_yaml():
    """Issue 29, finding 7: the paper preset's workers (entries with their client settings, and reply caps) are
    configs/workers-paper.yaml's; lemon/train/config.py holds no second worker list."""
    import inspect
    import yaml
    y = yaml.safe_load((ROOT / "configs" / "workers-paper.yaml").read_text())
    cfg = C.train_preset("paper")
    assert cfg.workers == {k: v for k, v in y.items() if k != "max_tokens"}
    assert cfg.worker_max_tokens == y["max_tokens"]
    src = inspect.getsource(C)
    assert not any(w["base_url"] in src for w in cfg.workers.values()) and "8001" not in src
    assert "Qwen2.5-14B" not in src and "Qwen2.5-32B" not in src


def test_lemon_train_workers_flag_reaches_the_config(tmp_path, monkeypatch, capsys):
    """`lemon train --workers FILE`: the file's entries (timeout_s, max_concurrency, ...) reach the warm start's and the
    trainer's config and the pool build_pool makes from it; its max_tokens do not resize the profile (a note says
    so)."""
    import yaml
    import lemon.train.pipeline as pipeline
    from lemon.cli import main
    entry = {"backend": "openai", "base_url": "http://10.9.9.9:9000/v1", "model": "m", "timeout_s": 900,
             "max_concurrency": 7, "max_retries": 5, "backoff_s": 1.5}
    (tmp_path / "w.yaml").write_text(yaml.safe_dump({**{c: entry for c in ("small", "medium", "large")},
                                                      "max_tokens": {"small": 99, "medium": 99, "large": 99}}))
    seen = []
    monkeypatch.setattr(pipeline, "warm_start", lambda cfg, *a, **k: seen.append(cfg) or {
        "rows": 0, "valid_before": {"rate": 0.0}, "valid_after": {"rate": 0.0, "n": 0}, "adapter": "sft"})
    monkeypatch.setattr(pipeline, "train", lambda cfg, *a, **k: seen.append(cfg) or {"history": [], "adapter": "a"})
    assert main(["train", "--profile", "smoke", "--out", str(tmp_path / "run"), "--workers",
                 str(tmp_path / "w.yaml")]) == 0
    assert len(seen) == 2 and all(c.workers == {c_: entry for c_ in ("small", "medium", "large")} for c in seen)
    assert seen[1].worker_max_tokens == C.train_preset("smoke").worker_max_tokens
    assert "note" in capsys.readouterr().err
    pool = pipeline.build_pool(seen[1])  # OpenAI clients: nothing connects until a request
    try:
        b = pool.backends["medium"]
        assert (b._timeout_s, b.max_concurrency, b.max_retries, b.backoff_s) == (900, 7, 5, 1.5)
    finally:
        pool.close()
    assert main(["train", "--out", str(tmp_path / "r2"), "--workers", str(tmp_path / "missing.yaml")]) == 2


def test_deterministic_workers_reach_the_pool(monkeypatch):
    """Issue 30: the llama-server presets score with deterministic servers; build_pool hands `deterministic` to every
    server entry (or the embedded default's ServerConfig) and refuses it for a backend it cannot make deterministic."""
    from lemon.run.workers import WorkerPool
    from lemon.train.config import train_preset
    from lemon.train.pipeline import build_pool
    assert train_preset("smoke").deterministic_workers and train_preset("cpu").deterministic_workers
    assert not train_preset("paper").deterministic_workers  # vLLM workers: batch invariance is the server's setting
    seen = {}
    monkeypatch.setattr(WorkerPool, "from_config", classmethod(lambda cls, c, **kw: seen.setdefault("cfg", c)))
    monkeypatch.setattr(WorkerPool, "embedded_default",
                        classmethod(lambda cls, **kw: seen.setdefault("server", kw["server"])))
    build_pool(train_preset("smoke"))
    assert all(seen["cfg"][c]["deterministic"] is True for c in ("small", "medium", "large"))
    assert build_pool(train_preset("cpu")).deterministic is True
    seen.clear()
    build_pool(train_preset("smoke", deterministic_workers=False))
    assert "deterministic" not in seen["cfg"]["small"]
    with pytest.raises(ValueError, match=r"\['large'\] use other backends"):
        build_pool(train_preset("smoke", workers={**train_preset("smoke").workers,
                                                  "large": {"backend": "openai", "model": "m"}}))
