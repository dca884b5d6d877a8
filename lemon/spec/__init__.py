"""The orchestration spec (paper §3.1): `schema` (dataclasses, parsing, validation, DAG levels, canonical YAML, JSON
schema), `errors` (one named SpecError subclass per failure), `yamlio` (finding the YAML in a completion, PyYAML's node
tree with character spans). The public names are re-exported here:
`from lemon.spec import parse_spec, Spec, SpecError`."""
from lemon.spec.errors import *  # noqa: F401,F403  (every SpecError subclass)
from lemon.spec.errors import SpecError  # noqa: F401
from lemon.spec.schema import (AGENT_FIELDS, ID_RE, MAX_AGENTS, MAX_LEN, MAX_TEXT_CHARS, REQUIRED_FIELDS,  # noqa: F401
                               Agent, AgentSpans, Spec, json_schema, parse_spec, spec_from_dict)
from lemon.spec.yamlio import Span, extract_yaml  # noqa: F401
