"""From ``openbook up`` on an installed checkout with an empty ``var/`` to the first answer.

    .venv/bin/python bench/first_answer/run.py --json docs/bench/first-answer.json

Starts the whole stack as ``make up`` does (``openbook up``: docker-compose.yml's services as
local processes; the test kit's ``LocalStack`` on free ports) over a new, empty var directory
with the default generator and index and the init step preparing everything it prepares on a
user's first start. Then asks ``POST /answer`` (the README's first question, uncached) until the
first 200. Every line the launcher and its services print is stamped with the seconds since
start as it appears, and the report is the breakdown: when each step began and ended (init's
index build, fusion fit and model conversion; each service healthy; the first answer) and what
init-more did after. Nothing is timed inside the services: the stamps are what a user watching
the terminal would see.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from openbook_testkit.stack import DEFAULT_GENERATOR, LocalStack

QUESTION = "Who is the President of Peru?"  # the README's
# (label, pattern of the launcher's or a service's line that marks it)
MILESTONES = [
    ("init started", r"openbook up: starting init:"),
    ("index wiki-2018 built", r"index wiki-2018: \d+ passages in"),
    ("index wiki-2018 fusion fitted", r"index wiki-2018: hybrid fusion fitted"),
    ("generator converted", r"prepared .*generator|generator: already prepared"),
    ("retriever healthy", r"openbook up: retriever is healthy"),
    ("generator healthy", r"openbook up: generator is healthy"),
    ("gateway healthy", r"openbook up: gateway is healthy"),
    ("init-more started", r"openbook up: starting init-more:"),
    ("index wiki-2016 built", r"index wiki-2016: \d+ passages in"),
    ("index wiki-2016 fusion fitted", r"index wiki-2016: hybrid fusion fitted"),
    ("bm25 indexes built", r"index wiki-2018-bm25: \d+ passages in"),
]


class StampedLog:
    """Follows a growing log file, stamping each new line with seconds since ``t0``."""

    def __init__(self, path: Path, t0: float) -> None:
        self.path, self.t0 = path, t0
        self.lines: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        offset, partial = 0, ""
        while not self._stop.is_set():
            if self.path.exists():
                with open(self.path, errors="replace") as f:
                    f.seek(offset)
                    chunk = f.read()
                    offset = f.tell()
                now = time.monotonic() - self.t0
                text = partial + chunk.replace("\r", "\n")
                *done, partial = text.split("\n")
                self.lines += [(now, ln) for ln in done if ln.strip()]
            self._stop.wait(0.2)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def first(self, pattern: str) -> float | None:
        rx = re.compile(pattern)
        return next((t for t, ln in self.lines if rx.search(ln)), None)


def first_answer(url: str, deadline: float) -> tuple[float, dict]:
    while time.monotonic() < deadline:
        try:
            reply = httpx.post(
                f"{url}/answer", json={"question": QUESTION, "use_cache": False}, timeout=120
            )
            if reply.status_code == 200:
                return time.monotonic(), reply.json()
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError("no answer before the deadline")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait in all")
    ap.add_argument(
        "--after",
        type=float,
        default=0.0,
        help="keep the stack up this long "
        "after the first answer, to see init-more finish (seconds)",
    )
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--keep", action="store_true", help="keep the var directory")
    args = ap.parse_args(argv)

    var = Path(tempfile.mkdtemp(prefix="openbook-first-answer-"))
    stack = LocalStack(
        var,
        generator=DEFAULT_GENERATOR,
        default_index="wiki-2018",
        extra_env={"OPENBOOK_TRAINER_PREPARE": "indexes,models"},
    )
    t0 = time.monotonic()
    log = StampedLog(stack.log_path, t0)
    try:
        stack.start(timeout_s=args.timeout)
        answered, reply = first_answer(stack.url, t0 + args.timeout)
        first = answered - t0
        if args.after:
            time.sleep(args.after)
    finally:
        stack.stop()
        log.stop()
    steps = {label: log.first(rx) for label, rx in MILESTONES}
    result = {
        "first_answer_s": round(first, 1),
        "steps_s": {k: (None if v is None else round(v, 1)) for k, v in steps.items()},
        "answer": reply.get("answer"),
        "timings_ms": reply.get("timings_ms"),
        "machine": {
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "bf16_flags": bf16_flags(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        },
    }
    print(f"first answer {first:.1f} s after openbook up ({reply.get('answer')!r})")
    for label, t in result["steps_s"].items():
        print(f"  {label:32s} {'-' if t is None else f'{t:7.1f} s'}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if not args.keep:
        import shutil

        shutil.rmtree(var, ignore_errors=True)
    else:
        print(f"var directory kept: {var}", file=sys.stderr)
    return 0


def bf16_flags() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    lines = [ln for ln in text.splitlines() if ln.startswith("flags")]
    flags = lines[0].split(":", 1)[1].split() if lines else []
    return [f for f in ("amx_bf16", "amx_tile", "avx512_bf16") if f in flags]


if __name__ == "__main__":
    sys.exit(main())
