#!/usr/bin/env bash
# Creates .venv and installs decodescope with its test and capture extras (CPU torch).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# the CPU build of torch first: an unpinned torch would pull a multi-GB CUDA build
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[dev,capture]"
# Chromium for the dashboard's real-browser test and PNG export (Debian package, idempotent)
bash scripts/install_browser.sh
