"""`vaeopt decode` of a HunyuanVideo clip to MP4 as a user runs it: a full-size random-weight checkpoint
(save_pretrained, bf16) and raw latents of 16 frames at 60x106 (61 frames at 480x848), decoded once as planned
and once with --vram-budget 8 (the planner's spatial tiles). Records each run's plan line, peak VRAM and decode time
as the CLI prints them, the wall time, and the MP4's size. Writes $OUT/hunyuan_cli.json; prints a table last.

    python3 benchmarks/gpu_hunyuan_cli.py
"""
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import out_dir, random_model, run_meta  # noqa: E402

work = Path("/tmp/hy_cli")
work.mkdir(exist_ok=True)
random_model("hunyuanvideo").to(torch.bfloat16).save_pretrained(work / "vae")
torch.save({"latents": torch.randn(1, 16, 16, 60, 106, generator=torch.Generator().manual_seed(0))},
           work / "lat.pt")

result = {**run_meta(" ".join(["python3"] + sys.argv)), "note": "", "runs": []}
for name, extra in (("planned", []), ("vram-budget-8", ["--vram-budget", "8"])):
    mp4 = work / f"{name}.mp4"
    cmd = [sys.executable, "-m", "vaeopt", "decode", str(work / "lat.pt"), "--model", str(work / "vae"),
           "-o", str(mp4), "--latent-space", "raw", "--overwrite", *extra]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    text = p.stdout + p.stderr
    m = re.search(r"\(([\d.]+) s decode, peak VRAM ([\d.]+) GiB\)", text)
    plan = next((ln.strip() for ln in text.splitlines() if ln.strip().startswith("plan ")), None)
    result["runs"].append({"name": name, "command": cmd, "rc": p.returncode, "wall_s": wall, "plan": plan,
                           "decode_s": float(m.group(1)) if m else None,
                           "peak_vram_gib": float(m.group(2)) if m else None,
                           "mp4_bytes": mp4.stat().st_size if mp4.exists() else None, "log": text[-6000:]})
    print(text[-3000:], flush=True)

path = out_dir() / "hunyuan_cli.json"
path.write_text(json.dumps(result, indent=1))
print(f"\nwrote {path}")
print(f"{'run':<15} {'rc':>3} {'decode s':>9} {'peak GiB':>9} {'wall s':>7}  plan")
for r in result["runs"]:
    print(f"{r['name']:<15} {r['rc']:>3} {r['decode_s'] or 0:>9.2f} {r['peak_vram_gib'] or 0:>9.2f} "
          f"{r['wall_s']:>7.1f}  {(r['plan'] or '')[:110]}")
