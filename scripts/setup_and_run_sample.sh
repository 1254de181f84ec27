#!/usr/bin/env bash
# Install vaeopt and decode the bundled sample latents with the bundled (trained, tiny) sample VAE.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_pip.sh
pip_install "torch==2.13.0"
pip_install -e .
# python3 -m vaeopt: the interpreter that was just installed into, whatever `vaeopt` on PATH is
python3 -m vaeopt info
python3 -m vaeopt decode samples/tiny_kl_image_latents.pt -o samples/out/ --overwrite
python3 -m vaeopt decode samples/tiny_wan_video_latents.pt --key astronaut_pan -o samples/out/astronaut_pan.mp4 --overwrite
