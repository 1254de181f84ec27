"""Measure CUDA graph replay against eager launches of whole image decodes, per workload, size and variant, and write
the rows of vaeopt/configs/graphs_rule.json (the table planner.graphs_pay reads).

    python benchmarks/graphs_rule.py --out DIR                     # the default workloads and sizes below
    python benchmarks/graphs_rule.py --out DIR --only sdxl:1024,flux:1024:8bit --repeats 20
    python benchmarks/graphs_rule.py --tiny --device cpu --out /tmp/g   # smoke test (eager only: no graphs on a CPU)

Per row, in one process per model: the pipeline `vaeopt decode` builds (random weights, bf16; "8bit": --fp8 on, the
8-bit convs where the gate keeps them), the eager decode timed (CUDA events, median of --repeats after a warm-up),
then the graphs stage enabled: the first call (warm-up + capture + replay) timed as capture_ms, then the replays.
DIR/graphs_rule.json is the config file with these rows (the shipped rows not measured again kept; copy it to
vaeopt/configs/ to ship them), DIR/graphs_rule_rows.json every row with its status; the table last.
"""

import argparse
import json
import os
import statistics
import sys
import time

import harness as H
import torch

# (family, output side px, variant): the sizes where the rule has to decide (512² to 2048²) for the image families
DEFAULT = ("sd15:512", "sd15:1024", "sdxl:512", "sdxl:1024", "sdxl:2048", "flux:1024", "flux:1024:8bit",
           "sdxl:1024:8bit")


def timed(pipe, z, plan, repeats: int) -> list[float]:
    """ms of `repeats` decodes by the pipeline's own clock (launch to the last kernel, not the copy to the host)."""
    return [pipe.decode(z, plan)[1].seconds * 1e3 for _ in range(repeats)]


def measure(family: str, variant: str, sides: list[int], args, device) -> list[dict]:
    from vaeopt.families import build_model, get_family
    from vaeopt.loading import LoadedVAE
    from vaeopt.pipeline import Options, Pipeline

    spec = get_family(family)
    over = H.TINY["AutoencoderKL"][0] if args.tiny else {}
    spec = spec.with_config(over) if over else spec
    f = spec.spatial_factor
    shapes = [(1, spec.latent_channels, s // f, s // f) for s in sides]
    torch.manual_seed(0)
    model = build_model(spec, **over).eval().requires_grad_(False)
    dtype = "bf16" if device.type == "cuda" else "fp32"
    opts = Options(device=str(device), dtype=dtype, fp8="on" if variant == "8bit" else "off",
                   decode_shape=max(shapes, key=lambda s: s[-1]))
    pipe = Pipeline(LoadedVAE(model, spec, "benchmark", None, []), opts, log=None)
    eight = any(s.name == "fp8 convs" and s.status == "applied" for s in pipe.stages)
    rows = []
    for shape in shapes:
        z = H.randn(shape, 0).to(device, pipe.dtype)
        plan = pipe.plan(shape)
        row = {"family": spec.name, "cls": spec.cls_name, "workload": None, "pixels": shape[-2] * shape[-1] * f * f,
               "variant": variant, "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
               "shape": list(shape), "plan": plan.mode}
        if variant == "8bit" and not eight:
            rows.append({**row, "status": "skipped", "reason": "the 8-bit convs did not run here"})
            continue
        pipe.graphed = None
        with torch.inference_mode():
            timed(pipe, z, plan, 2)  # compiles, cuDNN's first choice
            row["eager_ms"] = statistics.median(timed(pipe, z, plan, args.repeats))
            if device.type != "cuda":
                rows.append({**row, "status": "skipped", "reason": "CUDA graphs need a GPU", "replay_ms": None,
                             "capture_ms": None})
                continue
            pipe.enable_graphs("graphs_rule.py")
            row["capture_ms"] = timed(pipe, z, plan, 1)[0]  # warm-up + capture + the first replay
            row["replay_ms"] = statistics.median(timed(pipe, z, plan, args.repeats))
        row["status"] = "ok"
        rows.append(row)
        pipe.graphed = None
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(DEFAULT), help="family:side[:8bit], comma-separated")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--device", default=None)
    ap.add_argument("--tiny", action="store_true", help="narrow models (smoke test)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    groups: dict = {}
    for item in args.only.split(","):
        fam, side, *var = item.split(":")
        groups.setdefault((fam, var[0] if var else "bf16"), []).append(int(side) // (8 if args.tiny else 1))
    rows = []
    for (fam, var), sides in groups.items():
        try:
            rows += measure(fam, var, sides, args, device)
        except torch.cuda.OutOfMemoryError as e:
            rows.append({"family": fam, "variant": var, "status": "failed", "reason": str(e).splitlines()[0][:120]})
        H.write_json({"measured": rows, "device": str(device)}, H.Path(args.out) / "graphs_rule_rows.json")
        print(f"{fam} {var}: done", file=sys.stderr, flush=True)
    from vaeopt.benchmark import WORKLOADS

    for r in rows:  # name the standard workloads
        r["workload"] = next((w for w, (fam, shp) in WORKLOADS.items() if fam == r.get("family")
                              and list(shp) == r.get("shape")), None)
    base = json.loads((H.ROOT / "vaeopt" / "configs" / "graphs_rule.json").read_text())
    git = H.git_revision()
    src = (f"python benchmarks/graphs_rule.py {' '.join(argv if argv is not None else sys.argv[1:])} "
           f"(git {str(git['rev'])[:10]}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')})")
    ok = [r for r in rows if r["status"] == "ok"]
    caps = [r["capture_ms"] / r["eager_ms"] for r in ok]
    new = [{k: r[k] for k in ("family", "cls", "workload", "pixels", "variant", "gpu", "eager_ms", "replay_ms",
                              "capture_ms", "shape")} | {"source": src} for r in ok]
    seen = {(r["family"], r["variant"], r["pixels"], r["gpu"]) for r in new}  # rows not measured again are kept
    kept = [r for r in base["rows"] if (r["family"], r["variant"], r["pixels"], r["gpu"]) not in seen]
    table = {**base, "capture_factor": round(statistics.median(caps), 2) if caps else base["capture_factor"],
             "rows": new + kept}
    path = H.Path(args.out) / "graphs_rule.json"
    H.write_json({"measured": rows, "device": str(device), "git": git}, H.Path(args.out) / "graphs_rule_rows.json")
    if ok:
        H.write_json(table, path)
    print(f"\n{'family':<6} {'variant':<5} {'side':>5} {'eager':>8} {'replay':>8} {'capture':>8} {'saving':>7}  (ms)")
    for r in rows:
        if r["status"] != "ok":
            print(f"{r.get('family', '?'):<6} {r.get('variant', '?'):<5} {r.get('shape', [0])[-1] * 8:>5} "
                  f"{r['status']}: {r.get('reason', '')} (eager {r.get('eager_ms') or 0:.2f})")
            continue
        print(f"{r['family']:<6} {r['variant']:<5} {r['shape'][-1] * 8:>5} {r['eager_ms']:8.2f} {r['replay_ms']:8.2f} "
              f"{r['capture_ms']:8.1f} {100 * (1 - r['replay_ms'] / r['eager_ms']):6.1f}%")
    print(f"-> {path if ok else '(no graph rows: nothing written to the table)'}")
    return table


if __name__ == "__main__":
    main()
