#!/usr/bin/env bash
# Install (CPU torch first: an unpinned torch would pull several GB of CUDA wheels) and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_pip.sh
pip_install "torch==2.13.0"
pip_install -e ".[test]"
export HF_HUB_OFFLINE=1
# One pytest worker per CPU core (pytest-xdist; at most 4, each holds its own torch and models), one intra-op thread
# each (tests/conftest.py), whole test files per worker: a file's module fixtures are built once and its tests run in
# their written order, as in a one-file run. Arguments come after and win (-n 0: one process).
workers=$(python3 -c "import os; print(max(1, min(4, len(os.sched_getaffinity(0)))))")
python3 -m pytest -q -m "not gpu" -n "$workers" --dist loadfile "$@"
