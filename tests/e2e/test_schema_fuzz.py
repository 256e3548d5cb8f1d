"""The server fuzzed against its own OpenAPI description over real HTTP (schemathesis): no 5xx,
every status, content type and JSON body as described. A fixed seed and a bounded number of cases
per operation keep it repeatable and short."""

from __future__ import annotations

import schemathesis
from schemathesis.config import SchemathesisConfig

from server.app import create_app
from server.config import ServerConfig
from server.runner import ServerThread

# The document only: the app is never started, its model never loaded.
_DOCUMENT = create_app(ServerConfig(engine={"model": "unused"})).openapi()
_CONFIG = SchemathesisConfig.from_dict(
    {
        "seed": 20261123,
        "generation": {"max-examples": 40, "deterministic": True},
        "phases": {"coverage": {"enabled": False}, "stateful": {"enabled": False}},
        # what the schema cannot say (token ids within the vocabulary, an empty prompt, a context
        # too long) is a 400 for a schema-valid body
        "checks": {"positive_data_acceptance": {"enabled": False}},
    }
)
schema = schemathesis.openapi.from_dict(_DOCUMENT, config=_CONFIG)
_GENERATION = {"/v1/completions", "/v1/chat/completions"}


@schema.parametrize()
def test_every_operation_answers_as_described(case, tiny_server: ServerThread) -> None:
    if case.path in _GENERATION and isinstance(case.body, dict):
        # generated bodies may ask for long generations: keep each case short on a tiny model
        for name in ("max_tokens", "max_completion_tokens"):
            if isinstance(case.body.get(name), int) and case.body[name] > 8:
                case.body[name] = 8
    response = case.call(base_url=tiny_server.url, timeout=60)
    case.validate_response(response)
