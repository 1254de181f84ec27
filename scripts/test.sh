#!/usr/bin/env bash
# Install (CPU torch first: an unpinned torch would pull several GB of CUDA wheels) and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_pip.sh
pip_install "torch==2.13.0"
pip_install -e ".[test]"
export HF_HUB_OFFLINE=1
python3 -m pytest -q -m "not gpu" "$@"
