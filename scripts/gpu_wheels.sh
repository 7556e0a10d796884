#!/bin/bash
# Download into .whl/ the nine pure-Python wheels the GPU machine lacks (docs: ../shared/reference/gpu-machine.md,
# "Carrying the missing Python packages"), ~1.4 MB together, then print the install prefix to use there.
#   bash scripts/gpu_wheels.sh        (then carry .whl with the run)
# Pinned to the versions that machine was checked with; it has Python 3.12 and no network.
set -euo pipefail
cd "$(dirname "$0")/.."

PIP="${PIP:-.venv/bin/pip}"
DEST=.whl
mkdir -p "$DEST"

WHEELS=(
  datasets==5.2.0
  dill==0.4.1
  multiprocess==0.70.19
  hydra-core==1.3.8
  omegaconf==2.3.1
  submitit==1.5.4
  hydra-submitit-launcher==1.2.0
  cloudpickle==3.1.3
)
for spec in "${WHEELS[@]}"; do
  "$PIP" download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform any -d "$DEST" "$spec"
done
# antlr4-python3-runtime 4.9.3 (what omegaconf 2.3 pins) is an sdist only: build its (pure-Python) wheel here.
if ! compgen -G "$DEST/antlr4_python3_runtime-4.9.3-*.whl" > /dev/null; then
  "$PIP" wheel --quiet --no-deps -w "$DEST" antlr4-python3-runtime==4.9.3
fi

count=$(find "$DEST" -maxdepth 1 -type f -name '*.whl' | wc -l)
if [ "$count" -ne 9 ]; then
  echo "error: expected 9 wheels in $DEST, found $count (remove stale ones and rerun):" >&2
  ls "$DEST" >&2
  exit 1
fi
ls -1 "$DEST"/*.whl
du -ch "$DEST"/*.whl | tail -n 1
echo
echo "On the GPU machine (carry .whl), prefix the command with:"
echo "python -m pip install --quiet --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:\$PWD &&"
