"""Worst-case text extraction of uploaded files, measured (issue 42): peak memory and time.

Each case is a file crafted to cost the most a format allows within the gateway's limits (a
32 MiB body, 1,000,000 characters of text, a Markdown source of at most that, a PDF's
1,000 pages, 64 MiB of content streams and 5,000,000 content operators, the 30 s deadline),
extracted by ``openbook_gateway.extraction.extract`` (what ``POST /indexes/{i}/documents``
runs) in a fresh process of its own, so that one case's peak is not another's. Reported per
case: the input's size, whether it was accepted or refused (and the status), the wall time,
and the peak resident memory the extraction added to the process (its high-water mark, less
the memory held once the input was made), as a multiple of the input's size, beside the bound
issue 42 states: 20 times the input plus 200 MB, and 30 s.

    .venv/bin/python bench/ingest/extraction_worst.py [--only markdown]
        [--json docs/bench/extraction-worst-<date>.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

MB = 1024 * 1024
BOUND_RATIO, BOUND_EXTRA_MB, BOUND_SECONDS = 20, 200, 30.0


def _markdown_cases() -> dict[str, str]:
    """Expressions (evaluated in the child) of the Markdown worst cases: the source at its
    limit (1,000,000 characters, max_markdown_source_ratio 1) or its text at the text limit."""
    return {
        "markdown: a flat list (the issue's '- a')": "b'- a\\n' * 249_000",
        "markdown: nested lists": "b''.join(b'  ' * (i % 16) + b'- a\\n' for i in range(52_000))",
        "markdown: emphasis and links": "b'*a* [b](c) `d` ' * 62_000",
        "markdown: nested quotes": "(b'> ' * 15 + b'a\\n') * 31_000",
        "markdown: a table": "b'|a|b|\\n|-|-|\\n' + b'|a|b|\\n' * 165_000",
        "markdown: one paragraph": "b'word ' * 199_000",
    }


def _html_cases() -> dict[str, str]:
    return {
        "html: empty elements, 30 MiB (no text)": (
            "b'<html><body>' + b'<div></div>' * (30 * 1024 * 1024 // 11) + b'</body></html>'"
        ),
        "html: nested 100,000 deep": (
            "b'<html><body>' + b'<div>' * 100_000 + b'a' + b'</div>' * 100_000 + b'</body></html>'"
        ),
        "html: paragraphs to the text limit": (
            "b'<html><body>' + b'<p>word word</p>' * 95_000 + b'</body></html>'"
        ),
        "html: a table, 30 MiB": (
            "b'<html><body><table>' + b'<tr><td></td><td></td></tr>' * (30 * 1024 * 1024 // 27)"
            " + b'</table></body></html>'"
        ),
    }


def _pdf_cases() -> dict[str, str]:
    return {
        "pdf: 1,000 pages of 5,000 operators (the operator budget)": (
            "distinct_streams_pdf([text_operations('Page words', 5_000)] * 1000)"
        ),
        "pdf: one 60 MiB content stream (the content budget)": (
            "distinct_streams_pdf([b'BT /F1 12 Tf 72 720 Td (a) Tj ET\\n'"
            " + b'% ' + b'x' * (60 * 1024 * 1024) + b'\\n'])"
        ),
        "pdf: 1,000 pages sharing one stream": (
            "shared_stream_pdf(1000, text_operations('Shared words', 4_000))"
        ),
    }


def _text_cases() -> dict[str, str]:
    return {
        "txt: 1,000,000 characters (accepted)": "b'word ' * 199_999",
        "txt: 32 MiB (refused)": "b'word ' * (32 * 1024 * 1024 // 5)",
    }


CASES = {
    "markdown": _markdown_cases,
    "html": _html_cases,
    "pdf": _pdf_cases,
    "txt": _text_cases,
}
NAMES = {"markdown": "case.md", "html": "case.html", "pdf": "case.pdf", "txt": "case.txt"}

_CHILD = r"""
import json, resource, time
from openbook_testkit.crafted_pdf import distinct_streams_pdf, shared_stream_pdf, text_operations
from openbook_gateway.extraction import ExtractionError, extract

def rss_mb():
    with open('/proc/self/statm') as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20

data = {expr}
before = rss_mb()
started = time.perf_counter()
try:
    out = extract(data, {name!r})
    outcome, chars = 'accepted', len(out.text)
except ExtractionError as exc:
    outcome, chars = f'refused {{exc.status}}: {{str(exc)[:90]}}', 0
seconds = time.perf_counter() - started
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps(dict(size_mb=len(data) / 2**20, outcome=outcome, chars=chars,
                      seconds=seconds, held_mb=before, peak_mb=peak)))
"""


def run_case(kind: str, label: str, expr: str) -> dict:
    code = _CHILD.format(expr=expr, name=NAMES[kind])
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=False
    )
    if done.returncode != 0:
        return {"kind": kind, "case": label, "error": done.stderr[-500:]}
    result = json.loads(done.stdout.strip().splitlines()[-1])
    added = max(0.0, result["peak_mb"] - result["held_mb"])
    size = result["size_mb"]
    bound = BOUND_RATIO * size + BOUND_EXTRA_MB
    return {
        "kind": kind,
        "case": label,
        **result,
        "added_mb": added,
        "added_per_input": added / size if size else None,
        "bound_mb": bound,
        "memory_within": added <= bound,
        "time": time_verdict(result["seconds"], result["outcome"]),
    }


def time_verdict(seconds: float, outcome: str) -> str:
    """'within' 30 s; 'deadline' when the extraction's own deadline refused it (30 s and
    at most one step more: the deadline is checked between blocks, chunks and pages, and
    every few thousand PDF operators); 'OVER' otherwise."""
    if seconds <= BOUND_SECONDS:
        return "within"
    return "deadline" if "took more than" in outcome else "OVER"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=sorted(CASES), action="append", default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    rows = []
    for kind in args.only or list(CASES):
        for label, expr in CASES[kind]().items():
            row = run_case(kind, label, expr)
            rows.append(row)
            if "error" in row:
                print(f"{label}: failed: {row['error']}", flush=True)
                continue
            print(
                f"{label}: {row['size_mb']:.1f} MiB, {row['outcome'][:60]}, "
                f"{row['seconds']:.1f} s, +{row['added_mb']:.0f} MiB "
                f"({row['added_per_input']:.1f}x; bound {row['bound_mb']:.0f} MiB: "
                f"{'within' if row['memory_within'] else 'OVER'}), time: {row['time']}",
                flush=True,
            )
    report = {
        "benchmark": "extraction-worst-case",
        "when": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "bound": {
            "added_mb": f"{BOUND_RATIO} x input + {BOUND_EXTRA_MB}",
            "seconds": BOUND_SECONDS,
        },
        "cases": rows,
    }
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
