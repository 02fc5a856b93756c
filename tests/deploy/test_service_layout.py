"""The layout's promises: the core library never imports a service, no service imports another
or the test kit, each image installs only its own service, and the gateway runs without torch,
faiss or transformers (imported in the development environment, where they are installed, and
installed alone, as its image does (services/Dockerfile), in a fresh virtual environment)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from openbook_testkit import images

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("gateway", "retriever", "generator", "trainer")
MODEL_LIBRARIES = ("torch", "faiss", "transformers", "bm25s", "safetensors")
IMPORT = re.compile(r"^\s*(?:from|import)\s+([A-Za-z_][\w.]*)", re.MULTILINE)


def _imports(folder: Path) -> dict[str, set[str]]:
    """Top-level package of every import, per file under ``folder``."""
    return {
        str(path.relative_to(ROOT)): {m.split(".")[0] for m in IMPORT.findall(path.read_text())}
        for path in folder.rglob("*.py")
        if "_pb2" not in path.name
    }


def test_the_core_library_imports_no_service():
    banned = {f"openbook_{s}" for s in SERVICES} | {"openbook_cli", "openbook_testkit"}
    offenders = {f: i & banned for f, i in _imports(ROOT / "openbook").items() if i & banned}
    assert not offenders


@pytest.mark.parametrize("service", SERVICES)
def test_a_service_imports_the_core_and_itself_only(service):
    banned = {f"openbook_{s}" for s in SERVICES if s != service} | {
        "openbook_cli",
        "openbook_testkit",
    }
    package = ROOT / "services" / service / f"openbook_{service}"
    offenders = {f: i & banned for f, i in _imports(package).items() if i & banned}
    assert not offenders


def test_every_service_has_an_image():
    """services/Dockerfile: a target per service, named as the service."""
    assert set(SERVICES) <= set(images.stages())


@pytest.mark.parametrize("service", SERVICES)
def test_each_image_installs_only_its_service(service):
    lines = images.image(service)
    copied = [
        line.split()[1]
        for line in lines
        if line.startswith("COPY ") and not line.startswith("COPY --from=")
    ]
    assert {"pyproject.toml", "proto", "openbook"} <= set(copied), "the core library"
    assert not [c for c in copied if c.startswith("services") and c != f"services/{service}"]
    assert "constraints.txt" not in copied, "the root constraints pin every service's packages"
    # the gateway's image runs the deployment commands too (openbook-secrets: compose, k8s)
    deploy = " ./deploy" if service == "gateway" else ""
    assert [c for c in copied if c.startswith("deploy")] == (
        ["deploy/pyproject.toml", "deploy/openbook_deploy"] if deploy else []
    )
    installs = [line for line in lines if "pip install" in line]
    project = [line for line in installs if "torch==" not in line]
    assert project == [
        f"RUN pip install -c services/{service}/constraints.txt . ./services/{service}{deploy}"
    ]
    assert any("torch==" in line for line in installs) == (service != "gateway")


def test_service_constraints_are_current():
    """Each services/*/constraints.txt is its service's part of the root constraints.txt."""
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "service_constraints.py"), "--check"], check=True
    )


GATEWAY_CHECK = """
import importlib.util, sys
from openbook_gateway.app import create_app
from openbook_gateway.settings import GatewaySettings
import openbook.serving.health, openbook_gateway.__main__
create_app(GatewaySettings())
loaded = sorted(m for m in {libraries!r} if m in sys.modules)
assert not loaded, f"the gateway imported {{loaded}}"
installed = sorted(m for m in {libraries!r} if importlib.util.find_spec(m) is not None)
print("installed:", ",".join(installed))
"""


def _check_gateway(python: str) -> str:
    out = subprocess.run(
        [python, "-c", GATEWAY_CHECK.format(libraries=MODEL_LIBRARIES)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_the_gateway_imports_no_model_library():
    """Even where torch & co. are installed (here), building the app never imports them."""
    assert "torch" in _check_gateway(sys.executable)


def test_the_gateway_installs_and_starts_without_model_libraries(tmp_path):
    """Its image's install, in a fresh environment: none of them is even installed."""
    env_dir = tmp_path / "gateway-venv"
    # why no pip of its own, and --no-compile: the fresh environment gets exactly the Dockerfile's
    # packages, installed by this environment's pip (``--python``); seeding a pip into it and
    # byte-compiling every installed file took about half of this test's time (its import below
    # compiles what the gateway uses) and prove nothing the check below does not.
    venv.create(env_dir, with_pip=False)
    python = str(env_dir / "bin" / "python")
    (install,) = [line for line in images.image("gateway") if "pip install" in line]
    args = shlex.split(install.removeprefix("RUN "))
    assert args[:2] == ["pip", "install"]
    subprocess.run(
        [
            sys.executable, "-m", "pip", "--python", python, "install",
            "-q", "--disable-pip-version-check", "--no-compile", *args[2:],
        ],
        cwd=ROOT,
        check=True,
        timeout=900,
    )  # fmt: skip
    assert _check_gateway(python).strip() == "installed:"


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--config", "x.yaml"],  # docker-compose's trainer, the k8s trainer job
        ["demo", "prepare"],  # docker-compose's init, the k8s demo-prepare job
        ["index", "build"],  # the k8s index-build and index-build-parallel jobs
        ["index", "shard"],
        ["index", "join-shards"],  # index-build-parallel
        ["eval"],
        ["experiments", "qa"],
    ],
)
def test_the_jobs_commands_resolve(argv):
    """What compose and the k8s jobs run in the jobs image reaches the command it names.

    Resolved by the command group ``openbook-trainer`` runs (its ``main``), in this process:
    a process per command line only paid torch's import again each time;
    :func:`test_the_jobs_command_runs_as_a_module` runs that entry point in a process of its
    own."""
    from click.testing import CliRunner

    from openbook_trainer.__main__ import command_group

    out = CliRunner().invoke(command_group(), [*argv, "--help"], prog_name="openbook-trainer")
    assert out.exit_code == 0, out.output
    # without options and their values
    command = " ".join(a for a in argv if re.fullmatch(r"[a-z]+(-[a-z]+)*", a))
    assert f"Usage: openbook-trainer {command} [OPTIONS]" in " ".join(out.output.split())


def test_the_jobs_command_runs_as_a_module():
    """``python -m openbook_trainer``, as the jobs image runs it, reaches a sub-command: compose's
    trainer's command line, in a process of its own."""
    out = subprocess.run(
        [sys.executable, "-m", "openbook_trainer", "train", "--config", "x.yaml", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "Usage: openbook-trainer train [OPTIONS]" in " ".join(out.stdout.split())
