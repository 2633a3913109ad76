#!/usr/bin/env bash
# The GPU check, for a lent GPU machine without a network (make gpu-check).
# Input: this checkout, and wheelhouse/ (make wheelhouse, carried here) when `pipe` is not
# installed. Output: runs/gpu-check/ (GPU_CHECK_OUT): each step's log, machine.json,
# gpu-tests.xml, grpo/ (the quickstart's run) and summary.md + summary.json, rewritten after
# every step, so a run cut anywhere still reports what it did.
# Steps, cheapest first, each bounded by `timeout`:
#   install     only when pipe is missing: .venv-gpu (--system-site-packages: the machine's
#               torch) from the wheelhouse, offline          GPU_CHECK_INSTALL_TIMEOUT (900 s)
#   machine     nvidia-smi, versions, ds_report              GPU_CHECK_INFO_TIMEOUT (180 s)
#   gpu-tests   pytest -m gpu (each skips where fewer GPUs are visible than it needs)
#               GPU_CHECK_TESTS=0 skips it                   GPU_CHECK_TESTS_TIMEOUT (900 s)
#   quickstart  pipe run pipelines/grpo_quickstart.yaml, with a GPU visible only
#               GPU_CHECK_QUICKSTART=0 skips it              GPU_CHECK_QUICKSTART_TIMEOUT (600 s)
#   gemma3      the real model's gpu test (tests/integration/test_gpu_gemma3.py: SFT, 20 GRPO
#               steps, evaluate), with a GPU visible and models/gemma-3-270m-q4_k_m.gguf there
#               only (make gemma3 fetches it, with the network: bring it along)
#               GPU_CHECK_GEMMA3=0 skips it                  GPU_CHECK_GEMMA3_TIMEOUT (2400 s)
# GPU_CHECK_PYTHON names the interpreter to use (default: the first with pipe installed of
# .venv-gpu, .venv, python3).
set -u
cd "$(dirname "$0")/.."

OUT=${GPU_CHECK_OUT:-runs/gpu-check}
WHEELHOUSE=${WHEELHOUSE:-wheelhouse}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
mkdir -p "$OUT"
: >"$OUT/steps.tsv"
rm -f "$OUT/gpu-tests.xml" "$OUT/quickstart.log" "$OUT/machine.json"
BASE_PY=$(command -v python3)

summary() { "$BASE_PY" scripts/gpu_summary.py "$OUT" >/dev/null || true; }
trap 'summary; echo "summary: $OUT/summary.md"' EXIT

record() { # name status rc seconds note
    printf '%s\t%s\t%s\t%s\t%s\n' "$@" >>"$OUT/steps.tsv"
    summary
}

step() { # name limit command...: its output to the terminal and $OUT/name.log
    local name=$1 limit=$2 start rc status ms
    shift 2
    echo "== $name (at most ${limit} s)"
    start=$(date +%s%N)
    timeout -s INT -k 30 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    rc=${PIPESTATUS[0]}
    case $rc in
    0) status=ok ;;
    124 | 137) status="timed out" ;;
    *) status=failed ;;
    esac
    ms=$((($(date +%s%N) - start) / 1000000))
    record "$name" "$status" "$rc" "$((ms / 1000)).$((ms % 1000 / 100))" "${limit} s bound"
    return "$rc"
}

has_pipe() { # the interpreter has pipe and its main dependencies installed
    (cd / && timeout 120 "$1" -c "import importlib.metadata as m; m.version('pipe-engine')
import engine, stages, pydantic, dask, distributed") >/dev/null 2>&1
}

PY=""
for candidate in "${GPU_CHECK_PYTHON:-}" .venv-gpu/bin/python .venv/bin/python "$BASE_PY"; do
    if [ -n "$candidate" ] && [ -x "$candidate" ] && has_pipe "$candidate"; then
        PY=$candidate
        break
    fi
done

if [ -n "$PY" ]; then
    record install skipped "" 0 "pipe already installed for $PY"
elif [ -f "$WHEELHOUSE/requirements.lock" ]; then
    PY=.venv-gpu/bin/python
    # --system-site-packages sees the base interpreter's packages, not a venv's: where python3
    # is itself a venv (the lent machines' /opt/torch/.venv), a .pth adds its site-packages
    step install "${GPU_CHECK_INSTALL_TIMEOUT:-900}" bash -c "
        set -e
        test -x $PY || $BASE_PY -m venv --system-site-packages .venv-gpu
        $BASE_PY -c 'import site; print(chr(10).join(site.getsitepackages()))' \
            >\"\$($PY -c 'import sysconfig; print(sysconfig.get_paths()[\"purelib\"])')/base_python.pth\"
        $PY scripts/wheelhouse.py install --python $PY --wheelhouse $WHEELHOUSE --project . --editable"
else
    PY=$BASE_PY
    record install failed "" 0 "pipe is not installed and there is no $WHEELHOUSE/requirements.lock"
fi

step machine "${GPU_CHECK_INFO_TIMEOUT:-180}" bash -c "
    (command -v nvidia-smi >/dev/null && timeout 30 nvidia-smi) || echo 'no nvidia-smi'
    $PY scripts/gpu_summary.py --machine $OUT
    if command -v ds_report >/dev/null || test -x $(dirname "$PY")/ds_report; then
        PATH=$(dirname "$PY"):\$PATH timeout 120 ds_report
    fi"
GPUS=$("$BASE_PY" -c "import json; print(json.load(open('$OUT/machine.json')).get('cuda_devices', 0))" 2>/dev/null || echo 0)

if [ "${GPU_CHECK_TESTS:-1}" = 0 ]; then
    record gpu-tests skipped "" 0 "GPU_CHECK_TESTS=0"
else
    step gpu-tests "${GPU_CHECK_TESTS_TIMEOUT:-900}" "$PY" -m pytest -m gpu -v -rs \
        -p no:cacheprovider --junitxml="$OUT/gpu-tests.xml" \
        --ignore=tests/integration/test_gpu_gemma3.py tests
fi

if [ "${GPU_CHECK_QUICKSTART:-1}" = 0 ]; then
    record quickstart skipped "" 0 "GPU_CHECK_QUICKSTART=0"
elif [ "$GPUS" -lt 1 ]; then
    record quickstart skipped "" 0 "no GPU visible"
else
    rm -rf "$OUT/grpo"
    PIPE=$(dirname "$PY")/pipe
    [ -x "$PIPE" ] || PIPE="$PY -m engine.cli"
    # shellcheck disable=SC2086
    step quickstart "${GPU_CHECK_QUICKSTART_TIMEOUT:-600}" $PIPE run pipelines/grpo_quickstart.yaml \
        --run-dir "$OUT/grpo" --force
fi
GEMMA3=models/gemma-3-270m-q4_k_m.gguf
if [ "${GPU_CHECK_GEMMA3:-1}" = 0 ]; then
    record gemma3 skipped "" 0 "GPU_CHECK_GEMMA3=0"
elif [ ! -f "$GEMMA3" ]; then
    record gemma3 skipped "" 0 "no $GEMMA3 (make gemma3 fetches it)"
elif [ "$GPUS" -lt 1 ]; then
    record gemma3 skipped "" 0 "no GPU visible"
else
    step gemma3 "${GPU_CHECK_GEMMA3_TIMEOUT:-2400}" "$PY" -m pytest -m gpu -v -rs \
        -p no:cacheprovider tests/integration/test_gpu_gemma3.py
fi
# the exit status says whether every step that ran passed (skipped steps do not count)
if cut -f2 "$OUT/steps.tsv" | grep -qE '^(failed|timed out)$'; then
    exit 1
fi
exit 0
