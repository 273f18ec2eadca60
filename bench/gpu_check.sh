#!/usr/bin/env bash
# The one command of the GPU check, on the GPU machine, from the repository root:
#     bash bench/gpu_check.sh
# (the device call carries the wheels: make gpu-wheels here, then carry: [".whl"]).
# Installs the carried wheels into /tmp/site, the monarch kernelspec into /tmp/mk-jupyter
# (JUPYTER_PATH; its argv is this python3, and PYTHONPATH reaches the kernel and its ranks),
# then runs bench/gpu_check.py, which writes bench/results/gpu.md (and copies it, the JSON,
# the log and the JUnit XML to $OUT where that is set). Arguments go to gpu_check.py.
# PYTHON: the python to use (python3: the one that holds torch there).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
PYTHON=${PYTHON:-python3}
SITE=${GPU_CHECK_SITE:-/tmp/site}
JUP=${GPU_CHECK_JUPYTER:-/tmp/mk-jupyter}
setup_log=${OUT:+$OUT/gpu-setup.log}
setup_log=${setup_log:-/dev/null}
export PYTHONUNBUFFERED=1 MONARCH_KERNEL_TREE_GUARD=0
say() { echo "gpu_check.sh: $*" | tee -a "$setup_log"; }

if compgen -G ".whl/*.whl" >/dev/null; then
    export GPU_CHECK_FROM_WHEELS=1  # the commit is .whl/COMMIT's (see gpu_check.commit)
    say "installing $(ls .whl/*.whl | wc -l) wheels into $SITE"
    pip=("$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade
        --disable-pip-version-check --target "$SITE")
    if ! "${pip[@]}" .whl/*.whl 2>&1 | tee -a "$setup_log"; then
        # one wheel pip refuses (a platform tag) stops them all: then each on its own
        say "the wheels did not install together (above): one by one"
        for w in .whl/*.whl; do
            "${pip[@]}" "$w" 2>&1 | tee -a "$setup_log" || say "NOT INSTALLED: $w"
        done
    fi
else
    say "no .whl/*.whl: run 'make gpu-wheels' and carry .whl (pyzmq, ipykernel, ... are missing there)"
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export JUPYTER_PATH="$JUP/share/jupyter${JUPYTER_PATH:+:$JUPYTER_PATH}"
"$PYTHON" -m monarch_kernel install --prefix "$JUP" 2>&1 | tee -a "$setup_log" ||
    say "the kernelspec did not install (above): tests that start a kernel will fail"
say "$("$PYTHON" --version 2>&1) at $(command -v "$PYTHON"); PYTHONPATH=$PYTHONPATH"
exec "$PYTHON" bench/gpu_check.py "$@"
