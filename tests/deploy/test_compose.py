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

from openbook_testkit import images

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


# Linux's default net.ipv4.ip_local_port_range: ports the kernel hands to client sockets. A
# service port in it can be taken by some outgoing connection while the service restarts.
EPHEMERAL_PORTS = range(32768, 61000)
PUBLISHED = {"gateway"}


def _compose(env: dict[str, str] | None = None) -> dict:
    return interpolate(yaml.safe_load((ROOT / "docker-compose.yml").read_text()), env or {})


def test_every_built_image_is_its_target_of_the_services_dockerfile():
    """Each service compose builds names the target of services/Dockerfile whose image it runs
    (openbook/<target>, the name the k8s manifests use), built from the repository root."""
    targets = images.stages()
    built = {n: s for n, s in _compose()["services"].items() if "build" in s}
    assert {"secrets", "init", "retriever", "generator", "gateway", "trainer"} <= set(built)
    for name, service in built.items():
        build = service["build"]
        assert (build["context"], build["dockerfile"]) == (".", "services/Dockerfile"), name
        assert build["target"] in targets, name
        assert service["image"].startswith(f"openbook/{build['target']}:"), name
    # the GPU overlay's build argument reaches the stage that installs torch
    gpu = yaml.safe_load((ROOT / "docker-compose.gpu.yml").read_text())["services"]
    lines = images.image(built["generator"]["build"]["target"])
    for arg in gpu["generator"]["build"]["args"]:
        assert any(line.startswith(f"ARG {arg}=") for line in lines), arg


def test_only_the_gateway_is_published_on_the_host():
    # Redis and the gRPC services (whose admin RPCs change what the gateway serves) are
    # reachable over the compose network only.
    services = _compose()["services"]
    assert {name for name, svc in services.items() if svc.get("ports")} == PUBLISHED
    assert not any(svc.get("network_mode") == "host" for svc in services.values())
    (gateway_port,) = services["gateway"]["ports"]
    assert gateway_port == "8000:8000"
    assert not any("expose" in svc for svc in services.values())


def test_services_listen_on_the_container_network_and_share_the_admin_token():
    services = _compose({"OPENBOOK_ADMIN_TOKEN": "t0ken"})["services"]
    for name in ("gateway", "retriever", "generator"):
        env = services[name]["environment"]
        assert env[f"OPENBOOK_{name.upper()}_HOST"] == "0.0.0.0", name
        assert env["OPENBOOK_ADMIN_TOKEN"] == "t0ken", name
    assert "--bind 0.0.0.0" in services["redis"]["command"]


def test_default_ports_are_outside_the_ephemeral_range():
    from openbook_gateway.settings import GatewaySettings
    from openbook_generator.settings import GeneratorSettings
    from openbook_retriever.settings import RetrieverSettings

    def defaults(cls) -> dict:
        return {name: field.default for name, field in cls.model_fields.items()}

    gateway = defaults(GatewaySettings)
    retriever, generator = defaults(RetrieverSettings), defaults(GeneratorSettings)
    ports = {
        "gateway": gateway["port"],
        "retriever": retriever["port"],
        "generator": generator["port"],
        "retriever metrics": retriever["metrics_port"],
        "generator metrics": generator["metrics_port"],
        "retriever addr": int(gateway["retriever_addr"].rsplit(":", 1)[1]),
        "generator addr": int(gateway["generator_addr"].rsplit(":", 1)[1]),
        "redis": int(gateway["redis_url"].rsplit(":", 1)[1].split("/")[0]),
    }
    # The gateway's defaults find the services on their own default ports.
    assert ports["retriever addr"] == ports["retriever"]
    assert ports["generator addr"] == ports["generator"]
    services = _compose()["services"]
    for name in ("gateway", "retriever", "generator"):
        env = services[name]["environment"]
        ports[f"compose {name}"] = int(env[f"OPENBOOK_{name.upper()}_PORT"])
    for name, port in ports.items():
        assert port >= 1024 and port not in EPHEMERAL_PORTS, (name, port)
    gateway_env = services["gateway"]["environment"]
    assert gateway_env["OPENBOOK_GATEWAY_RETRIEVER_ADDR"] == "retriever:8051"
    assert gateway_env["OPENBOOK_GATEWAY_GENERATOR_ADDR"] == "generator:8052"


def test_redis_is_authenticated_and_every_client_has_the_secrets():
    """compose runs Redis with the ACL file the one-shot `secrets` step makes on first start,
    healthy only when openbook's password gets in; every service that talks to Redis mounts
    the secrets and is told where the password and server key are (issue 29)."""
    doc = interpolate(yaml.safe_load((ROOT / "docker-compose.yml").read_text()), {})
    services = doc["services"]
    secrets = services["secrets"]
    assert secrets["command"].startswith("openbook-secrets init --dir /var/openbook/secrets")
    assert secrets["restart"] == "no"
    assert any(v.endswith(":/var/openbook/secrets") for v in secrets["volumes"])  # writable

    redis = services["redis"]
    assert redis["depends_on"]["secrets"]["condition"] == "service_completed_successfully"
    command = redis["command"].split()
    assert command[command.index("--aclfile") + 1] == "/var/openbook/secrets/redis-users.acl"
    assert "./var/secrets:/var/openbook/secrets:ro" in redis["volumes"]
    health = redis["healthcheck"]["test"]
    assert health[0] == "CMD-SHELL"
    assert "--user openbook --askpass" in health[1] and "grep -qx openbook" in health[1]
    assert "< /var/openbook/secrets/redis-password" in health[1]

    for name, service in services.items():
        env = service.get("environment") or {}
        if "OPENBOOK_REDIS_URL" not in env:
            continue
        assert env["OPENBOOK_REDIS_USERNAME"] == "openbook", name
        assert env["OPENBOOK_REDIS_PASSWORD_FILE"] == "/var/openbook/secrets/redis-password"
        assert env["OPENBOOK_SERVER_KEY_FILE"] == "/var/openbook/secrets/server-key", name
        assert "./var/secrets:/var/openbook/secrets:ro" in service["volumes"], name
        # The secrets exist before the service starts: it waits (directly or through another)
        # for the secrets step.
        waits, seen = set(service.get("depends_on") or {}), set()
        while waits - seen:
            dep = (waits - seen).pop()
            seen.add(dep)
            waits |= set(services[dep].get("depends_on") or {})
        assert "secrets" in seen or name == "trainer", name
