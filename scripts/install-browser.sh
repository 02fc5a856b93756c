#!/usr/bin/env bash
# Install what the browser test (tests/ui/test_web_page.py) needs: Debian's Chromium and
# ChromeDriver, and Selenium in the project's virtual environment. Idempotent; no browser is
# downloaded by a test tool (Selenium is pointed at /usr/bin/chromedriver, offline).
# Without root/apt it says what is missing and exits 0: the test then skips with that reason
# (or fails, where OPENBOOK_REQUIRE_BROWSER=1).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}

if ! { [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; }; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing Debian's chromium and chromium-driver"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      chromium chromium-driver fonts-dejavu-core >/dev/null
  else
    echo "install-browser: chromium/chromedriver missing and cannot apt-get install them" \
      "(Debian/Ubuntu: sudo apt-get install chromium chromium-driver); the browser test will skip" >&2
  fi
fi

if [ -x "$VENV/bin/python" ]; then
  # scripts/install.sh already installs Selenium (openbook[test]) at constraints.txt's version:
  # a second pip run (CI runs both scripts) only resolved it again
  "$VENV/bin/python" -c "import selenium" 2>/dev/null ||
    "$VENV/bin/python" -m pip install -q -c constraints.txt "selenium>=4.20"
else
  echo "install-browser: no $VENV yet: run scripts/install.sh first" >&2
  exit 1
fi

if [ -x /usr/bin/chromium ]; then
  /usr/bin/chromium --version 2>/dev/null
  /usr/bin/chromedriver --version
fi
