#!/usr/bin/env bash
# Install NeMo Gym into its own venv, .venv-gym/ at the repo root.
#   bash scripts/install_gym.sh        (or: make install-gym)
#
# NeMo Gym 0.7.0 declares Python >= 3.13 but runs on 3.11, so it is installed
#   1. hydra-core, omegaconf and antlr4's runtime pinned first: unpinned, pip picks an old
#      omegaconf and `ng_run` fails on `from omegaconf import MISSING` (antlr4's runtime 4.9.3,
#      which omegaconf 2.3 requires, is published as an sdist only: pure Python);
#   2. then nemo-gym with --ignore-requires-python and wheels only, the pins kept;
#   3. then the requirements of the resources servers in GYM_SERVERS (default: math_with_judge
#      reasoning_gym; example_single_tool_call needs none), the pins kept;
#   4. then checked: `import nemo_gym` and `from omegaconf import MISSING`.
# `ng_run` builds a venv per server with uv, which cannot fetch an interpreter offline: pipe
# points every server at this one venv (`+skip_venv_if_present=true +uv_venv_dir=...`).
# Idempotent: a venv whose marker file is newer than this script is left as is.
# Environment: PYTHON (interpreter for the venv, default python3),
# GYM_VENV (default <repo>/.venv-gym), NEMO_GYM_VERSION (default 0.7.0), GYM_SERVERS.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${GYM_VENV:-$ROOT/.venv-gym}"
PYTHON="${PYTHON:-python3}"
VERSION="${NEMO_GYM_VERSION:-0.7.0}"
PINS=(hydra-core==1.3.8 omegaconf==2.3.1 antlr4-python3-runtime==4.9.3)
MARKER="$VENV/.installed-nemo-gym-$VERSION"
PY="$VENV/bin/python"
CHECK="import nemo_gym; from omegaconf import MISSING"

if [[ -f "$MARKER" && "$MARKER" -nt "$0" ]] && "$PY" -c "$CHECK" 2>/dev/null; then
    echo "nemo-gym $VERSION already installed in $VENV"
    exit 0
fi

start=$(date +%s)
test -x "$PY" || "$PYTHON" -m venv "$VENV"
"$PY" -m pip install -q -U pip
"$PY" -m pip install -q "${PINS[@]}"
"$PY" -m pip install -q --ignore-requires-python --only-binary=:all: \
    "nemo-gym==$VERSION" "${PINS[@]}"
# the resources servers pipe runs and tests need their own requirements in the one venv (each
# server's requirements.txt, its `-e nemo-gym` line left out: installed above)
SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
for server in ${GYM_SERVERS:-math_with_judge reasoning_gym}; do
    grep -v '^-e ' "$SITE/resources_servers/$server/requirements.txt" > "$VENV/req-$server.txt"
    "$PY" -m pip install -q -r "$VENV/req-$server.txt" "${PINS[@]}"
done
"$PY" -c "$CHECK; from importlib.metadata import version; print('nemo-gym', version('nemo-gym'))"
touch "$MARKER"
echo "nemo-gym $VERSION installed in $VENV in $(($(date +%s) - start)) s ($(du -sh "$VENV" | cut -f1))"
