"""Installs are reproducible: CI and `make` install from constraints.txt, each image from its
service's constraints.txt (its part of the root file); every dependency any package declares
is pinned (adding one without re-pinning fails here)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from openbook_testkit import images

ROOT = Path(__file__).resolve().parents[2]
# Pinned where it is installed (scripts/install.sh, services/Dockerfile), from a CPU or CUDA index.
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


# tests/ and bench/: the development-only test kit and benchmarks (scripts/install.sh).
PYPROJECTS = [
    "pyproject.toml",
    "cli/pyproject.toml",
    "tests/pyproject.toml",
    "bench/pyproject.toml",
] + sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("services/*/pyproject.toml"))


def test_every_declared_dependency_is_pinned():
    declared = []
    for path in PYPROJECTS:
        project = tomllib.loads((ROOT / path).read_text())["project"]
        declared.extend(project["dependencies"])
        for extra in project.get("optional-dependencies", {}).values():
            declared.extend(extra)
    pins = _pins()
    ours = {n for n in map(_name, declared) if n == "openbook" or n.startswith("openbook-")}
    missing = sorted({_name(r) for r in declared} - ours - set(pins) - PINNED_ELSEWHERE)
    assert not missing, f"not pinned in constraints.txt (scripts/update-constraints.sh): {missing}"
    assert not PINNED_ELSEWHERE & set(pins)


@pytest.mark.parametrize(
    ("path", "constraints"),
    [
        ("scripts/install.sh", "constraints.txt"),
        # each service's image: its target of services/Dockerfile
        *(
            (f"services/Dockerfile:{p.parent.name}", f"services/{p.parent.name}/constraints.txt")
            for p in sorted(ROOT.glob("services/*/constraints.txt"))
        ),
    ],
)
def test_every_install_uses_the_constraints(path, constraints):
    file, _, target = path.partition(":")
    lines = images.image(target) if target else (ROOT / file).read_text().splitlines()
    installs = [
        line
        for line in lines
        if "pip install" in line and "torch==" not in line and "--upgrade pip" not in line
    ]
    assert installs, f"{path}: no pip install found"
    assert all(f"-c {constraints}" in line for line in installs), installs
