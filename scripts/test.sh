#!/usr/bin/env bash
# Install (CPU torch first: an unpinned torch would pull several GB of CUDA wheels) and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q "torch==2.13.0" 2>&1 | grep -v "as the 'root' user" || true
python3 -m pip install -q -e ".[test]" 2>&1 | grep -v "as the 'root' user" || true
export HF_HUB_OFFLINE=1
python3 -m pytest -q -m "not gpu" "$@"
