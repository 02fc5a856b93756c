#!/usr/bin/env bash
# Re-pin constraints.txt to what .venv holds now: run after a deliberate dependency change
# (pyproject.toml, services/*/pyproject.toml) has been installed and tested; then writes each
# service's constraints.txt (its part of this file). torch is pinned where it is installed
# (scripts/install.sh, services/Dockerfile), from a CPU or CUDA index; openbook itself is the project.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
{
  echo "# Exact versions every install uses: scripts/install.sh (CI, make), services/Dockerfile."
  echo "# Regenerate deliberately with scripts/update-constraints.sh; torch is pinned separately."
  "$VENV/bin/python" -m pip freeze --exclude-editable | grep -v -i -E '^(torch|openbook)([=@ ]|$)'
} > constraints.txt
echo "constraints.txt: $(grep -vc '^#' constraints.txt) packages pinned"
# Each service's image installs only its own closure, pinned by its own file.
"$VENV/bin/python" scripts/service_constraints.py
