"""Why `vaeopt benchmark --fp8`'s level-1/2 rows peaked higher than 'vaeopt plain' (sdxl-1024 on an H200: 2.57 ->
3.16 / 3.65 GiB, h200_sdxl-1024-gate30-fp8-levels_2026-11-28.json) while the decoder's weights halved.

    python3 benchmarks/gpu_fp8_peak.py      # $OUT/fp8_peak.json

sdxl-1024 with random weights on the plain path (every stage off, as the benchmark's level rows), each variant in a
fresh model after gc: memory allocated before the decode (the weights and whatever else stays), the decode's peak
above it, the decoder's weight bytes on the GPU, and the decode time. Variants: fp8 off; no-op forward pre/post
hooks on every conv (the storage hooks' mechanism alone); fp8 weights (level 1); fp8 gemm (levels 1-2). Gate 0, so
that every level applies on random weights.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import event_ms, make_pipe, out_dir, run_meta  # noqa: E402

PLAIN = dict(channels_last="off", triton="off", epilogues="off", upsample_conv="off", stack_conv3d="off",
             conv_kernel="off", attention="off", gate_db=0.0)
OUT = out_dir()
res = {"meta": run_meta("python3 benchmarks/gpu_fp8_peak.py"), "variants": []}
z = torch.randn(1, 4, 128, 128, generator=torch.Generator().manual_seed(0)).cuda().bfloat16()
for name, mode, hooks in [("off", "off", False), ("no-op conv hooks", "off", True), ("fp8 weights", "weights", False),
                          ("fp8 gemm", "gemm", False), ("off again", "off", False)]:
    gc.collect()
    torch.cuda.empty_cache()
    pipe = make_pipe("sdxl", fp8=mode, **PLAIN)
    dec = pipe.model.decoder
    if hooks:
        for m in dec.modules():
            if isinstance(m, torch.nn.Conv2d):
                m.register_forward_pre_hook(lambda mod, args: None)
                m.register_forward_hook(lambda mod, args, out: None)
    wbytes = sum(t.numel() * t.element_size() for m in dec.modules()
                 for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)) if t.is_cuda)
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.inference_mode():
        for _ in range(2):
            out = pipe.model.decode(z).sample
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        ms = event_ms(lambda: pipe.model.decode(z).sample, reps=5, warmup=1)
    st = next(s for s in pipe.stages if s.name == "fp8")
    res["variants"].append({"name": name, "fp8_status": st.status, "fp8_detail": st.detail[:160],
                            "base_gib": base / 2**30, "peak_gib": peak / 2**30, "above_base_gib": (peak - base) / 2**30,
                            "decoder_weights_mib": wbytes / 2**20, "ms": ms})
    del pipe, dec, out
(OUT / "fp8_peak.json").write_text(json.dumps(res, indent=1))
print(f"{'variant':18} {'fp8':9} {'base GiB':>9} {'peak GiB':>9} {'above':>7} {'dec MiB':>8} {'ms':>7}")
for v in res["variants"]:
    print(f"{v['name']:18} {v['fp8_status']:9} {v['base_gib']:9.3f} {v['peak_gib']:9.3f} {v['above_base_gib']:7.3f} "
          f"{v['decoder_weights_mib']:8.1f} {v['ms']:7.1f}")
