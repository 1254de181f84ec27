"""The user's path for FP8 level 3 on sm_90: `vaeopt decode latents.pt --model vae.safetensors --fp8 on`, with a
random-weight SDXL checkpoint (diffusers' default init, seed 0) written here and a 1024² latent (N(0, 1), as a
pipeline hands it over; LAT=8 for a quick CPU check). Prints the CLI's
lines (the fp8 convs stage line says int8 or e4m3, where the gate measured, and its time).

    python3 benchmarks/gpu_cli_int8.py   # writes .gpu/ files (ignored), $OUT/cli_int8.txt and $OUT/cli_int8.json

Runs --fp8 on twice (the second process has the Triton kernels in its disk cache: the gate's own time), then off.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import run_meta  # noqa: E402
from vaeopt.loading import load_vae  # noqa: E402

work = Path(".gpu")
work.mkdir(exist_ok=True)
torch.manual_seed(0)
model = load_vae(None, family="sdxl").model
save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(work / "sdxl_random.safetensors"))
torch.save({"samples": torch.randn(1, 4, int(os.environ.get("LAT", 128)), int(os.environ.get("LAT", 128)), generator=torch.Generator().manual_seed(1))},
           work / "lat.pt")
out = Path(os.environ.get("OUT", "out"))
out.mkdir(parents=True, exist_ok=True)
lines = []
# twice with --fp8 on: the second process finds the Triton kernels in the disk cache (the gate's own time)
for i, fp8 in enumerate(("on", "on", "off")):
    r = subprocess.run([sys.executable, "-m", "vaeopt", "decode", str(work / "lat.pt"), "--model",
                        str(work / "sdxl_random.safetensors"), "--fp8", fp8, "-o", str(work / f"img_{fp8}{i}.png"),
                        "--overwrite", "--latent-space", "scaled"], capture_output=True, text=True)
    lines.append(f"$ vaeopt decode ... --fp8 {fp8}  (exit {r.returncode})\n{r.stdout}{r.stderr[-2000:]}")
    print(lines[-1], flush=True)
(out / "cli_int8.txt").write_text("\n".join(lines))
gate_s = [float(m) for m in re.findall(r"gate probes ([0-9.]+) s", "\n".join(lines))]
(out / "cli_int8.json").write_text(json.dumps({"gate_s_per_fp8_run": gate_s, "transcript": lines,
                                               **run_meta("python3 benchmarks/gpu_cli_int8.py")}, indent=1))
