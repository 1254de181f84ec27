#!/usr/bin/env bash
# Train two candidate video sample VAEs side by side on one GPU and keep both; the better one on the held-out clips
# (OUT/*/video_results.json) is the one to ship:
#   wide:   the shipped layout with a decoder of base width 22 (encoder 16), from scratch;
#   resume: the shipped base-16 model, resumed with whole-clip steps.
# Two processes keep the GPU busy while each one samples its clips; the held-out frames are not rewritten (they are
# made from the same photos by `--which frames` and ship in samples/).
#
#   scripts/train_video_sample.sh OUT [MINUTES] [DATA] [ARGS...]
#
# DATA: the photo pack of `train_sample_vaes.py --which pack` (default .train_data/photos.npz), for a machine without
# scikit-image. MINUTES is each run's training budget; loading and the final measurements add about a minute. ARGS go
# to both runs after the defaults (a CPU check: 0 DATA --max-steps 2 --batch 1 --crop 32).
set -euo pipefail
out=${1:?usage: train_video_sample.sh OUT [MINUTES] [DATA]}
minutes=${2:-6.0}
data=${3:-.train_data/photos.npz}
shift $(( $# < 3 ? $# : 3 ))
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out/wide" "$out/resume"
export PYTHONUNBUFFERED=1
common=(--which video --data "$data" --minutes "$minutes" --batch 16 --skip-frames --log-every 30)
python3 "$here/train_sample_vaes.py" "${common[@]}" --out "$out/wide" --base-dim 16 --decoder-base-dim 22 "$@" \
    >"$out/wide.log" 2>&1 &
wide=$!
python3 "$here/train_sample_vaes.py" "${common[@]}" --out "$out/resume" --base-dim 16 --decoder-base-dim 16 \
    --init "$here/../samples/tiny_wan_video.safetensors" --lr 3e-4 --warmup 50 "$@" >"$out/resume.log" 2>&1 &
resume=$!
rc=0
wait $wide || rc=$?
wait $resume || rc=$?
for run in wide resume; do
    echo "== $run"
    grep -E "parameters|it/s|trained|encoder frozen|astronaut_pan|coffee_zoom|Error|error" "$out/$run.log" \
        | cut -c1-220 | tail -n 12 || true
done
exit $rc
