"""One line of a JSON Lines file as a JSON object, or an error naming the file and line.

Every JSONL reader (passages, fusion's training questions, the trainer's examples) parses its
lines here, so a malformed line reads the same wherever it is met. Imports only
``openbook.errors``.
"""

from __future__ import annotations

import json
from typing import Any

from openbook.errors import InvalidArgument


def json_object(line: str, where: str, error: type[ValueError] = InvalidArgument) -> dict[str, Any]:
    """``line`` parsed as a JSON object; else ``error`` whose message starts with ``where``
    (``path:lineno``)."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise error(f"{where}: not valid JSON ({e.msg})") from None
    if not isinstance(row, dict):
        raise error(f"{where}: expected a JSON object")
    return row
