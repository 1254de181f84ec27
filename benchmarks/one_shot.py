"""The whole one-shot job, process start to file written: `vaeopt decode` as a subprocess against a plain diffusers
script doing the same job (from_pretrained of the same weights, decode, PIL / PyAV write).

    python benchmarks/one_shot.py --out DIR [--jobs sdxl-1024,sdxl-4096,wan21-480p] [--variants cold,warm,warmup,diffusers]
    python benchmarks/one_shot.py --tiny --device cpu --out /tmp/os            # the smoke test

Jobs: sdxl-1024 -> PNG, sdxl-4096 within a 16 GB budget -> PNG (vaeopt: --vram-budget 16, its tiled plan; diffusers:
enable_tiling(), its way to fit), wan21-480p -> MP4 (libx264, crf 18, as vaeopt writes). Weights: the family's
architecture with random weights (seed 0), saved once as a diffusers model folder (config.json + safetensors) that
both load; latents N(0, 1) (seed 0) saved as .pt and decoded as raw latents (--latent-space raw) by both.

Variants (each a fresh process, timed from its start to its exit):
  cold       vaeopt decode with empty Triton and vaeopt caches (a new machine)
  warm       vaeopt decode again with the caches the cold run left (the usual case; without a cold run, one
             untimed run fills them first: primed_s)
  warmup     `vaeopt warmup` of the same model and shape into empty caches (its own time reported), then decode
  diffusers  the plain script (bf16 on a GPU; fp32 on a CPU)
Each row: the process's wall time, and for vaeopt the decode's own seconds from its --json (what its line shows).
A process past --timeout seconds (default 150) is stopped: its row says "timeout", with every thread's stack at that
moment (also printed), and the run goes on with the next row.
Rows land in DIR/one_shot.json (`setup`: one_shot; rows with job, variant, total_s, decode_s, ...; make_tables.py's
one_shot_table renders them); the table is printed last.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import harness as H

JOBS = {  # job -> (workload, output suffix, vaeopt's extra flags)
    "sdxl-1024": ("sdxl-1024", ".png", []),
    "sdxl-4096": ("sdxl-4096", ".png", ["--vram-budget", "16"]),
    "wan21-480p": ("wan21-480p", ".mp4", []),
}
VARIANTS = ("cold", "warm", "warmup", "diffusers")


def prepare(job: str, args, tmp: Path) -> tuple[Path, Path]:
    """The job's model folder and latent file (built once per job)."""
    workload = JOBS[job][0]
    shape, over = H.workload_shape(argparse.Namespace(workload=workload, tiny=args.tiny))
    folder, lat = tmp / f"{job}-vae", tmp / f"{job}-latents.pt"
    if not folder.is_dir():
        H.save_model(H.WORKLOADS[workload][0], folder, over)
    if not lat.is_file():
        H.torch.save(H.randn(shape, 0), lat)
    return folder, lat


def failed(row: dict, p: subprocess.CompletedProcess, secs: float) -> dict:
    """The row of a process that failed or was stopped at --timeout (then with the stacks it printed)."""
    text = (p.stderr or p.stdout or "").strip()
    if p.returncode == H.TIMEOUT_RC:
        return {**row, "status": "timeout", "reason": f"stopped after {secs:.0f} s", "stacks": text[-6000:]}
    return {**row, "status": "failed", "reason": text[-300:]}


def run_variant(job: str, variant: str, folder: Path, lat: Path, args, tmp: Path, caches: dict) -> dict:
    workload, suffix, flags = JOBS[job]
    out = tmp / f"{job}-{variant}{suffix}"
    out.unlink(missing_ok=True)
    dev = ["--device", args.device] if args.device else []
    device = args.device or ("cuda" if H.torch.cuda.is_available() else "cpu")
    row = {"job": job, "workload": workload, "variant": variant, "status": "ok"}
    if args.tiny:
        flags = [f for f in flags if f not in ("--vram-budget", "16")]
    if variant == "diffusers":
        tiled = "1" if job == "sdxl-4096" else "0"
        secs, p = H.timed_run([sys.executable, str(Path(__file__).with_name("plain_decode.py")), str(folder), str(lat),
                               str(out), device, tiled], dict(os.environ), args.timeout)
        if p.returncode == 0:
            row.update(json.loads(p.stdout.strip().splitlines()[-1]))
    else:
        prime = variant == "warm" and job not in caches  # no cold run before it: one untimed run fills the caches
        if variant in ("cold", "warmup") or job not in caches:
            caches[job] = Path(tempfile.mkdtemp(prefix="one-shot-cache-", dir=tmp))  # empty
        root = caches[job]
        env = H.cache_env(root)
        decode = [sys.executable, "-m", "vaeopt", "decode", str(lat), "-m", str(folder), "-o", str(out),
                  "--latent-space", "raw", *dev, *flags, "--json", "-q"]
        if prime:
            row["primed_s"], p = H.timed_run(decode, env, args.timeout)
            out.unlink(missing_ok=True)
            if p.returncode:
                return failed({**row, "failed_in": "prime"}, p, row["primed_s"])
        if variant == "warmup":
            shape = ",".join(map(str, H.torch.load(lat, weights_only=True).shape))
            s, p = H.timed_run([sys.executable, "-m", "vaeopt", "warmup", str(folder), "--shape", shape, *dev,
                                *flags, "-q"], env, args.timeout)
            row["warmup_s"] = s
            if p.returncode:
                return failed({**row, "failed_in": "warmup"}, p, s)
        secs, p = H.timed_run(decode, env, args.timeout)
        if p.returncode == 0:
            doc = json.loads(p.stdout[p.stdout.index("{"):])
            row["decode_s"] = doc["outputs"][0]["seconds"]
            row["plan"] = doc["outputs"][0]["plan"].get("mode") if isinstance(doc["outputs"][0]["plan"], dict) else None
        if variant == "cold":
            caches[job] = root  # the warm variant runs on what the cold run left
    if p.returncode:
        return failed(row, p, secs)
    row.update(total_s=secs, output_bytes=out.stat().st_size if out.is_file() else None)
    if not out.is_file():
        row.update(status="failed", reason="no output written")
    return row


def table(rows: list[dict]) -> str:
    out = [f"{'job':<11} {'variant':<9} {'total s':>8} {'decode s':>9} {'warmup s':>9}  vs diffusers"]
    base = {r["job"]: r["total_s"] for r in rows if r["variant"] == "diffusers" and r["status"] == "ok"}
    for r in rows:
        if r["status"] != "ok":
            out.append(f"{r['job']:<11} {r['variant']:<9} {r['status']}: {r.get('reason', '')[-100:]}")
            continue
        vs = f"{r['total_s'] / base[r['job']]:.2f}x" if r["job"] in base and r["variant"] != "diffusers" else ""
        out.append(f"{r['job']:<11} {r['variant']:<9} {r['total_s']:8.1f} {r.get('decode_s', 0):9.3f} "
                   f"{r.get('warmup_s', 0) or 0:9.1f}  {vs}")
    return "\n".join(out)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", default=",".join(JOBS))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--device", default=None)
    ap.add_argument("--tiny", action="store_true", help="narrow models and small latents (smoke test)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--timeout", type=float, default=150.0,
                    help="seconds one process may take (default 150); past it the row says 'timeout' and where it was")
    args = ap.parse_args(argv)
    jobs, variants = args.jobs.split(","), args.variants.split(",")
    bad = [j for j in jobs if j not in JOBS] + [v for v in variants if v not in VARIANTS]
    if bad:
        ap.error(f"unknown job or variant {bad[0]!r} (jobs: {', '.join(JOBS)}; variants: {', '.join(VARIANTS)})")
    import torch

    dev = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    res = {"setup": "one_shot", "tiny": args.tiny, "device": dev,
           **H.header(torch.device(dev), "python benchmarks/one_shot.py " + " ".join(argv or sys.argv[1:])), "rows": []}
    path = Path(args.out) / "one_shot.json"
    rows = res["rows"]
    tmp = Path(tempfile.mkdtemp(prefix="one-shot-"))
    caches = {}
    try:
        for job in jobs:
            folder, lat = prepare(job, args, tmp)
            for v in sorted(variants, key=VARIANTS.index):  # cold before warm: warm reads what cold left
                rows.append(run_variant(job, v, folder, lat, args, tmp, caches))
                H.write_json(res, path)  # after every row: a run stopped by a time limit keeps what it measured
                print(f"{job} {v}: {rows[-1].get('total_s', 0):.1f} s {rows[-1]['status']}", file=sys.stderr,
                      flush=True)
                if rows[-1]["status"] == "timeout":  # where it was when stopped (faulthandler's stacks)
                    print(rows[-1]["stacks"][-3000:], file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("\n" + table(rows) + f"\n-> {path}")
    return res


if __name__ == "__main__":
    main()
