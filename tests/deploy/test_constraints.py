"""Installs are reproducible: CI, `make` and every image install from constraints.txt, and it
pins every dependency the project declares (adding one without re-pinning fails here)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Pinned where it is installed (scripts/install.sh, the Dockerfiles), from a CPU or CUDA index.
PINNED_ELSEWHERE = {"torch"}


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, sep, version = line.partition("==")
            assert sep, f"constraints.txt: {line!r} is not an exact pin"
            pins[name.lower().replace("_", "-")] = version
    return pins


def test_every_declared_dependency_is_pinned():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        declared.extend(extra)
    pins = _pins()
    missing = sorted({_name(r) for r in declared} - set(pins) - PINNED_ELSEWHERE)
    assert not missing, f"not pinned in constraints.txt (scripts/update-constraints.sh): {missing}"
    assert not PINNED_ELSEWHERE & set(pins)


@pytest.mark.parametrize(
    "path",
    [
        "scripts/install.sh",
        *sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("services/*/Dockerfile")),
    ],
)
def test_every_install_uses_the_constraints(path):
    text = (ROOT / path).read_text()
    installs = [
        line
        for line in text.splitlines()
        if "pip install" in line and "torch==" not in line and "--upgrade pip" not in line
    ]
    assert installs, f"{path}: no pip install found"
    assert all("-c constraints.txt" in line for line in installs), installs
