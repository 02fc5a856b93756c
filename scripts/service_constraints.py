"""Write (or ``--check``) each service's constraints file: the subset of the root
``constraints.txt`` that the service's own dependency closure needs.

Every image installs only its service (its target of ``services/Dockerfile``) with the exact
versions of ``services/<name>/constraints.txt``; the root file pins the development environment,
which holds all services. The closure is read from the installed metadata of ``.venv`` (each service
is installed editable by scripts/install.sh), following extras and environment markers, so a
service's file lists exactly the packages its image gets (torch aside: pinned where installed).

    .venv/bin/python scripts/service_constraints.py          # rewrite the four files
    .venv/bin/python scripts/service_constraints.py --check  # exit 1 if one is stale
"""

from __future__ import annotations

import argparse
import re
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
SERVICES = ("gateway", "retriever", "generator", "trainer")
PINNED_ELSEWHERE = {"torch"}  # installed first, from a CPU or CUDA index (services/Dockerfile)
# What an image installs beside its service: the gateway's runs the deployment commands too
# (deploy/: openbook-secrets, for compose's `secrets` service and the k8s Job).
ALSO_INSTALLED = {"gateway": ("openbook-deploy",)}
HEADER = (
    "# Exact versions the {service} image installs: the part of ../../constraints.txt that\n"
    "# its dependency closure needs. Written by scripts/service_constraints.py; do not edit.\n"
)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(distribution: str) -> set[str]:
    """Canonical names of every distribution ``distribution`` needs, itself included."""
    seen: set[str] = set()
    todo: list[tuple[str, frozenset[str]]] = [(distribution, frozenset())]
    expanded: set[tuple[str, frozenset[str]]] = set()
    while todo:
        name, extras = todo.pop()
        if (canonical(name), extras) in expanded:
            continue
        expanded.add((canonical(name), extras))
        seen.add(canonical(name))
        if canonical(name) in PINNED_ELSEWHERE:
            continue  # what torch needs comes with torch, from its own index
        for line in metadata.requires(name) or []:
            req = Requirement(line)
            wanted = extras or frozenset({""})
            if req.marker and not any(req.marker.evaluate({"extra": e}) for e in wanted):
                continue
            todo.append((req.name, frozenset(req.extras)))
    return seen


def root_pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, _ = line.partition("==")
            pins[canonical(name)] = line.strip()
    return pins


def service_constraints(service: str, pins: dict[str, str]) -> str:
    needed = closure(f"openbook-{service}")
    for extra in ALSO_INSTALLED.get(service, ()):
        needed |= closure(extra)
    own = {n for n in needed if n == "openbook" or n.startswith("openbook-")}
    missing = sorted(needed - own - PINNED_ELSEWHERE - set(pins))
    if missing:
        raise SystemExit(f"{service}: not pinned in constraints.txt: {', '.join(missing)}")
    lines = sorted(pins[n] for n in needed - own - PINNED_ELSEWHERE)
    return HEADER.format(service=service) + "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a file is stale")
    args = parser.parse_args()
    pins = root_pins()
    stale = []
    for service in SERVICES:
        path = ROOT / "services" / service / "constraints.txt"
        text = service_constraints(service, pins)
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(str(path.relative_to(ROOT)))
        else:
            path.write_text(text)
            count = sum(1 for line in text.splitlines() if not line.startswith("#"))
            print(f"{path.relative_to(ROOT)}: {count} packages")
    if stale:
        print(f"stale (run scripts/service_constraints.py): {', '.join(stale)}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
