#!/usr/bin/env bash
# Install vaeopt and decode the bundled sample latents with the bundled (trained, tiny) sample VAE.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q "torch==2.13.0" 2>&1 | grep -v "as the 'root' user" || true
python3 -m pip install -q -e . 2>&1 | grep -v "as the 'root' user" || true
vaeopt info
vaeopt decode samples/tiny_kl_image_latents.pt -o samples/out/ --overwrite
vaeopt decode samples/tiny_wan_video_latents.pt --key bikes -o samples/out/bikes.mp4 --overwrite
