#!/usr/bin/env bash
# FP8's three levels on the GPU, each on its own (vaeopt benchmark --fp8's fp8_levels), the --fp8 weights / gemm
# modes through `vaeopt decode` on the default fused path, and the GPU tests of the files they touch.
#
#     bash benchmarks/gpu_fp8_levels.sh [STEP...]   # on the device machine, .whl carried (shared/GPU.md)
#
# STEPs (default: tests decodes bench): tests | decodes | bench (sdxl-1024 at the default gate) | bench30 (sdxl-1024
# at a 30 dB gate) | tiny (the trained tiny KL VAE's own workload at the default gate). Writes under $OUT:
# gpu_tests.log, decode_modes.log, <gpu>_<what>-fp8-levels.json and their logs; the levels are printed last.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
py=python3
gpu=$($py -c "import torch; n = torch.cuda.get_device_name(); print('h200' if 'H200' in n else 'h100' if 'H100' in n else 'gpu')")
steps=${*:-tests decodes bench}

bench() {  # name, vaeopt benchmark arguments...
    local name=$1; shift
    echo "== vaeopt benchmark $* --fp8"
    $py -m vaeopt benchmark "$@" --peers bf16 --repeats 5 --fp8 --json "$OUT/${gpu}_${name}-fp8-levels.json" 2>&1 \
        | tee "$OUT/${gpu}_${name}-fp8-levels.log" | grep -E "^(FP8 level|wrote|error)|^[│┃┏└]" | cut -c1-240
}

for step in $steps; do
    case $step in
    tests)
        echo "== GPU tests of the touched files"
        $py -m pytest -q -m gpu -p no:cacheprovider tests/test_fp8.py tests/test_benchmark.py \
            tests/test_kernel_tma_conv.py tests/test_stage_triton_conv.py tests/test_stage_fused_epilogues.py 2>&1 \
            | tee "$OUT/gpu_tests.log" | tail -5 ;;
    decodes)
        echo "== vaeopt decode --fp8 weights / gemm / on (the trained tiny VAEs, default stages)"
        for mode in weights gemm on; do
            for m in kl wan; do
                if [ $m = kl ]; then lat=(samples/tiny_kl_image_latents.pt); model=samples/tiny_kl_image.safetensors
                else lat=(samples/tiny_wan_video_latents.pt --key astronaut_pan); model=samples/tiny_wan_video.safetensors; fi
                echo "-- $m --fp8 $mode"
                $py -m vaeopt decode "${lat[@]}" --model "$model" --fp8 "$mode" -o "$OUT/dec_${m}_${mode}/" --overwrite \
                    2>&1 | grep -E "fp8|rror|wrote|Traceback" | head -8
                rm -rf "$OUT/dec_${m}_${mode}"
            done
        done 2>&1 | tee "$OUT/decode_modes.log" ;;
    bench) bench sdxl-1024 --workload sdxl-1024 --fp8-gate 40 ;;
    bench30) bench sdxl-1024-gate30 --workload sdxl-1024 --fp8-gate 30 ;;
    tiny) bench tiny_kl_image samples/tiny_kl_image.safetensors --fp8-gate 40 ;;
    *) echo "unknown step $step"; exit 2 ;;
    esac
done
