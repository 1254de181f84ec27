"""Where the seconds of a one-shot `vaeopt decode` process go, phase by phase, beside a plain diffusers script doing
the same job (from_pretrained, decode, PIL save), each a fresh process timed from its start to its exit.

    python3 scripts/one_shot_phases.py --out "$OUT"                                  # sdxl-1024 on the GPU (~5 min)
    python3 scripts/one_shot_phases.py --device cpu --latent 1,4,16,16 --out /tmp/p  # full-size weights, small decode
    python3 scripts/one_shot_phases.py --family wan21 --latent 1,16,21,60,104 --out "$OUT"   # wan21-480p -> MP4

The model: the family's architecture with random weights (seed 0) saved as a diffusers folder, as
benchmarks/one_shot.py builds it; latents N(0, 1), decoded as raw latents by both. `plain` is
benchmarks/plain_decode.py, one_shot.py's plain script, with its marks on. Runs: `vaeopt` (as shipped),
`fullexit` (VAEOPT_FAST_EXIT=off: the interpreter's teardown kept), `noprewarm` (VAEOPT_PREWARM=off), `libraries`
(VAEOPT_PREWARM=libraries: the warm-up thread without the kernels), `early` (VAEOPT_PREWARM=early: the kernels
loaded beside the diffusers import), `importgc` (VAEOPT_IMPORT_GC=on: Python's garbage collector left running
through the imports), `notriton` (--triton/--epilogues/--upsample-conv/--conv-kernel off), and `plain`.
One untimed run of each first fills Triton's and vaeopt's caches (as one_shot.py's warm variant), then --repeats
timed runs; the table shows each phase's median seconds. A phase is the time from the previous mark to its own:
    python    interpreter start to the first line of the command (site, the interpreter itself)
    cli       vaeopt.cli (typer, rich, vaeopt's command modules) / plain: nothing
    torch     vaeopt.api with torch and the stage modules (Triton's import among them) / plain: torch + diffusers top
    read      the latent file read and checked
    diffusers diffusers' VAE classes imported while the GPU warm-up thread starts (vaeopt) / plain: its model class
    load      the checkpoint read, checked and built (vaeopt.loading.load_vae) / plain: from_pretrained + .to(device)
    plan      output names, checks, the plan
    stages    vaeopt.Pipeline: the warm-up thread joined, weights to the device, the stages applied
    decode    the decode (synchronized) / the same in plain
    write     to uint8 and the PNG written (atomically for vaeopt); a clip's MP4: vaeopt encodes frames as they are
              decoded, so there its decode is in this phase too (and "decode" is 0)
    report    the --json summary and what else runs after the file is written, up to the atexit handlers
    exit      the rest of the process's exit: the interpreter's teardown and CUDA's (measured by the parent)
Below the phases, for vaeopt's runs, the warm-up thread (vaeopt.prewarm): its own seconds (pw s), the Triton kernels
it loaded before the join (pw kern), when it began them, seconds after it started (pw k@), and how long the join
waited for it (pw wait).
Prints the table; writes one_shot_phases.json under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PREWARM = {"noprewarm": "off", "libraries": "libraries", "early": "early"}  # variant -> VAEOPT_PREWARM
PW = ("pw s", "pw kern", "pw k@", "pw wait")  # the warm-up thread's (vaeopt.prewarm's summary), where there was one
PHASES = ("python", "cli", "torch", "read", "diffusers", "load", "plan", "stages", "decode", "write", "report", "exit")

# Runs `vaeopt` in the child with marks at the public entry points the command goes through (each wrapped, the
# behaviour unchanged); the marks go to the file named by $PHASES_OUT at exit.
VAEOPT_CHILD = r'''
import atexit, json, os, sys, time
T0 = float(os.environ["PHASES_T0"]); marks = []; info = {}
def mark(name): marks.append((name, time.time() - T0))
atexit.register(lambda: (mark("atexit"), open(os.environ["PHASES_OUT"], "w").write(json.dumps(
    {"marks": marks, **info}))))
mark("python")
import vaeopt.cli
mark("cli")
from vaeopt.cli.decode import imports_without_gc
with imports_without_gc():  # (as `vaeopt decode` imports these: the garbage collector paused, unless VAEOPT_IMPORT_GC=on)
    import vaeopt.api, vaeopt.latents, vaeopt.loading, vaeopt.outputs, vaeopt.pipeline, vaeopt.prewarm
mark("torch")
import torch
def wrap(owner, attr, before=None, after=None, sync=False):
    f = getattr(owner, attr)
    def w(*a, **k):
        if before: mark(before)
        r = f(*a, **k)
        if sync and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        if after: mark(after)
        return r
    setattr(owner, attr, w)
wrap(vaeopt.latents, "read_latents", after="read")
wrap(vaeopt.prewarm, "start", before="prewarm_start")
join = vaeopt.prewarm.Prewarm.join
def joined(self, *a, **k):
    join(self, *a, **k)
    info.setdefault("prewarm", self.summary())
vaeopt.prewarm.Prewarm.join = joined
wrap(vaeopt.loading, "load_vae", before="diffusers", after="load")
wrap(vaeopt.api, "plan_jobs", after="plan")
P = vaeopt.pipeline.Pipeline
wrap(P, "__init__", after="stages")
wrap(P, "decode", after="decode", sync=True)
wrap(vaeopt.api, "write_job", after="write")
wrap(vaeopt.api, "run_jobs", after="write")  # (a clip's frames are encoded as they are decoded: both in "write")
sys.argv = ["vaeopt"] + sys.argv[1:]
vaeopt.cli.run()  # as `python -m vaeopt` runs it: its exit included
'''

def build(tmp: Path, family: str, latent: tuple) -> tuple[Path, Path]:
    import harness as H
    import torch

    folder, lat = H.save_model(family, tmp / "vae"), tmp / "latents.pt"
    torch.save(H.randn(latent, 0), lat)
    return folder, lat


def run_once(variant: str, folder: Path, lat: Path, out: Path, device: str, env: dict) -> dict:
    out.unlink(missing_ok=True)
    marks_file = out.with_suffix(".marks.json")
    env = dict(env, PHASES_OUT=str(marks_file))
    if variant == "plain":
        cmd = [sys.executable, str(ROOT / "benchmarks" / "plain_decode.py"), str(folder), str(lat), str(out), device]
    else:
        cmd = [sys.executable, "-c", VAEOPT_CHILD, "decode", str(lat), "-m", str(folder), "-o", str(out),
               "--latent-space", "raw", "--device", device, "--json", "-q"]
        if variant in PREWARM:
            env["VAEOPT_PREWARM"] = PREWARM[variant]
        if variant == "importgc":
            env["VAEOPT_IMPORT_GC"] = "on"
        if variant == "fullexit":
            env["VAEOPT_FAST_EXIT"] = "off"
        if variant == "notriton":
            cmd += ["--triton", "off", "--epilogues", "off", "--upsample-conv", "off", "--conv-kernel", "off"]
    env["PHASES_T0"] = repr(time.time())
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    total = time.time() - t0
    if p.returncode or not out.is_file():
        raise SystemExit(f"{variant} failed ({p.returncode}): {(p.stderr or p.stdout).strip()[-400:]}")
    doc = json.loads(marks_file.read_text())
    marks, pw = doc["marks"], doc.get("prewarm")
    at = {}
    for name, t in marks:
        at.setdefault(name, t)  # the first decode / write of the process
    row, prev = {}, 0.0
    for ph in PHASES[:-1]:
        t = at.get(ph, prev)
        row[ph] = t - prev
        prev = t
    row["exit"] = total - at.get("atexit", prev)
    row["report"] += at.get("atexit", prev) - prev  # atexit handlers run before the interpreter's own teardown
    row["total"] = total
    if pw:
        row.update(zip(PW, (pw["seconds"], pw["kernels"], pw.get("kernels_after"), pw["waited"])))
    return row


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="sdxl")
    ap.add_argument("--latent", default="1,4,128,128", help="latent shape (default: sdxl at 1024²)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--variants", default="vaeopt,fullexit,noprewarm,notriton,plain")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT / "benchmarks"))  # the harness, which puts the repository first
    import harness as H
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    latent = tuple(int(s) for s in args.latent.split(","))
    tmp = Path(tempfile.mkdtemp(prefix="one-shot-phases-"))
    folder, lat = build(tmp, args.family, latent)
    suffix = ".mp4" if len(latent) == 5 else ".png"
    env = H.cache_env(tmp, HF_HUB_OFFLINE="1")
    variants = args.variants.split(",")
    rows = {v: [] for v in variants}
    for v in variants:  # one untimed run each: the caches filled, as for one_shot.py's warm variant
        run_once(v, folder, lat, tmp / f"{v}{suffix}", device, env)
    res = {"setup": "one_shot_phases", "device": device, "family": args.family, "latent": list(latent),
           "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else None,
           "versions": {"torch": torch.__version__}, "runs": rows}
    path = Path(args.out) / "one_shot_phases.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(args.repeats):  # interleaved: a busy machine slows every variant alike
        for v in variants:
            rows[v].append(run_once(v, folder, lat, tmp / f"{v}{suffix}", device, env))
            print(f"{v}: {rows[v][-1]['total']:.2f} s", file=sys.stderr, flush=True)
            path.write_text(json.dumps(res, indent=1))  # after every run: a run stopped by a time limit keeps them
    def median(rs, k):
        got = [r[k] for r in rs if r.get(k) is not None]
        return statistics.median(got) if got else None

    med = {v: {k: median(rs, k) for k in (*PHASES, "total", *PW)} for v, rs in rows.items()}
    lines = [f"{'phase':<10}" + "".join(f"{v:>11}" for v in variants)]
    for k in (*PHASES, "total", *PW):
        lines.append(f"{k:<10}" + "".join(f"{'-':>11}" if med[v][k] is None else f"{med[v][k]:11.2f}"
                                          for v in variants))
    print("\n".join(lines))
    res["median_s"] = med
    path.write_text(json.dumps(res, indent=1))
    shutil.rmtree(tmp, ignore_errors=True)
    return res


if __name__ == "__main__":
    main()
