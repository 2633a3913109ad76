#!/usr/bin/env bash
# Install verifiers into its own venv, .venv-verifiers/ at the repo root.
#   bash scripts/install_verifiers.sh        (or: make install-verifiers)
#
# verifiers' dependencies (openai, mcp, prime-*, datasets, ...) are heavy and pinned apart from
# pipe's, so its environments run in this venv, behind pipe's HTTP environment protocol: the
# stage starts `stages/lib/env/verifiers_bridge.py` with this venv's python (it imports only
# the standard library and verifiers). Wheels only, then checked: `import verifiers`.
# Idempotent: a venv whose marker file is newer than this script is left as is.
# Environment: PYTHON (interpreter for the venv, default python3),
# VERIFIERS_VENV (default <repo>/.venv-verifiers), VERIFIERS_VERSION (default 0.4.0).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${VERIFIERS_VENV:-$ROOT/.venv-verifiers}"
PYTHON="${PYTHON:-python3}"
VERSION="${VERIFIERS_VERSION:-0.4.0}"
MARKER="$VENV/.installed-verifiers-$VERSION"
PY="$VENV/bin/python"
CHECK="import verifiers"

if [[ -f "$MARKER" && "$MARKER" -nt "$0" ]] && "$PY" -c "$CHECK" 2>/dev/null; then
    echo "verifiers $VERSION already installed in $VENV"
    exit 0
fi

start=$(date +%s)
test -x "$PY" || "$PYTHON" -m venv "$VENV"
"$PY" -m pip install -q -U pip
"$PY" -m pip install -q --only-binary=:all: "verifiers==$VERSION"
"$PY" -c "$CHECK; from importlib.metadata import version; print('verifiers', version('verifiers'))"
touch "$MARKER"
echo "verifiers $VERSION installed in $VENV in $(($(date +%s) - start)) s ($(du -sh "$VENV" | cut -f1))"
