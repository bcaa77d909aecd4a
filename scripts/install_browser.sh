#!/usr/bin/env bash
# Installs Chromium (the Debian package `chromium`) for the dashboard's real-browser test
# (tests/test_dashboard_browser.py, Playwright with executable_path=/usr/bin/chromium) and for
# PNG export of charts (kaleido finds it on PATH). Idempotent: does nothing when it is there.
# Playwright's own browser download is not used (it does not work here).
set -euo pipefail
if [ -x /usr/bin/chromium ]; then
    echo "chromium: $(/usr/bin/chromium --version 2>/dev/null | head -1)"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_browser.sh: no apt-get here; install Chromium and set DECODESCOPE_CHROMIUM to it" >&2
    exit 1
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
$SUDO apt-get update -q
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends \
    chromium fonts-liberation
echo "chromium: $(/usr/bin/chromium --version 2>/dev/null | head -1)"
