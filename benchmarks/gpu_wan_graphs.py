"""Per-chunk CUDA graphs for Wan's chunk decoder (vaeopt/video_graphs.py), and 481 frames streamed to MP4.

Workload wan21-480p: full-size Wan 2.1 VAE with random N(0, 0.02) weights (timing equals real weights) through
vaeopt's pipeline as `vaeopt decode` sets it up (bf16, channels_last_3d, fused norms / epilogues, Triton conv,
attention backend, planner), on CUDA.

A. latents (1, 16, 21, 60, 104) -> 81 frames 480x832, the pipeline's own video path (the planner's chunk, causal
   caches from one block, OOM fallback armed: Pipeline._video_kwargs), decode_video on the GPU:
   * graphs off vs per-chunk graphs on: median of --repeats timed decodes each (CUDA events, interleaved off/on,
     one warm-up decode each first), peak allocated / reserved per mode;
   * per-chunk GPU times (CUDA events around every decoder call: the first chunk, eager steady chunks, the warm-up
     on the capture stream, replays), capture and drain ms, graph pool bytes, reserved memory after capture vs the
     planner's budget;
   * exactness: replayed decode == eager decode (torch.equal), and eager == eager (determinism control).
B. 481 frames: latents (1, 16, 121, 60, 104) streamed to MP4 through the real CLI in a subprocess
   (`python -m vaeopt decode lat.pt --model wan21_random.safetensors -o out.mp4 --latent-space raw --json`): wall
   time, the CLI's decode+write seconds and frames/s, GPU peak (max allocated) against the planner's estimate and
   budget, the graphs stage line, host RSS peak of the process (wait4 ru_maxrss, plus VmRSS sampled every 20 ms),
   and the same for T=21 (81 frames) to show that host memory does not grow with the clip (holding the 481 frames
   would take 481*480*832*3 = 576 MB); also T=121 with --graphs off. The MP4 stays on the device: its size and its
   frame count read back with PyAV are reported.
Writes $OUT/wan_graphs.json; prints a table last.

    python benchmarks/gpu_wan_graphs.py [--repeats 5]
    python benchmarks/gpu_wan_graphs.py --smoke      # this script's logic on the CPU: tiny Wan 2.1, small latents
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from vaeopt import video, video_graphs  # noqa: E402
from vaeopt.families import build_model, get_family  # noqa: E402
from vaeopt.hw import machine_info  # noqa: E402

OUT = Path(os.environ.get("OUT", "out"))
OUT.mkdir(parents=True, exist_ok=True)
GIB = 2**30
T0 = time.perf_counter()
DEADLINE_S = 230.0  # part B's optional runs (T=121 with graphs off) are skipped after this
CUDA = torch.cuda.is_available()
SHAPE_A = (1, 16, 21, 60, 104)
SMALL_SHAPES = [(1, 16, 21, 30, 52), (1, 16, 21, 16, 16)]  # 240x416 (0.8 MP per 2-frame chunk), 128x128 (0.13 MP)
HW_B = (60, 104)


def elapsed() -> float:
    return time.perf_counter() - T0


def log(msg: str) -> None:
    print(f"[{elapsed():6.1f}s] {msg}", flush=True)


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def random_wan21(smoke: bool, seed: int = 0) -> torch.nn.Module:
    """The benchmarks' random model (_common.make_pipe): N(0, 0.02) everywhere; --smoke: base_dim 16."""
    spec = get_family("wan21")
    torch.manual_seed(seed)
    kw = {"base_dim": 16} if smoke else {}
    with torch.device("meta"):
        m = build_model(spec, **kw)
    m = m.to_empty(device="cpu")
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return m


def make_pipeline(smoke: bool):
    from vaeopt.loading import LoadedVAE
    from vaeopt.pipeline import Options, Pipeline

    spec = get_family("wan21")
    o = dict(device="cuda", dtype="bf16", graphs="off", tiling="auto") if not smoke else \
        dict(device="cpu", dtype="fp32", graphs="off", tiling="auto")
    return Pipeline(LoadedVAE(random_wan21(smoke), spec, "random", None, [], None), Options(**o))


# ---------------------------------------------------------------------------------------------------------------
# A. graphs off vs on


def compare(pipe, shape: tuple, repeats: int, R: dict) -> None:
    """graphs off vs on for one latent shape through the pipeline's own video path; fills R."""
    model, dev, dtype = pipe.model, pipe.device, pipe.dtype
    torch.manual_seed(1)
    z = torch.randn(shape, device=dev, dtype=dtype)
    plan = pipe.plan(shape)
    log(f"{shape} plan: {plan.reason}")
    R.update(latent_shape=list(shape), plan=plan.to_dict())

    def decode(mode: str, time_chunks: bool = False):
        pol = video_graphs.ChunkGraphs(mode, plan.budget_bytes, time_chunks=time_chunks)
        info: dict = {}
        kw = pipe._video_kwargs(plan, info)  # the pipeline's own video path (chunk, arena, OOM fallback, tiles)
        with torch.inference_mode():
            out = video.decode_video(model, z, graphs=pol, **kw)
        return out, pol.clips[-1] if pol.clips else {}, info

    # warm-up decodes (Triton compiles, cuDNN plans, allocator), then the exactness checks
    t = time.perf_counter()
    ref, _, info = decode("off")
    sync()
    R["first_eager_decode_s"] = round(time.perf_counter() - t, 3)
    t = time.perf_counter()
    out_on, rec_on, _ = decode("on")
    sync()
    R["first_graphed_decode_s"] = round(time.perf_counter() - t, 3)
    R["first_graphed_record"] = rec_on
    out_off2, _, _ = decode("off")
    R["replayed_equals_eager"] = bool(torch.equal(out_on, ref))
    R["eager_equals_eager"] = bool(torch.equal(out_off2, ref))
    R["max_abs_replayed_vs_eager"] = float((out_on.float() - ref.float()).abs().max())
    log(f"replayed == eager: {R['replayed_equals_eager']} (max |diff| {R['max_abs_replayed_vs_eager']}), "
        f"eager == eager: {R['eager_equals_eager']}")
    del out_on, out_off2, ref

    # timed, interleaved; peaks per mode (reset before each decode)
    times: dict[str, list[float]] = {"off": [], "on": []}
    peaks: dict[str, list[int]] = {"off": [0, 0], "on": [0, 0]}
    recs = []
    rsv_end: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(repeats):
        for mode in ("off", "on"):
            sync()
            if CUDA:
                torch.cuda.reset_peak_memory_stats()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
            t = time.perf_counter()
            out, rec, _ = decode(mode)
            if CUDA:
                b.record()
                b.synchronize()
                times[mode].append(a.elapsed_time(b))
                peaks[mode] = [max(peaks[mode][0], torch.cuda.max_memory_allocated()),
                               max(peaks[mode][1], torch.cuda.max_memory_reserved())]
            else:
                times[mode].append((time.perf_counter() - t) * 1e3)
            if mode == "on":
                recs.append(rec)
            del out
            if CUDA:  # what stays reserved between clips (a growth would be a leak)
                rsv_end[mode].append(round(torch.cuda.memory_reserved() / GIB, 3))
    R["reserved_after_decode_gib"] = rsv_end
    R["ms"] = {m: [round(v, 2) for v in ts] for m, ts in times.items()}
    R["median_ms"] = {m: round(statistics.median(ts), 2) for m, ts in times.items()}
    R["peak_alloc_gib"] = {m: round(p[0] / GIB, 3) for m, p in peaks.items()}
    R["peak_reserved_gib"] = {m: round(p[1] / GIB, 3) for m, p in peaks.items()}
    R["graph_records"] = recs
    R["capture_ms"] = [r.get("capture_ms") for r in recs]
    R["drain_ms"] = [r.get("drain_ms") for r in recs]
    R["warmup_drain_ms"] = [r.get("warmup_drain_ms") for r in recs]
    R["pool_gib"] = [round((r.get("pool_bytes") or 0) / GIB, 3) for r in recs]
    R["pool_estimate_gib"] = round((recs[-1].get("pool_estimate_bytes") or 0) / GIB, 3) if recs else None
    R["reserved_after_capture_gib"] = [round((r.get("reserved_after_capture") or 0) / GIB, 3) for r in recs]
    R["budget_gib"] = round(plan.budget_bytes / GIB, 2) if plan.budget_bytes else None
    log(f"median ms off {R['median_ms']['off']} on {R['median_ms']['on']}; capture ms {R['capture_ms']}, "
        f"pool GiB {R['pool_gib']} (est. {R['pool_estimate_gib']}), peak reserved {R['peak_reserved_gib']}")

    # per-chunk GPU times
    chunk = {}
    for mode in ("off", "on"):
        _, rec, _ = decode(mode, time_chunks=True)
        chunk[mode] = rec.get("chunk_ms", {})
    R["chunk_ms"] = chunk
    steady_off = chunk["off"].get("eager", [])
    rep = chunk["on"].get("replay", [])
    R["steady_chunk_median_ms"] = {"eager": round(statistics.median(steady_off), 3) if steady_off else None,
                                   "replay": round(statistics.median(rep), 3) if rep else None}
    R["first_replay_ms"] = rep[0] if rep else None
    log(f"per chunk: {R['steady_chunk_median_ms']}, first replay {R['first_replay_ms']} ms; reserved after each "
        f"decode {R.get('reserved_after_decode_gib')}")
    # what auto would do for this shape
    R["auto_decision"] = video_graphs.ChunkGraphs("auto").decide(
        dev, video.chunk_schedule(shape[2], plan.chunk or 1), 1,
        video_graphs._chunk_pixels(model, z, video.chunk_schedule(shape[2], plan.chunk or 1)))
    del z


def part_a(args, results: dict) -> None:
    pipe = make_pipeline(args.smoke)
    for s in pipe.stages:
        log(s.line())
    results["stages"] = [s.line() for s in pipe.stages]
    A = results["A"] = {}
    compare(pipe, SHAPE_A if not args.smoke else (1, 16, 9, 4, 6), args.repeats, A)
    # smaller frames: where launch overhead is a larger share (auto's size bound)
    results["A_small"] = []
    for shape in SMALL_SHAPES if not args.smoke else [(1, 16, 9, 2, 2)]:
        if elapsed() > DEADLINE_S / 2:
            results["A_small"].append({"latent_shape": list(shape), "skipped": "deadline"})
            continue
        R: dict = {}
        try:
            compare(pipe, shape, args.repeats, R)
        except Exception as e:  # noqa: BLE001
            R["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        results["A_small"].append(R)
    del pipe
    if CUDA:
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------------------
# B. 481 frames streamed to MP4 through the CLI


def _rss_sampler(pid: int, samples: list, stop: threading.Event) -> None:
    path = f"/proc/{pid}/status"
    while not stop.is_set():
        try:
            with open(path) as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        samples.append((round(elapsed(), 2), int(line.split()[1]) * 1024))
                        break
        except OSError:
            return
        time.sleep(0.02)


def cli_run(name: str, lat: Path, model: Path, mp4: Path, extra: list[str], frames_expected: int,
            smoke: bool) -> dict:
    cmd = [sys.executable, "-m", "vaeopt", "decode", str(lat), "--model", str(model), "-o", str(mp4),
           "--latent-space", "raw", "--json", "--overwrite", *extra]
    if smoke:
        cmd += ["--device", "cpu"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    t = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=str(ROOT))
    samples: list = []
    stop = threading.Event()
    th = threading.Thread(target=_rss_sampler, args=(p.pid, samples, stop), daemon=True)
    th.start()
    stdout, stderr = p.communicate(timeout=300)
    wall = time.perf_counter() - t
    stop.set()
    th.join()
    rec: dict = {"run": name, "cmd": " ".join(cmd[1:]), "rc": p.returncode, "wall_s": round(wall, 2)}
    # the child's ru_maxrss (KiB) is folded into RUSAGE_CHILDREN only as a max over all children: use the samples'
    # max and, as a cross-check, /proc's VmHWM is gone once the child exits -> sampled max is the figure
    rec["rss_peak_mb_sampled"] = round(max((s[1] for s in samples), default=0) / 1e6, 1)
    rec["rss_samples"] = len(samples)
    rec["stderr_tail"] = stderr[-3000:]
    if p.returncode != 0:
        rec["error"] = stderr[-1500:]
        return rec
    try:
        j = json.loads(stdout)
    except ValueError:
        rec["error"] = "no JSON on stdout: " + stdout[-500:]
        return rec
    o = j["outputs"][0]
    rec.update(decode_write_s=round(o["seconds"], 3), peak_gib=round((o["peak_bytes"] or 0) / GIB, 3),
               plan_reason=o["plan"]["reason"], plan_chunk=o["plan"]["chunk"], plan_mode=o["plan"]["mode"],
               est_gib=round(o["plan"]["est_bytes"] / GIB, 3),
               budget_gib=round(o["plan"]["budget_bytes"] / GIB, 2) if o["plan"]["budget_bytes"] else None,
               retries=o["retries"], stages=[f"{s['name']}: {s['status']} - {s['detail']}" for s in j["stages"]])
    rec["frames_per_s"] = round(frames_expected / o["seconds"], 1)
    rec["mp4_bytes"] = mp4.stat().st_size
    try:
        import av

        with av.open(str(mp4)) as c:
            s = c.streams.video[0]
            rec["mp4_stream_frames"] = s.frames
            rec["mp4_size"] = [s.codec_context.width, s.codec_context.height]
            rec["mp4_decoded_frames"] = sum(1 for _ in c.decode(video=0))
    except Exception as e:  # noqa: BLE001
        rec["mp4_read_error"] = f"{type(e).__name__}: {e}"
    mp4.unlink(missing_ok=True)
    return rec


def part_b(args, results: dict) -> None:
    from safetensors.torch import save_file

    tmp = Path(tempfile.mkdtemp(prefix="wan_graphs_"))
    B = results["B"] = {"runs": []}
    try:
        m = random_wan21(args.smoke)
        cfg = {k: v for k, v in dict(m.config).items() if not k.startswith("_")}
        model = tmp / "wan21_random.safetensors"
        save_file({k: v.to(torch.bfloat16).contiguous() for k, v in m.state_dict().items()}, str(model),
                  metadata={"config": json.dumps(cfg)})
        B["model_mb"] = round(model.stat().st_size / 1e6, 1)
        del m
        hw = HW_B if not args.smoke else (4, 6)
        runs = [("T121 graphs on", 121 if not args.smoke else 9, ["--graphs", "on"]),
                ("T21 graphs on", 21 if not args.smoke else 5, ["--graphs", "on"]),
                ("T121 graphs auto", 121 if not args.smoke else 9, [])]
        for name, T, extra in runs:
            if elapsed() > DEADLINE_S and B["runs"]:
                B["runs"].append({"run": name, "skipped": f"deadline ({elapsed():.0f} s)"})
                continue
            torch.manual_seed(3)
            lat = tmp / f"lat_T{T}.pt"
            torch.save(torch.randn(1, 16, T, *hw), lat)
            frames = 1 + 4 * (T - 1)
            log(f"CLI {name}: {frames} frames")
            rec = cli_run(name, lat, model, tmp / "out.mp4", extra, frames, args.smoke)
            rec["latent_T"], rec["frames"] = T, frames
            rec["full_video_mb"] = round(frames * hw[0] * 8 * hw[1] * 8 * 3 / 1e6, 1)
            B["runs"].append(rec)
            log(json.dumps({k: v for k, v in rec.items() if k not in ("stderr_tail", "stages")}))
            for s in rec.get("stages", []):
                if s.startswith("graphs"):
                    log(s)
        r121 = next((r for r in B["runs"] if r["run"] == "T121 graphs on" and "rss_peak_mb_sampled" in r), None)
        r21 = next((r for r in B["runs"] if r["run"] == "T21 graphs on" and "rss_peak_mb_sampled" in r), None)
        if r121 and r21:
            B["rss_growth_mb_T121_vs_T21"] = round(r121["rss_peak_mb_sampled"] - r21["rss_peak_mb_sampled"], 1)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _med(xs) -> float:
    xs = [x for x in xs or [] if x is not None]
    return statistics.median(xs) if xs else 0.0


def main() -> None:
    global DEADLINE_S
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, small latents: checks this script's logic")
    ap.add_argument("--skip-a", action="store_true")
    ap.add_argument("--skip-b", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        DEADLINE_S, args.repeats = 1e9, min(args.repeats, 2)
    elif not CUDA:
        sys.exit("needs a CUDA GPU (or --smoke)")
    torch.backends.cudnn.benchmark = False
    results: dict = {"workload": "wan21-480p" if not args.smoke else "smoke", "dtype": "bfloat16"}
    mi = machine_info()
    results.update(gpu=mi.gpus[0].name if mi.gpus else "cpu",
                   versions={"torch": mi.torch, "cuda": mi.cuda, "cudnn": mi.cudnn, "triton": mi.triton,
                             "diffusers": mi.diffusers, "pyav": mi.pyav},
                   date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   command="python benchmarks/gpu_wan_graphs.py " + " ".join(sys.argv[1:]))
    out_json = OUT / "wan_graphs.json"
    for name, fn, skip in (("A", part_a, args.skip_a), ("B", part_b, args.skip_b)):
        if skip:
            continue
        try:
            fn(args, results)
        except Exception as e:  # noqa: BLE001 - keep what the other part measured
            results[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:400]}"
            results[f"{name}_trace"] = traceback.format_exc()[-2500:]
            log(results[f"{name}_error"])
        results["wall_s"] = round(elapsed(), 1)
        out_json.write_text(json.dumps(results, indent=1, default=str))

    print(f"\n{results['gpu']}  torch {results['versions']['torch']}  cuDNN {results['versions']['cudnn']}  "
          f"Triton {results['versions']['triton']}")
    rows = ([results["A"]] if results.get("A") else []) + list(results.get("A_small", []))
    if rows:
        print("A. graphs off vs per-chunk graphs on (pipeline video path, bf16; ms = median decode, CUDA events)")
        print(f"  {'latent':20} {'off ms':>8} {'on ms':>8} {'chunk eager':>11} {'replay':>7} {'capture':>7} "
              f"{'pool GiB':>8} {'rsvd off/on GiB':>15} {'bitwise':>7}")
        for R in rows:
            if "median_ms" not in R:
                print(f"  {str(tuple(R.get('latent_shape', ())))[:20]:20} {R.get('error') or R.get('skipped')}")
                continue
            c = R["steady_chunk_median_ms"]
            print(f"  {str(tuple(R['latent_shape'])):20} {R['median_ms']['off']:8.1f} {R['median_ms']['on']:8.1f} "
                  f"{c['eager'] or 0:11.3f} {c['replay'] or 0:7.3f} {_med(R['capture_ms']):7.1f} "
                  f"{_med(R['pool_gib']):8.2f} "
                  f"{R['peak_reserved_gib']['off']:7.2f}/{R['peak_reserved_gib']['on']:<7.2f} "
                  f"{str(R['replayed_equals_eager']):>7}")
        A = results["A"]
        print(f"  480p plan: {A['plan']['reason'][:100]}; budget {A['budget_gib']} GiB; auto: {A.get('auto_decision')}")
    B = results.get("B")
    if B:
        print(f"B. CLI decode -> MP4 (480x832), model {B.get('model_mb')} MB")
        print(f"  {'run':18} {'frames':>6} {'wall s':>7} {'dec+wr s':>8} {'fps':>6} {'GPU peak':>8} {'est':>6} "
              f"{'budget':>7} {'RSS MB':>7} {'mp4 MB':>7} {'read':>5}")
        for r in B["runs"]:
            if "error" in r or "skipped" in r:
                print(f"  {r['run']:18} {str(r.get('error') or r.get('skipped'))[:100]}")
                continue
            print(f"  {r['run']:18} {r['frames']:6d} {r['wall_s']:7.1f} {r['decode_write_s']:8.2f} "
                  f"{r['frames_per_s']:6.1f} {r['peak_gib']:7.2f}G {r['est_gib']:5.1f}G {r['budget_gib']!s:>6}G "
                  f"{r['rss_peak_mb_sampled']:7.0f} {r['mp4_bytes'] / 1e6:7.1f} "
                  f"{r.get('mp4_decoded_frames', '?')!s:>5}")
        if "rss_growth_mb_T121_vs_T21" in B:
            print(f"  host RSS peak T=121 - T=21: {B['rss_growth_mb_T121_vs_T21']} MB (the whole 481-frame video "
                  "would be 576 MB)")
    print(f"wrote {out_json}")


if __name__ == "__main__":
    main()
