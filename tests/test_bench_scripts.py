"""Every benchmark's one command still starts: its imports resolve (the test kit lives under
tests/, not in the package) and it parses its arguments. The benchmarks themselves run outside
CI (docs/benchmarks.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "script", sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("bench/*/run.py"))
)
def test_bench_script_starts(script):
    out = subprocess.run(
        [sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage:")
