"""Estimate each service image's size from what it installs: the installed size of every
distribution in the service's closure (scripts/service_constraints.py), measured in .venv,
plus torch where the service needs it, on top of the python:3.11-slim base.

    .venv/bin/python scripts/image_sizes.py   # a Markdown table (docs/architecture.md)

An estimate: the image also holds pip's own files and the copied sources (a few MB), and the
GPU build's torch is several GB larger than the CPU build measured here.
"""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from service_constraints import SERVICES, canonical, closure  # noqa: E402

BASE_IMAGE_MB = 125  # python:3.11-slim, uncompressed (docker image ls)


def installed_mb(distribution: str) -> float:
    dist = metadata.distribution(distribution)
    total = 0
    for file in dist.files or []:
        path = Path(dist.locate_file(file))
        if path.is_file():
            total += path.stat().st_size
    return total / 2**20


def main() -> None:
    print("| image | distributions | packages (MB) | of which torch (MB) | estimate (MB) |")
    print("|---|---:|---:|---:|---:|")
    for service in SERVICES:
        names = sorted(n for n in closure(f"openbook-{service}") if not n.startswith("openbook"))
        sizes = {n: installed_mb(n) for n in names}
        torch = sizes.get(canonical("torch"), 0.0)
        total = sum(sizes.values())
        print(
            f"| openbook/{service} | {len(names)} | {total:,.0f} | {torch:,.0f} "
            f"| {total + BASE_IMAGE_MB:,.0f} |"
        )


if __name__ == "__main__":
    main()
