"""The host store of a tiled image decode on a GPU: what pinning costs, and the first decode of a process.

    python3 scripts/gpu_store_check.py --out DIR                    # on a CUDA machine, about two minutes
    python3 scripts/gpu_store_check.py --out /tmp/s --tiny          # the same steps, small (CPU or GPU)

(i) Pinning 4 GiB of host memory, each way in a fresh process: torch's default (cudaHostAlloc) and torch's
``pinned_use_cuda_host_register`` option with 1 and 8 threads (through vaeopt.engine.store.fast_pinning, as the
tiled decoder pins), each with the host->device copy speed out of the buffer.
(ii) sdxl at 4096² (latent (1, 4, 512, 512), bf16, random weights) within a 16 GB budget: a warm-up process fills
Triton's cache and records the kernels it loads; then a fresh process per variant (the GPU warmed and those kernels
preloaded on a thread while the model is built, as `vaeopt decode` does) times its first decode and the steady ones,
reports where the buffers went (GPU, host) and what pinning took, and checks the decode bitwise against one with
every buffer on the host. Variants (--variants): ``default``; ``nopinahead`` (VAEOPT_PIN_AHEAD=off: each host buffer
pinned when the decode allocates it); ``halves`` (VAEOPT_PLACEMENT=halves and VAEOPT_PIN_AHEAD=off: the tile choice
and pinning before both changes). Prints a table; writes gpu_store_check.json under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

T0 = time.perf_counter()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
GIB = 2**30
VARIANTS = {"default": {}, "nopinahead": {"VAEOPT_PIN_AHEAD": "off"},
            "halves": {"VAEOPT_PLACEMENT": "halves", "VAEOPT_PIN_AHEAD": "off"}}


def pin_child(mode: str, gib: float) -> dict:
    import torch

    from vaeopt.engine import store

    cuda = torch.cuda.is_available()
    if cuda:
        torch.empty(1, device="cuda")  # the context first: not part of the pinning time
    n = int(gib * GIB)
    threads = int(mode[len("register"):]) if mode.startswith("register") else 0
    t = time.perf_counter()
    if threads:
        with store.fast_pinning(threads) as switched:
            x = torch.empty(n, dtype=torch.uint8, pin_memory=cuda)
    else:
        switched = False
        x = torch.empty(n, dtype=torch.uint8, pin_memory=cuda)
    alloc_s = time.perf_counter() - t
    r = {"mode": mode, "gib": gib, "alloc_s": alloc_s, "pinned": bool(cuda and x.is_pinned()), "switched": switched}
    if cuda:
        d = torch.empty(n, dtype=torch.uint8, device="cuda")
        for _ in range(2):  # the second copy is the timed one
            torch.cuda.synchronize()
            t = time.perf_counter()
            d.copy_(x, non_blocking=True)
            torch.cuda.synchronize()
        r["h2d_gb_s"] = n / (time.perf_counter() - t) / 1e9
    return r


def decode_child(tiny: bool, steady: int, check: bool) -> dict:
    import torch

    from vaeopt import prewarm, tiling
    from vaeopt.families import build_model, get_family
    from vaeopt.loading import LoadedVAE
    from vaeopt.pipeline import Options, Pipeline

    phases = {"import_s": time.perf_counter() - T0}

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    fam = get_family("sdxl")
    over = dict(block_out_channels=(32, 32, 64, 64), layers_per_block=1, norm_num_groups=8) if tiny else {}
    shape = (1, 4, 64, 64) if tiny else (1, 4, 512, 512)
    budget = 0.02 if tiny else 16.0  # GB: the tiny decode is tiled too
    opts = Options(device=str(dev), dtype="bf16" if dev.type == "cuda" else "fp32", vram_budget_gb=budget,
                   decode_shape=shape)
    # as `vaeopt decode` runs: the GPU warmed on a thread while the model is built (the Triton kernels the last
    # process of this check loaded, preloaded), joined before the stages; the kernels this one loads are recorded
    key = prewarm.key(f"gpu_store_check:{'tiny' if tiny else 'sdxl-4096'}", opts)
    t = time.perf_counter()
    pw = prewarm.start(dev, torch.bfloat16 if dev.type == "cuda" else torch.float32, key)
    torch.manual_seed(0)
    model = build_model(fam, **over).to(dev)
    phases["build_s"] = time.perf_counter() - t
    if pw is not None:
        pw.join()
    phases["prewarm"] = pw.summary() if pw is not None else None
    record = prewarm.Record(key, dev)
    record.__enter__()
    t = time.perf_counter()
    pipe = Pipeline(LoadedVAE(model, fam, "benchmark", None, [], None), opts, log=lambda s: None)
    plan = pipe.plan(shape)
    phases["stages_plan_s"] = time.perf_counter() - t
    z = torch.randn(shape, generator=torch.Generator().manual_seed(0))

    def host():
        if dev.type != "cuda" or not hasattr(torch.cuda, "host_memory_stats"):
            return {}
        s = torch.cuda.host_memory_stats()
        return {"allocations": s.get("num_host_alloc", 0), "bytes": s.get("allocated_bytes.current", 0),
                "alloc_s": s.get("host_alloc_time.total", 0) / 1e6}

    h0 = host()
    _, st = pipe.decode(z, plan, to_host=False)
    phases["first_s"] = st.seconds
    h1 = host()
    stats = [pipe.decode(z, plan, to_host=False)[1] for _ in range(steady)]
    times, times_info = [x.seconds for x in stats], [x.tiling or {} for x in stats]
    phases["steady_s"] = statistics.median(times) if times else float("nan")
    record.__exit__(None, None, None)
    ti = st.tiling or {}
    r = {**phases, "overhead_s": phases["first_s"] - phases["steady_s"], "steady_all_s": times, "plan": plan.mode,
         "plan_tile": plan.tile, "budget_gb": budget, "device": torch.cuda.get_device_name() if dev.type == "cuda"
         else "cpu", "torch": torch.__version__,
         "tiling": {k: ti.get(k) for k in ("storage", "tile", "host_store_bytes", "pinned", "bytes_h2d",
                                           "bytes_d2h", "shrinks", "kernels", "shape", "pin_ahead")},
         "steady_tiling": {k: times_info[-1].get(k) for k in ("tile", "host_store_bytes", "pin_ahead")} if times_info
         else None,
         "pinned_first_decode": {k: h1[k] - h0.get(k, 0) for k in h1},
         "peak_gib": (st.peak_bytes or 0) / GIB}
    if check:  # bitwise against every buffer on the host, at the tile the decode used
        zz = z.to(dev, pipe.dtype)
        with torch.inference_mode():
            a, ia = tiling.tiled_decode(pipe.model, zz, tile=plan.tile, vram_budget=plan.budget_bytes,
                                        return_info=True)
            t = time.perf_counter()
            b = tiling.tiled_decode(pipe.model, zz, tile=ia["tile"], storage="cpu")
            if dev.type == "cuda":
                torch.cuda.synchronize()
        d = (a.float() - b.float()).abs().max().item()
        r["check"] = {"bitwise_equal": bool(torch.equal(a, b)), "max_abs_diff": d, "all_host_decode_s":
                      time.perf_counter() - t, "hybrid_storage": ia["storage"], "tile": list(ia["tile"])}
    return r


def run(args: list[str], env: dict | None = None) -> dict:
    p = subprocess.run([sys.executable, os.path.abspath(__file__), *args], capture_output=True, text=True,
                       env=dict(os.environ, **(env or {})))
    if p.returncode:
        return {"failed": (p.stderr or p.stdout)[-1500:], "args": args}
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--tiny", action="store_true", help="small shapes: a smoke test, on a CPU too")
    ap.add_argument("--steady", type=int, default=2)
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"of {', '.join(VARIANTS)}")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--no-check", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        r = pin_child(a.child, 0.25 if a.tiny else 4.0) if a.child != "decode" else decode_child(
            a.tiny, a.steady, check=not a.no_check)
        print(json.dumps(r))
        return
    tiny = ["--tiny"] if a.tiny else []
    variants = [v for v in a.variants.split(",") if v]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        sys.exit(f"unknown variant(s) {', '.join(bad)}: choose from {', '.join(VARIANTS)}")
    pins = [run(["--child", m, *tiny]) for m in ("default", "register1", "register8")]
    warm = run(["--child", "decode", "--steady", "0", "--no-check", *tiny])  # fills Triton's cache for the next
    decs = {}
    for i, v in enumerate(variants):  # (the bitwise check once: it does not depend on the variant's first call)
        decs[v] = run(["--child", "decode", "--steady", str(a.steady), *tiny, *([] if i == 0 else ["--no-check"])],
                      VARIANTS[v])
    dec = decs[variants[0]] if variants else {"failed": "no variant"}
    res = {"pinning": pins, "warmup_process": warm, "decode": dec, "variants": decs,
           "total_s": time.perf_counter() - T0}
    os.makedirs(a.out, exist_ok=True)
    tmp = os.path.join(a.out, "gpu_store_check.json.tmp")
    with open(tmp, "w") as f:
        json.dump(res, f, indent=1)
    os.replace(tmp, os.path.join(a.out, "gpu_store_check.json"))
    print(f"{'pinning':<12} {'GiB':>5} {'alloc s':>8} {'GB/s pin':>9} {'H2D GB/s':>9}")
    for p in pins:
        if "failed" in p:
            print(f"{p['args'][1]:<12} failed: {p['failed'][-200:]}")
            continue
        print(f"{p['mode']:<12} {p['gib']:5.2f} {p['alloc_s']:8.3f} {p['gib'] * GIB / p['alloc_s'] / 1e9:9.2f} "
              f"{p.get('h2d_gb_s', 0):9.1f}")
    if "failed" in dec:
        print("decode failed:", dec["failed"][-600:])
    else:
        ti, pf, ck = dec["tiling"], dec["pinned_first_decode"], dec.get("check", {})
        print(f"\nsdxl {'tiny' if a.tiny else '4096²'} within {dec['budget_gb']:g} GB ({dec['device']}, torch "
              f"{dec['torch']}): first {dec['first_s']:.3f} s, steady {dec['steady_s']:.3f} s, first-call overhead "
              f"{dec['overhead_s']:.3f} s; import {dec['import_s']:.1f} s, build {dec['build_s']:.1f} s")
        print(f"  storage {ti['storage']}, tile {ti['tile']} (planned {dec['plan_tile']}), host store "
              f"{(ti['host_store_bytes'] or 0) / GIB:.2f} GiB, pinned in the first decode: {pf.get('allocations')} "
              f"buffers, {(pf.get('bytes') or 0) / GIB:.2f} GiB, {pf.get('alloc_s', 0):.3f} s; peak "
              f"{dec['peak_gib']:.2f} GiB; H2D {(ti['bytes_h2d'] or 0) / GIB:.1f} GiB, D2H "
              f"{(ti['bytes_d2h'] or 0) / GIB:.1f} GiB per decode")
        print(f"  vs every buffer on the host at tile {ck.get('tile')}: bitwise equal {ck.get('bitwise_equal')} "
              f"(max |diff| {ck.get('max_abs_diff')}), that decode {ck.get('all_host_decode_s', 0):.2f} s")
    print(f"\n{'variant':<11} {'tile':>5} {'host GiB':>8} {'pinned 1st':>10} {'ahead s':>7} {'waited':>6} "
          f"{'first s':>8} {'steady s':>8} {'over s':>7} {'kernels':>7}  (ahead: the pinning thread's time; waited: "
          "the decode's wait; kernels: Triton kernels preloaded beside the build)")
    for v, d in decs.items():
        if "failed" in d:
            print(f"{v:<11} failed: {d['failed'][-300:]}")
            continue
        ti, pf, pa = d["tiling"], d["pinned_first_decode"], d["tiling"].get("pin_ahead") or {}
        print(f"{v:<11} {str(ti['tile'][0] if ti['tile'] else '-'):>5} {(ti['host_store_bytes'] or 0) / GIB:8.2f} "
              f"{pf.get('alloc_s', 0):9.3f}s {pa.get('seconds', 0):7.3f} {pa.get('waited', 0):6.3f} "
              f"{d['first_s']:8.3f} {d['steady_s']:8.3f} {d['overhead_s']:7.3f} "
              f"{(d.get('prewarm') or {}).get('kernels', 0):7d}")
    print(f"\n{time.perf_counter() - T0:.0f} s; {os.path.join(a.out, 'gpu_store_check.json')}")


if __name__ == "__main__":
    main()
