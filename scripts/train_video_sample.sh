#!/usr/bin/env bash
# Train the video sample VAE on one GPU and measure it on the held-out clips (OUT/RUN/video_results.json):
#   resume: the shipped base-16 model, resumed (default: alone on the GPU);
#   wide:   the shipped layout with a decoder of base width 22 (encoder 16), from scratch.
# The fast step: the whole-clip encoder and decoder compiled (torch.compile; eager if the compile fails), bf16,
# channels_last_3d, and small crops (96x96, batch 16: a third of the pixels per clip) for the first half of the run
# before the full 160x160 crops; the last quarter trains the decoder alone on its fp16 latents. The held-out frames
# are not rewritten (they are made from the same photos by `--which frames` and ship in samples/).
#
#   scripts/train_video_sample.sh OUT [MINUTES] [DATA] [ARGS...]
#   RUNS="resume wide" scripts/train_video_sample.sh OUT ...   # both, side by side (each at about half the speed)
#
# DATA: the photo pack of `train_sample_vaes.py --which pack` (default .train_data/photos.npz), for a machine without
# scikit-image. MINUTES is each run's training budget, compile included; loading and the final measurements add
# under a minute. ARGS go to every run after the defaults (a CPU check: 0 DATA --max-steps 4 --batch 1 --crop 32
# --small-crop 16 --compile off). Writes OUT/RUN.log and OUT/RUN/{tiny_wan_video.safetensors,
# tiny_wan_video_latents.pt,video_results.json}.
set -euo pipefail
out=${1:?usage: train_video_sample.sh OUT [MINUTES] [DATA] [ARGS...]}
minutes=${2:-6.3}
data=${3:-.train_data/photos.npz}
shift $(( $# < 3 ? $# : 3 ))
here=$(cd "$(dirname "$0")" && pwd)
export PYTHONUNBUFFERED=1
fast=(--compile default --channels-last --batch 16 --crop 160 --small-crop 96 --small-batch 16 --small-frac 0.5
      --decoder-only 0.25)
common=(--which video --data "$data" --minutes "$minutes" --skip-frames --log-every 30 "${fast[@]}")
declare -A model=(
    [resume]="--base-dim 16 --decoder-base-dim 16 --init $here/../samples/tiny_wan_video.safetensors --lr 3e-4 --warmup 50"
    [wide]="--base-dim 16 --decoder-base-dim 22"
)
pids=()
for run in ${RUNS:-resume}; do
    [[ -n "${model[$run]:-}" ]] || { echo "RUNS: unknown run '$run' (resume, wide)" >&2; exit 2; }
    mkdir -p "$out/$run"
    # shellcheck disable=SC2086  # the model's arguments split on spaces
    python3 "$here/train_sample_vaes.py" "${common[@]}" --out "$out/$run" ${model[$run]} "$@" >"$out/$run.log" 2>&1 &
    pids+=($!)
done
rc=0
for pid in "${pids[@]}"; do
    wait "$pid" || rc=$?
done
for run in ${RUNS:-resume}; do
    echo "== $run"
    grep -E "parameters|it/s|trained|encoder frozen|clips|compile|astronaut_pan|coffee_zoom|Error|error" \
        "$out/$run.log" | cut -c1-220 | tail -n 16 || true
done
exit $rc
