"""The named errors of spec parsing: one SpecError subclass per failure, each with a stable machine-readable `code`
(logged per training step as spec/invalid_<code>, so a run shows WHY its rollouts were invalid)."""
from __future__ import annotations


class SpecError(ValueError):
    """Any invalid spec. `code` is stable and machine-readable; the message says what and where."""

    code = "invalid"

    def __init__(self, message: str, where: str = ""):
        self.where = where
        super().__init__(f"[{self.code}] {where + ': ' if where else ''}{message}")


def _err(code_: str, doc: str) -> type[SpecError]:
    return type(f"Spec{''.join(w.title() for w in code_.split('_'))}Error", (SpecError,),
                {"code": code_, "__doc__": doc})


NoYamlError = _err("no_yaml", "The text holds no spec (no `agents:` block and no fenced YAML).")
YamlSyntaxError = _err("yaml_syntax", "The YAML does not parse (or uses anchors/aliases or several documents).")
NotMappingError = _err("not_mapping", "The document or an agent is not a mapping.")
MissingFieldError = _err("missing_field", "A required field is absent.")
UnknownFieldError = _err("unknown_field", "A field that the schema does not know, or a duplicated key.")
WrongTypeError = _err("wrong_type", "A field has the wrong type (e.g. a number where a string is expected).")
EmptyError = _err("empty", "No agents, or an empty string value.")
TooManyAgentsError = _err("too_many_agents", "More agents than max_agents.")
DuplicateIdError = _err("duplicate_id", "Two agents share an id.")
BadIdError = _err("bad_id", "An id is not a short slug (letter, then letters, digits, _ or -).")
UnknownDependencyError = _err("unknown_dependency", "depends_on names an agent that does not exist.")
ForwardDependencyError = _err("forward_dependency", "depends_on names a later agent (this is what rules out cycles).")
SelfDependencyError = _err("self_dependency", "An agent depends on itself.")
DuplicateDependencyError = _err("duplicate_dependency", "depends_on lists the same agent twice.")
UnknownCapacityError = _err("unknown_capacity", "capacity is not small / medium / large.")
UnknownBaseRoleError = _err("unknown_base_role", "base_role is not in the base-role library.")
BadFinalError = _err("bad_final", "final does not name an agent.")
TooLongError = _err("too_long", "A field (or the whole text) is longer than allowed.")
BadTextError = _err("bad_text",
                    "A string holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape): not text.")
