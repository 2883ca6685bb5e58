#!/usr/bin/env bash
# The one device call for bench/gpu_check.py (its docstring says more):
#     run(command="bash bench/gpu_run.sh", carry=[".whl"], timeout_s=480)
# Installs the wheels carried in .whl/ (bench/gpu_wheels.sh) where that machine's Python finds them, records
# nvidia-smi, then runs the check into $OUT, resuming it in a fresh process after a crash, a hang or a device
# left unusable (exit code 4, or death by a signal), at most 4 attempts, all within the check's one time limit.
# On the CPU the same script rehearses the call:
#     OUT=/tmp/gpu-dry PYTHON=.venv/bin/python bash bench/gpu_run.sh --dry-run
set -u -o pipefail
cd "$(dirname "$0")/.."
out="${OUT:?OUT: the folder the report goes to}"
python="${PYTHON:-python3}"
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
    site="$(mktemp -d)"
    if "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl; then
        export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    else
        echo "gpu_run: the wheels in .whl/ did not install; going on with this machine's packages" >&2
    fi
fi
nvidia-smi >"$out/nvidia-smi.txt" 2>&1 || rm -f "$out/nvidia-smi.txt"
export PYTHONUNBUFFERED=1
resume=()
for attempt in 1 2 3 4; do
    "$python" bench/gpu_check.py --out-dir "$out" ${resume[@]+"${resume[@]}"} "$@" 2>&1 | tee -a "$out/stdout.log"
    code=$?
    echo "gpu_run: attempt $attempt ended with exit code $code" | tee -a "$out/stdout.log"
    # 0: finished; 3: the hard time limit; 1, 2: the script refused to start (no GPU, bad options)
    if [ "$code" -le 3 ]; then
        exit "$code"
    fi
    resume=(--resume)
done
exit "$code"
