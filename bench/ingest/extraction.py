"""Text extraction of uploaded files, measured (issue 33): pages/s for PDF and HTML.

The corpus is generated here, real-world-shaped (``openbook_testkit.files``): ``--pdfs``
reports of ``--pages`` pages (~350 words a page, a running header, a "Page n of N" footer, a
title in the metadata; fpdf2) and ``--html`` web pages (a navigation bar of 12 links, a cookie
banner, a sidebar, a footer, a script and a style around an 8-paragraph article). Each file
is extracted by ``openbook_gateway.extraction.extract``, what ``POST /indexes/{i}/documents``
runs, in this process, one file at a time, ``--rounds`` times (the best round is kept, so a
busy neighbour on shared cores counts least).

Each rate comes with a reference measured in the same run, as a ratio:

- **PDF**: pypdf's bare ``page.extract_text()`` over the same files: what openbook adds
  (sniffing, cleaning control characters, per-page word counts) is the difference.
- **HTML**: trafilatura's ``html2txt`` (all of the body's text, no main-content detection):
  what finding the article and dropping navigation costs.

    .venv/bin/python bench/ingest/extraction.py [--pdfs 10 --pages 20 --html 100]
        [--json docs/bench/extraction-<date>.json]
"""

from __future__ import annotations

import argparse
import io
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path

import pypdf
import trafilatura

from openbook_gateway.extraction import extract
from openbook_testkit import files


def best_rate(work: Callable[[], int], rounds: int) -> tuple[float, int]:
    """(units/s of the fastest round, units per round)."""
    best, units = float("inf"), 0
    for _ in range(rounds):
        started = time.perf_counter()
        units = work()
        best = min(best, time.perf_counter() - started)
    return units / best, units


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pdfs", type=int, default=10)
    parser.add_argument("--pages", type=int, default=20)
    parser.add_argument("--html", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    pdfs = [files.report_pdf(seed, args.pages) for seed in range(args.pdfs)]
    pages = [files.article_html(seed) for seed in range(args.html)]

    def ours_pdf() -> int:
        return sum(extract(data, "report.pdf").pages for data in pdfs)

    def bare_pdf() -> int:
        n = 0
        for data in pdfs:
            for page in pypdf.PdfReader(io.BytesIO(data)).pages:
                page.extract_text()
                n += 1
        return n

    def ours_html() -> int:
        for data in pages:
            extract(data, "page.html")
        return len(pages)

    def bare_html() -> int:
        for data in pages:
            trafilatura.html2txt(data.decode())
        return len(pages)

    pdf_rate, n_pages = best_rate(ours_pdf, args.rounds)
    pdf_ref, _ = best_rate(bare_pdf, args.rounds)
    html_rate, n_html = best_rate(ours_html, args.rounds)
    html_ref, _ = best_rate(bare_html, args.rounds)
    result = {
        "bench": "extraction",
        "command": "bench/ingest/extraction.py "
        f"--pdfs {args.pdfs} --pages {args.pages} --html {args.html} --rounds {args.rounds}",
        "machine": {"python": platform.python_version(), "processor": platform.machine()},
        "pdf": {
            "files": len(pdfs),
            "pages": n_pages,
            "mean_file_bytes": sum(map(len, pdfs)) // max(1, len(pdfs)),
            "pages_per_s": round(pdf_rate, 1),
            "reference_pypdf_pages_per_s": round(pdf_ref, 1),
            "ratio_to_reference": round(pdf_rate / pdf_ref, 3),
        },
        "html": {
            "pages": n_html,
            "mean_file_bytes": sum(map(len, pages)) // max(1, len(pages)),
            "pages_per_s": round(html_rate, 1),
            "reference_html2txt_pages_per_s": round(html_ref, 1),
            "ratio_to_reference": round(html_rate / html_ref, 3),
        },
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
