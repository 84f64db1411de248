#!/usr/bin/env bash
# fxstream bootstrap: make sure uv and the workspace are installed, then hand over to the
# `fxstream` CLI (ops/). All logic lives there; see README.md.
#   ./fx up | down | status | test | bench kafka
set -euo pipefail
cd "$(dirname "$0")"

if command -v uv >/dev/null 2>&1; then
  uv=(uv)
elif python3 -m uv --version >/dev/null 2>&1; then
  uv=(python3 -m uv)
else
  echo "fx: installing uv (Python package manager) from PyPI" >&2
  python3 -m pip install --quiet --user uv 2>/dev/null || python3 -m pip install --quiet uv
  uv=(python3 -m uv)
fi

# --locked: CI and fresh clones install exactly what uv.lock pins, and fail if it is stale.
"${uv[@]}" sync --locked --quiet
exec .venv/bin/fxstream "$@"
