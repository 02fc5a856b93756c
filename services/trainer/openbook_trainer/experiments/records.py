"""Per-item results appended to a JSONL file, so an interrupted experiment resumes."""

from __future__ import annotations

import json
from pathlib import Path


class ResultLog:
    """``key -> result`` pairs on disk; a rerun skips the keys already recorded."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.done: dict[str, dict] = {}
        if self.path.exists():
            for line in self.path.read_text(encoding="utf-8").splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut short by an interruption
                self.done[row["key"]] = row["result"]

    def get(self, key: str) -> dict | None:
        return self.done.get(key)

    def add(self, key: str, result: dict) -> None:
        self.done[key] = result
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"key": key, "result": result}) + "\n")
