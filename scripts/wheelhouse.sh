#!/bin/bash
# Build a wheelhouse for a GPU node without network access: batchjob's own wheel plus a wheel of every
# dependency, in one directory to copy to the node. Run it on a machine with network access.
#
#   bash scripts/wheelhouse.sh [-o DIR] [--extras slurm] [--without-torch] \
#                              [--python-version 3.12 --platform manylinux_2_28_x86_64] [--only PKG==VER ...]
#
#   -o DIR              where the wheels go (default: wheelhouse)
#   --extras LIST       optional dependency groups to include, comma-separated (e.g. slurm)
#   --without-torch     leave torch out (the node already has it, e.g. from a cluster module)
#   --python-version, --platform   the node's, when they differ from this machine's: binary wheels only then
#   --only PKG==VER     just these packages, without their dependencies (repeatable); batchjob's wheel is still built
#   PIP=...             the pip to use (default: python3 -m pip)
#
# On the node:
#   python -m venv .venv && .venv/bin/pip install --no-index --find-links DIR 'batchjob[slurm]'
# (with --without-torch, make the node's torch visible first, e.g. python -m venv --system-site-packages).
set -euo pipefail
cd "$(dirname "$0")/.."

PIP=${PIP:-python3 -m pip}
DEST=wheelhouse
EXTRAS=""
WITH_TORCH=1
TARGET=()
ONLY=()
while [ $# -gt 0 ]; do
  case "$1" in
    -o) DEST=$2; shift 2 ;;
    --extras) EXTRAS=$2; shift 2 ;;
    --without-torch) WITH_TORCH=0; shift ;;
    --python-version) TARGET+=(--python-version "$2" --implementation cp); shift 2 ;;
    --platform) TARGET+=(--platform "$2"); shift 2 ;;
    --only) ONLY+=("$2"); shift 2 ;;
    *) echo "unknown argument: $1 (see the top of $0)" >&2; exit 2 ;;
  esac
done
mkdir -p "$DEST"

$PIP wheel --quiet --no-deps -w "$DEST" .

if [ ${#ONLY[@]} -gt 0 ]; then
  REQUIREMENTS=("${ONLY[@]}")
  DEPS=(--no-deps)
else
  # batchjob's requirements (and those of the chosen extras) from pyproject.toml.
  mapfile -t REQUIREMENTS < <(python3 - "$EXTRAS" "$WITH_TORCH" <<'PY'
import re
import sys
import tomllib

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
wanted = list(project["dependencies"])
for extra in filter(None, sys.argv[1].split(",")):
    wanted += project["optional-dependencies"][extra]
for requirement in dict.fromkeys(wanted):
    if sys.argv[2] == "1" or re.split(r"[\s<>=!~;\[]", requirement)[0] != "torch":
        print(requirement)
PY
  )
  DEPS=()
fi

if [ ${#TARGET[@]} -gt 0 ]; then
  # Another platform: binary wheels only. omegaconf's antlr4-python3-runtime is published as source only;
  # it is pure Python, so its wheel is built here and found through --find-links.
  $PIP wheel --quiet --no-deps -w "$DEST" antlr4-python3-runtime==4.9.3
  $PIP download --quiet "${DEPS[@]}" --only-binary=:all: "${TARGET[@]}" --find-links "$DEST" -d "$DEST" \
    "${REQUIREMENTS[@]}"
else
  $PIP wheel --quiet "${DEPS[@]}" -w "$DEST" "${REQUIREMENTS[@]}"
fi

ls -1 "$DEST"
du -sh "$DEST"
