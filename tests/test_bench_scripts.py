"""Every benchmark's one command still starts: its imports resolve (the test kit lives under
tests/, not in the package) and it parses its arguments. The benchmarks themselves run outside
CI (docs/benchmarks.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


# every script under bench/ that runs as a command
SCRIPTS = sorted(
    str(p.relative_to(ROOT))
    for p in ROOT.glob("bench/*/*.py")
    if 'if __name__ == "__main__"' in p.read_text()
)


def test_every_benchmark_is_found():
    assert {"bench/generator/engine.py", "bench/generator/llamacpp.py"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_bench_script_starts(script):
    out = subprocess.run(
        [sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage:")
