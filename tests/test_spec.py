"""Spec schema: parsing, named errors, fuzzing, levels, canonical YAML and character spans."""
import json
import textwrap
import random

import pytest
import yaml

from lemon import spec as S
from lemon.spec import SpecError, parse_spec, spec_from_dict

VALID = """agents:
  - id: plan
    base_role: planner
    role: Step planner
    duty: List the steps needed.
    capacity: small
    depends_on: []
  - id: calc
    base_role: calculator
    role: "Careful: calculator"
    duty: 'Compute each step''s result.'
    capacity: medium
    depends_on: [plan]
  - id: check
    base_role: verifier
    role: Checker
    duty: >-
      Re-derive the result
      independently.
    capacity: large
    depends_on:
      - plan
      - calc
final: check
"""


def test_parse_valid_and_levels():
    s = parse_spec(VALID)
    assert [a.id for a in s.agents] == ["plan", "calc", "check"]
    assert s.agent("calc").role == "Careful: calculator"
    assert s.agent("calc").duty == "Compute each step's result."
    assert s.agent("check").duty == "Re-derive the result independently."
    assert s.agent("check").depends_on == ("plan", "calc")
    assert s.levels() == [["plan"], ["calc"], ["check"]]
    assert s.edges() == [("plan", "calc"), ("plan", "check"), ("calc", "check")]
    assert s.unreachable() == []
    assert s.descendants("plan") == {"calc", "check"}


def test_final_defaults_to_last_and_unreachable_reported():
    s = parse_spec(VALID.replace("final: check\n", "").replace("depends_on:\n      - plan\n      - calc",
                                                               "depends_on: [plan]"))
    assert s.final == "check"
    assert s.unreachable() == ["calc"]
    s2 = parse_spec(VALID.replace("final: check", "final: calc"))
    assert s2.unreachable() == ["check"]
    assert s2.levels() == [["plan"], ["calc"], ["check"]]  # levels ignore final


@pytest.mark.parametrize("wrapper", [
    "```yaml\n{}```",
    "Here is the spec:\n```yaml\n{}```\nThis team should work.",
    "```\n{}```",
    "Sure! Below is my design.\n{}",
    "{}\nThat is all.",
    "```yaml\n{}",  # truncated closing fence
])
def test_accepts_wrapped_completions(wrapper):
    text = wrapper.format(VALID)
    s = parse_spec(text)
    assert s == parse_spec(VALID)
    # spans refer to the wrapped text, not to the extracted YAML
    a = s.spans[1]
    assert text[a.role[0]:a.role[1]] == '"Careful: calculator"'


def test_prose_only_is_no_yaml():
    with pytest.raises(S.NoYamlError):
        parse_spec("I would use a planner and then a solver.")


def _agent(**kw):
    d = dict(id="a", base_role="solver", role="R", duty="d", capacity="small", depends_on=[])
    d.update(kw)
    return d


def _doc(*agents, **top):
    return json.dumps({"agents": list(agents), **top})  # JSON is YAML


@pytest.mark.parametrize("text,err", [
    ("agents: [", S.YamlSyntaxError),
    ("- a\n- b\n", S.NoYamlError),
    ("agents: 3", S.WrongTypeError),
    ("agents: []", S.EmptyError),
    ("agents:\n  - just a string\n", S.NotMappingError),
    (_doc({"id": "a"}), S.MissingFieldError),
    (_doc(_agent(colour="red")), S.UnknownFieldError),
    (_doc(_agent(), extra=1), S.UnknownFieldError),
    ("agents:\n  - id: a\n    id: b\n    base_role: solver\n    role: r\n    duty: d\n    capacity: small\n",
     S.UnknownFieldError),
    (_doc(_agent(role=5)), S.WrongTypeError),
    (_doc(_agent(duty=["x"])), S.WrongTypeError),
    (_doc(_agent(depends_on="a")), S.WrongTypeError),
    (_doc(_agent(depends_on=[1])), S.WrongTypeError),
    (_doc(_agent(duty="   ")), S.EmptyError),
    (_doc(*[_agent(id=f"a{i}") for i in range(9)]), S.TooManyAgentsError),
    (_doc(_agent(), _agent()), S.DuplicateIdError),
    (_doc(_agent(id="1st")), S.BadIdError),
    (_doc(_agent(id="a b")), S.BadIdError),
    (_doc(_agent(depends_on=["zzz"])), S.UnknownDependencyError),
    (_doc(_agent(depends_on=["b"]), _agent(id="b")), S.ForwardDependencyError),
    (_doc(_agent(depends_on=["a"])), S.SelfDependencyError),
    (_doc(_agent(), _agent(id="b", depends_on=["a", "a"])), S.DuplicateDependencyError),
    (_doc(_agent(capacity="huge")), S.UnknownCapacityError),
    (_doc(_agent(base_role="wizard")), S.UnknownBaseRoleError),
    (_doc(_agent(), final="nobody"), S.BadFinalError),
    (_doc(_agent(), final=3), S.WrongTypeError),
    (_doc(_agent(duty="x" * 501)), S.TooLongError),
    ("agents:\n" + "  - x\n" * 5000, S.TooLongError),
    ("agents:\n  - &a {id: a, base_role: solver, role: r, duty: d, capacity: small}\n  - *a\n", S.YamlSyntaxError),
    ("agents: []\n---\nagents: []\n", S.YamlSyntaxError),
    ("agents:\n  - !!python/object:os.system {id: a}\n", S.WrongTypeError),
])
def test_named_errors(text, err):
    with pytest.raises(err) as e:
        parse_spec(text)
    assert isinstance(e.value, SpecError)
    assert e.value.code == err.code
    assert f"[{err.code}]" in str(e.value)


def test_error_says_where():
    with pytest.raises(S.UnknownCapacityError, match=r"agents\[1\] \(id 'b'\).*'huge'.*small, medium, large"):
        parse_spec(_doc(_agent(), _agent(id="b", capacity="huge")))


def test_non_string_input():
    with pytest.raises(S.WrongTypeError):
        parse_spec(b"agents: []")  # type: ignore[arg-type]


def test_custom_base_roles_and_max_agents():
    t = _doc(_agent(base_role="wizard"), _agent(id="b", base_role="wizard"))
    assert len(parse_spec(t, base_roles={"wizard"}).agents) == 2
    with pytest.raises(S.TooManyAgentsError):
        parse_spec(t, base_roles={"wizard"}, max_agents=1)


# ---- fuzz: >= 1000 malformed inputs; each parses or raises SpecError, nothing else escapes ---------------------------
def _mutations(rng: random.Random):
    base = [VALID, parse_spec(VALID).to_yaml(), _doc(_agent(), _agent(id="b", depends_on=["a"]))]
    for text in base:
        for cut in range(0, len(text), 3):  # truncations
            yield text[:cut]
    values = [1, 2.5, None, True, [], {}, ["x", 1], {"a": [1]}, "x" * 10_000, "", "é\u2028\x85", "- a"]
    for _ in range(300):  # type swaps on a random field
        d = yaml.safe_load(VALID)
        a = rng.choice(d["agents"])
        a[rng.choice(list(a) + ["new"])] = rng.choice(values)
        if rng.random() < 0.2:
            d[rng.choice(["agents", "final", "x"])] = rng.choice(values)
        yield json.dumps(d) if rng.random() < 0.5 else yaml.safe_dump(d)
    alphabet = ":-[]{}#&*!|>'\"%@`\n\t ,?abc0\x00\x07\ufeff"
    for _ in range(400):  # random character mutations
        t = list(rng.choice(base))
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(len(t))
            op = rng.random()
            if op < 0.4:
                t[i] = rng.choice(alphabet)
            elif op < 0.7:
                del t[i]
            else:
                t.insert(i, rng.choice(alphabet))
        yield "".join(t)
    for _ in range(100):  # binary and huge
        yield bytes(rng.randrange(256) for _ in range(rng.randint(1, 400))).decode("latin-1")
    yield "agents:\n" + "[" * 5000 + "]" * 5000
    yield "agents: " + "a" * 11_000
    yield "agents:\n  - {id: a, base_role: solver, role: r, duty: " + "y" * 600 + ", capacity: small}"


def test_fuzz_only_spec_errors():
    rng = random.Random(0)
    n = parsed = 0
    codes = set()
    for text in _mutations(rng):
        n += 1
        try:
            s = parse_spec(text)
            parsed += 1
            assert parse_spec(s.to_yaml()) == s
        except SpecError as e:
            codes.add(e.code)
    assert n >= 1000
    assert 0 < parsed < n
    assert len(codes) >= 8, codes


# ---- canonical YAML --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("duty", ["plain text.", "a: b", "has # hash", "yes", "123", "quote ' and \" both", "- dash",
                                  "ends with colon:", "multi\nline", "[not a list]", "{x}", "@at", "tab\there", "ünï"])
def test_to_yaml_roundtrip(duty):
    s = spec_from_dict({"agents": [_agent(duty=duty, role=duty.replace("\n", " ")), _agent(id="b", depends_on=["a"])]})
    assert s.agent("a").duty == duty.strip()
    y = s.to_yaml()
    assert parse_spec(y) == s
    assert y == parse_spec(y).to_yaml()  # deterministic fixed point


def test_json_schema_accepts_valid_spec():
    jsonschema = pytest.importorskip("jsonschema")
    schema = S.json_schema()
    d = parse_spec(VALID).to_dict()
    jsonschema.validate(d, schema)
    d["agents"][0]["capacity"] = "huge"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(d, schema)


# ---- spans -----------------------------------------------------------------------------------------------------------
STYLES = [
    VALID,
    # flow mappings and flow lists, double quotes
    '{"agents": [{"id": "p", "base_role": "planner", "role": "P", "duty": "Plan it.", "capacity": "small", '
    '"depends_on": []}, {"id": "s", "base_role": "solver", "role": "S r", "duty": "Solve it.", "capacity": "large", '
    '"depends_on": ["p"]}], "final": "s"}',
    # field order shuffled, no depends_on on the first agent, literal block duty, comments
    "agents:\n- capacity: small  # cheap\n  duty: |\n    Plan\n    it.\n  role: P\n  base_role: planner\n  id: p\n"
    "- id: s\n  depends_on: [ p ]\n  base_role: solver\n  role: 'S r'\n  duty: Solve it.\n  capacity: large\n",
]


@pytest.mark.parametrize("text", STYLES)
def test_spans_point_at_values(text):
    s = parse_spec(text)
    for a, sp in zip(s.agents, s.spans):
        for f in ("role", "duty", "capacity"):
            st, en = getattr(sp, f)
            frag = text[st:en]
            # the fragment, read back as a YAML scalar, is the parsed value
            assert yaml.safe_load(frag) .strip() == getattr(a, f), (f, frag)
        assert len(sp.deps) == len(a.depends_on)
        for d, (st, en) in zip(a.depends_on, sp.deps):
            assert yaml.safe_load(text[st:en]) == d
        if sp.depends_on is not None and a.depends_on:
            st, en = sp.depends_on
            # a block list read out of context needs its first line's indent back
            col = st - text.rfind("\n", 0, st) - 1
            assert yaml.safe_load(textwrap.dedent(" " * col + text[st:en])) == list(a.depends_on)
            assert not text[st:en].endswith(("\n", " "))


def test_json_escaped_emoji_is_joined_and_lone_surrogates_are_refused():
    """JSON-constrained output escapes an emoji as a surrogate pair; it must parse to the real character (a lone
    surrogate cannot be encoded, re-dumped or tokenized)."""
    import json as _json
    text = _json.dumps({"agents": [{"id": "a", "base_role": "solver", "role": "A", "duty": "Count the \U0001F600.",
                                    "capacity": "small"}]})
    assert "\\ud83d" in text
    spec = S.parse_spec(text)
    assert spec.agents[0].duty == "Count the \U0001F600." and S.parse_spec(spec.to_yaml()) == spec
    with pytest.raises(S.BadTextError):
        S.parse_spec(text.replace("\\ude00", ""))
