"""README's layout section and docs/architecture.md describe the tree as it is: every path they
name exists, and every package of the core library and every service is named."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PATH_LIKE = re.compile(r"^[\w.<>-]+(/[\w.<>-]*)*$")


def _layout_paths() -> list[str]:
    """Paths of the README's layout block: a top-level entry, or (indented) one under the last
    top-level entry; several per line where they are separated by two spaces."""
    text = (ROOT / "README.md").read_text()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    paths, parent = [], ""
    for line in block.splitlines():
        if not line.strip():
            continue
        indented = line.startswith("  ")
        names = re.split(r"\s{2,}", line.strip())
        for name in names:
            if not PATH_LIKE.match(name) or not ("/" in name or name.endswith(".py")):
                break
            paths.append(parent + name if indented else name)
        if not indented and names and names[0].endswith("/"):
            parent = names[0].split("<", 1)[0]  # services/<name>/: its entries are services/
    return paths


def test_every_path_in_the_readme_layout_exists():
    paths = _layout_paths()
    assert len(paths) > 15
    missing = [
        p
        for p in paths
        if "<" not in p and not (ROOT / p).exists()  # services/<name>/ stands for each
    ]
    assert not missing


def test_the_readme_layout_names_every_package_and_service():
    named = set(_layout_paths())
    generated = {"v1"}  # the build writes the gRPC stubs there
    packages = {
        f"openbook/{p.parent.name}/"
        for p in (ROOT / "openbook").glob("*/__init__.py")
        if p.parent.name not in generated
    }
    services = {f"services/{p.name}/" for p in (ROOT / "services").iterdir() if p.is_dir()}
    assert not packages - named
    assert not services - named


def test_architecture_names_only_files_that_exist():
    text = (ROOT / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`((?:openbook|services|cli|tests|scripts|proto)[\w/.-]*)`", text))
    prefixes = {
        f"openbook_{s}/": f"services/{s}/openbook_{s}/"
        for s in ("gateway", "retriever", "generator", "trainer")
    }
    for short, full in prefixes.items():
        named |= {full + rest for rest in re.findall(rf"`{re.escape(short)}([\w/.-]*)`", text)}
    checked = [p for p in named if "/" in p and not p.startswith(tuple(prefixes))]
    assert len(checked) > 20
    missing = sorted(p for p in checked if not (ROOT / p).exists())
    assert not missing
