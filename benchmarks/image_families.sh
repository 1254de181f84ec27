#!/usr/bin/env bash
# FLUX.2 and Qwen-Image pictures on one GPU: diffusers (eager and torch.compile) against vaeopt's ladder, and the
# decode within emulated 16 GB and 8 GB cards (tiled where the planner tiles; PSNR vs fp32 next to the untiled
# vaeopt row). JSON files go to $OUT (default: benchmarks/results).
#
#   bash benchmarks/image_families.sh            # under 400 s on an H200 (the two torch.compile warm-ups most of it)
#
# Qwen-Image's VAE is Wan 2.1's: a picture is one latent frame, decoded by the Wan chunk decoder in one call
# (decode_video.py), whose "+ CUDA graphs" row captures that call whole.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results}"
mkdir -p "$OUT"
tag="$(date -u +%Y-%m-%d)"
run() { echo "+ $*" >&2; "$@"; }

for w in flux2-1024 qwenimage-1328; do
    run python3 -m vaeopt benchmark --workload "$w" --peers bf16,compile --repeats 3 --warmup 1 \
        --json "$OUT/h200_${w}_compile_$tag.json"
done
for gb in 16 8; do
    run python3 benchmarks/decode_image.py --workload flux2-1024 --variants vaeopt,tiled --vram-budget "$gb" \
        --repeats 2 --warmup 1 --json "$OUT/h200_flux2-1024_budget${gb}_$tag.json"
    run python3 benchmarks/decode_video.py --workload qwenimage-1328 --variants vaeopt,budget,tiled \
        --vram-budget "$gb" --repeats 2 --warmup 1 --json "$OUT/h200_qwenimage-1328_budget${gb}_$tag.json"
done
echo "image_families.sh: ${SECONDS} s" >&2
