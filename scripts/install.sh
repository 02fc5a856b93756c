#!/usr/bin/env bash
# Install openbook and its test tools into .venv (idempotent). Used by `make` and .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}

if ! command -v redis-server >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing Debian's redis-server"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
  else
    echo "redis-server is missing: install it (Debian/Ubuntu: sudo apt-get install redis-server)" >&2
    exit 1
  fi
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# torch first and pinned: on CPU-only machines a local CPU wheel (pip's find-links) or
# TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu avoids gigabytes of CUDA libraries.
if [ -n "${TORCH_INDEX_URL:-}" ]; then
  "$VENV/bin/python" -m pip install -q --index-url "$TORCH_INDEX_URL" torch==2.13.0
else
  "$VENV/bin/python" -m pip install -q torch==2.13.0
fi
# The core library, the four services, the deployment commands (deploy/: openbook-secrets), the
# `openbook` command and the test tools, editable, every package at the exact version
# constraints.txt pins (scripts/update-constraints.sh). Each image installs only its own service
# (services/Dockerfile, services/*/constraints.txt; the gateway's the deployment commands too). The test kit
# (tests/pyproject.toml) and the benchmarks (bench/pyproject.toml) are development-only packages,
# installed here so that tests and benchmarks import them by name; no image installs them.
"$VENV/bin/python" -m pip install -q -c constraints.txt \
  -e ".[test]" \
  -e services/gateway -e services/retriever -e services/generator -e services/trainer \
  -e deploy -e cli \
  -e tests -e bench
touch "$VENV/.installed"
echo "openbook installed in $VENV"
