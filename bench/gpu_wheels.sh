#!/usr/bin/env bash
# The wheels bench/gpu_run.sh installs on the lent GPU machine, which reaches no registry: what the replica
# section needs that its image lacks (grpcio-health-checking) or may hold at another version than the generated
# gRPC and protobuf code needs (grpcio, protobuf), at the versions this checkout's .venv runs, for that machine's
# Python 3.12 on manylinux x86-64. About 8 MB, into .whl/ (ignored by git), which the device call carries.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-.venv/bin/python}"
specs=$("$python" -c 'from importlib.metadata import version as v
print(" ".join(f"{n}=={v(n)}" for n in ("grpcio", "grpcio-health-checking", "protobuf")))')
rm -rf .whl
mkdir .whl
platforms=""
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms="$platforms --platform $p"
done
# shellcheck disable=SC2086
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    $platforms -d .whl $specs
ls -l .whl
