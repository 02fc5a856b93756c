"""docker-compose.yml (and the GPU overlay) validate against the Compose Specification schema.

The schema is vendored (deploy/schemas/compose-spec.json, see its README): no network needed.
Files are checked as written and after ${VAR:-default} interpolation with an empty
environment, which is what `docker compose config` would validate.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "deploy" / "schemas" / "compose-spec.json"
SCHEMA_SHA256 = "d549057ebc2925f39f62799eab0db7b9e2c18b35b6c00595199116da3ed10e64"
COMPOSE_FILES = ["docker-compose.yml", "docker-compose.gpu.yml"]

_VAR = re.compile(
    r"\$(?:\$|\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\})"
)


def interpolate(value, env: dict[str, str]):
    """Compose's ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?err}, ${VAR:+alt} and $$."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, arg = m.group("name"), m.group("op"), m.group("arg") or ""
        val = env.get(name)
        if op in (":-", "-"):
            return arg if (val is None or (op == ":-" and val == "")) else val
        if op in (":+", "+"):
            return arg if (val is not None and (op == "+" or val != "")) else ""
        if op in (":?", "?") and (val is None or (op == ":?" and val == "")):
            raise AssertionError(f"required variable {name} unset: {arg}")
        return val or ""

    return _VAR.sub(sub, value)


@pytest.fixture(scope="module")
def validator():
    raw = SCHEMA.read_bytes()
    assert hashlib.sha256(raw).hexdigest() == SCHEMA_SHA256, "vendored schema changed"
    schema = json.loads(raw)
    assert schema["title"] == "Compose Specification"
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def _errors(validator, doc) -> list[str]:
    return [
        f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
        for e in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.path)))
    ]


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_compose_file_matches_the_compose_spec(validator, name):
    doc = yaml.safe_load((ROOT / name).read_text())
    assert _errors(validator, doc) == []
    assert _errors(validator, interpolate(doc, {})) == []


def test_the_validator_catches_mistakes(validator):
    doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    broken = copy.deepcopy(doc)
    broken["services"]["gateway"]["helthcheck"] = broken["services"]["gateway"].pop("healthcheck")
    broken["services"]["redis"]["ports"] = {"6379": 6379}
    broken["services"]["retriever"]["depends_on"]["redis"]["condition"] = "service_happy"
    errors = _errors(validator, broken)
    assert any("gateway" in e and "helthcheck" in e for e in errors), errors
    assert any(e.startswith("services/redis/ports") for e in errors), errors
    assert any("service_happy" in e for e in errors), errors


def test_interpolation_uses_defaults_and_environment():
    assert interpolate("${A:-1}:${B-2}:$${C}", {}) == "1:2:${C}"
    assert interpolate("${A:-1}", {"A": ""}) == "1"
    assert interpolate("${A-1}", {"A": ""}) == ""
    assert interpolate("${A:+x}${B:+y}", {"A": "v"}) == "x"
    assert interpolate({"p": ["${P:-8000}:8000"]}, {"P": "9"}) == {"p": ["9:8000"]}
