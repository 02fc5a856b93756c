"""``python tests/bench_help_driver.py OUT.json SCRIPT...``: run each benchmark script with
``--help`` as ``python SCRIPT --help`` runs it (as ``__main__``, its own folder first on
``sys.path``), one after another in this one process; write to OUT.json, per script, its exit
code and what it printed (tests/test_bench_scripts.py).

Why one process: every benchmark imports torch, transformers or faiss, and a process per
script paid those imports a dozen times over; here the second script finds them imported.
Invariant: a module found through a script's folder is forgotten after that script, so no
later script from another folder can import it by that name.
"""

from __future__ import annotations

import contextlib
import io
import json
import runpy
import sys
import traceback
from pathlib import Path
from typing import Any


def run_help(script: str) -> dict[str, Any]:
    """``script --help``'s exit code, stdout and stderr, run in this process."""
    path = Path(script).resolve()
    before = set(sys.modules)
    sys.argv = [script, "--help"]
    sys.path[0] = str(path.parent)  # what `python SCRIPT` puts first
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(str(path), run_name="__main__")
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 1
    for name in set(sys.modules) - before:
        file = getattr(sys.modules.get(name), "__file__", None)
        if file and Path(file).resolve().parent == path.parent:
            del sys.modules[name]
    return {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}


def main() -> None:
    out, *scripts = sys.argv[1:]
    results = {script: run_help(script) for script in scripts}
    Path(out).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
