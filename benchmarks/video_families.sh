#!/usr/bin/env bash
# HunyuanVideo 1.5 and LTX-2 on one GPU: diffusers against vaeopt's exact chunk decoder, and the decode within
# emulated 16 GB and 8 GB cards. JSON files go to $OUT (default: benchmarks/results).
# Only the variants (about 200 s): VARIANTS_ONLY=1 bash benchmarks/video_families.sh
#
#   bash benchmarks/video_families.sh            # about 5-6 min on an H200 (HunyuanVideo 1.5 most of it)
#
# The fp32 reference of both workloads is the exact chunk decoder at one latent frame per call (>= 100 dB against
# diffusers' decode in tests/test_video_stream.py): diffusers' fp32 decode runs the whole 121-frame clip in one
# decoder call (over 100 GB for HunyuanVideo 1.5 at 480p).
# HunyuanVideo 1.5 has no torch.compile row: its attention builds its frame-causal mask in a Python loop over every
# token of the clip (49,290 at 480p, 121 frames), which dynamo would unroll; its documented setup,
# pipe.vae.enable_tiling(), is the `tiling` peer instead. diffusers' eager one-call decode of that clip may exceed
# what cuDNN can index: its row then fails with the reason and the rest runs.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results}"
mkdir -p "$OUT"
tag="$(date -u +%Y-%m-%d)"
run() { echo "+ $*" >&2; "$@"; }

if [ -z "${VARIANTS_ONLY:-}" ]; then
    run python3 -m vaeopt benchmark --workload ltx2-768 --peers bf16,compile --repeats 2 --warmup 1 \
        --json "$OUT/h200_ltx2-768_$tag.json"
    run python3 -m vaeopt benchmark --workload hunyuan15-480p --peers bf16,tiling --repeats 1 --warmup 1 \
        --json "$OUT/h200_hunyuan15-480p_$tag.json"
fi
# One thing changed at a time against vaeopt's default (whole clip vs chunks, channels_last_3d, the fused norms) and
# the planner within emulated 16 / 8 GB cards (budget16, budget8; tiled: tiles forced within 8 GB, exact against the
# untiled decode); its table's "decode" column is each row's own peak, held against the estimate and the budget.
# About 80 s (LTX-2) + 110 s (HunyuanVideo 1.5, one repeat: 5 s a decode) on an H200.
run python3 benchmarks/decode_video.py --workload ltx2-768 --repeats 3 --warmup 1 \
    --variants diffusers,vaeopt,whole,chunk1,chunk4,cl,nofused,cl_nofused,budget16,budget8,tiled \
    --json "$OUT/h200_ltx2-768_variants_$tag.json"
run python3 benchmarks/decode_video.py --workload hunyuan15-480p --repeats 1 --warmup 1 \
    --variants diffusers,vaeopt,chunk1,chunk4,nofused,budget16,budget8 \
    --json "$OUT/h200_hunyuan15-480p_variants_$tag.json"
