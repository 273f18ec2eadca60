#!/usr/bin/env bash
# Download the wheels bench/gpu_wheels.txt names into .whl/ (git-ignored) for the GPU machine
# (CPython 3.12, x86-64, no network there): `make gpu-wheels`. The device call carries them
# (carry: [".whl"]) and bench/gpu_check.sh installs them with --no-index into /tmp/site.
# Also writes .whl/COMMIT (the checkout's commit and whether it has uncommitted changes): the
# device gets the working tree without .git, and bench/gpu_check.py reports that commit.
# PYTHON: a python with pip (any version: pip downloads for 3.12 whatever runs it).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
mkdir -p .whl
mapfile -t pins < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' bench/gpu_wheels.txt | grep -v '^$')
# A wheel of another version left from an earlier list: removed (two versions of one package
# stop the whole install there).
wanted=" "
for pin in "${pins[@]}"; do
    name=${pin%%==*}
    wanted+="$(echo "$name" | tr 'A-Z-.' 'a-z__')-${pin#*==}-* "
done
for f in .whl/*.whl; do
    [ -e "$f" ] || continue
    base=$(basename "$f")
    keep=0
    for w in $wanted; do
        # shellcheck disable=SC2053
        if [[ $(echo "$base" | tr 'A-Z' 'a-z') == $w ]]; then keep=1; fi
    done
    if [ $keep = 0 ]; then echo "removing $f (not in bench/gpu_wheels.txt)"; rm -f "$f"; fi
done
platforms=()
for p in manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux1 \
    manylinux_2_26 manylinux_2_24 manylinux_2_5; do
    platforms+=(--platform "${p}_x86_64")
done
"$PYTHON" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp "${platforms[@]}" -d .whl "${pins[@]}"
{
    git rev-parse HEAD 2>/dev/null || echo "?"
    if [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]; then
        echo "uncommitted changes"
    fi
} >.whl/COMMIT
n=$(ls .whl/*.whl | wc -l)
echo "$n wheels in .whl/ ($(du -ch .whl/*.whl | tail -1 | cut -f1)); commit $(head -1 .whl/COMMIT)"
if [ "$n" != "${#pins[@]}" ]; then
    echo "expected ${#pins[@]} wheels" >&2
    exit 1
fi
