"""Where the first decode of a process goes: each timed call is a fresh Python process that imports vaeopt, builds the
workload's model (random init at real size) while vaeopt.prewarm warms the GPU on its thread (as `vaeopt decode`
overlaps it with reading the checkpoint), prepares the stages, plans, decodes once under torch.profiler and then a few
times more; the row's time is the first decode's overhead over the steady decode (first - median of the rest).

    python benchmarks/first_call.py --workloads sdxl-1024,sdxl-4096,wan21-480p --out DIR [--variants warm,cold]
    python benchmarks/first_call.py --workloads sdxl-1024,wan21-480p --variants warm --steady 2 --out DIR
    python benchmarks/first_call.py --tiny --device cpu --out /tmp/fc        # the smoke test

Per process (info.calls): the phases in seconds (import, build, stages with each stage's own time, plan, decide
graphs/cuDNN autotune, first decode, steady median; prewarm: the warm-up thread's time and what the join still
waited), Triton kernels compiled vs loaded from the cache (count and time, from Triton's compilation listener), Triton
autotune benchmarks (count, time), cuDNN's benchmark state, pinned host memory allocated during the first decode
(torch's host allocator stats), graph capture time, and the profiler's largest CPU-time items of the first decode
against the same items in a steady decode (per op and input shape: a conv shape cuDNN has not seen yet shows up).

--trace DIR: the first decode and one steady decode of each process are profiled with CUDA activity too (kernels and
CUDA runtime calls); each timed process (not a variant's warm-up process, whose trace would show compiling) writes
the first decode's Chrome trace (DIR/<workload>_<variant>_<n>_first.json.gz,
chrome://tracing or ui.perfetto.dev), and the summary prints, per process, the first decode against the steady one:
the items by CPU time (ops, CUDA runtime calls such as cudaMalloc, cudaHostRegister, cudaFuncGetAttributes or module
loads), the kernels that ran only in the first decode, and the GPU's busy time in each (a first decode whose kernels
take the steady time spends the rest waiting on the host). Its overhead is also given against the steady decode under
the same profiler ("over/prof"), which carries the profiler's own cost.

    python benchmarks/first_call.py --workloads sdxl-4096,wan21-480p --variants warm,eager --trace DIR/tr --out DIR

Variants: warm (the Triton and vaeopt caches filled by the warm-up process), cold (both empty for every process),
autotune (--cudnn-autotune on), graphs (--graphs on: warm-up + capture in the first decode, replays after), eager
(CUDA_MODULE_LOADING=EAGER: every CUDA kernel loaded at start instead of on first use), nocache (VAEOPT_CACHE=off:
vaeopt's own cache unused, Triton's kept warm), noprewarm (VAEOPT_PREWARM=off: nothing warmed beside the build),
nopinahead (VAEOPT_PIN_AHEAD=off: a tiled decode's host buffers pinned as it allocates them, not on a thread ahead),
halves (VAEOPT_PLACEMENT=halves as well: the earlier tile choice of a decode with buffers on the host).
sdxl-4096 runs within a 16 GB budget (the tiled plan). The variants of a workload (all but cold) share one cache folder:
only the first one's warm-up process compiles, so several variants fit one run.
"""

import time

T0 = time.perf_counter()  # imports are timed from here (the child's torch, diffusers and vaeopt)

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

import harness as H  # noqa: E402

VARIANTS = ("warm", "cold", "autotune", "graphs", "eager", "nocache", "noprewarm", "nopinahead", "halves")
ENV = {"eager": {"CUDA_MODULE_LOADING": "EAGER"}, "nocache": {"VAEOPT_CACHE": "off"},
       "noprewarm": {"VAEOPT_PREWARM": "off"}, "nopinahead": {"VAEOPT_PIN_AHEAD": "off"},
       "halves": {"VAEOPT_PLACEMENT": "halves", "VAEOPT_PIN_AHEAD": "off"}}
# (the first process of a variant is the warm-up: for "warm" it fills the caches the timed one reads)
DEFAULTS = {"repeats": 1, "warmup": 1}
BUDGET_GB = {"sdxl-4096": 16.0}  # the tiled plan of a 16 GB card; the others decode whole
STEADY = 3  # decodes after the first, in each process (--steady)
WARM_DIRS: dict = {}  # (workload, tiny) -> the cache folder its variants share


def add_args(ap):
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--vram-budget", type=float, default=None, help="GB (default: 16 for sdxl-4096, else none)")
    ap.add_argument("--top", type=int, default=12, help="profiler items kept per process")
    ap.add_argument("--steady", type=int, default=STEADY, help="timed decodes after the first, per process")
    ap.add_argument("--trace", default=None, metavar="DIR",
                    help="profile with CUDA activity and write each process's first-decode trace under DIR")
    ap.add_argument("--trace-file", type=int, default=1, help=argparse.SUPPRESS)  # 0: the summary only


items = H.decode_items()


def setup(variant, shape, ctx):
    a = ctx.args
    cmd = [sys.executable, __file__, "--child", variant, "--workload", a.workload, "--top", str(a.top),
           "--steady", str(a.steady),
           *(["--tiny"] if a.tiny else []), *(["--device", a.device] if a.device else []), "--dtype", ctx.dtype_name,
           *(["--vram-budget", str(a.vram_budget)] if a.vram_budget else [])]
    # one cache folder per workload for every variant but cold: only the first variant's warm-up process compiles
    if (a.workload, a.tiny) not in WARM_DIRS:
        WARM_DIRS[a.workload, a.tiny] = tempfile.mkdtemp(prefix="first-call-")
    warm = WARM_DIRS[a.workload, a.tiny]
    calls = []

    def fn():
        trace = []
        if a.trace:  # (a file per timed process: the warm-up process's first decode is the compiling one)
            os.makedirs(a.trace, exist_ok=True)
            trace = ["--trace", os.path.join(a.trace, f"{a.workload}_{variant}_{len(calls)}_first.json"),
                     "--trace-file", str(int(variant == "cold" or len(calls) > 0))]
        root = tempfile.mkdtemp(prefix="first-call-") if variant == "cold" else warm
        secs, p = H.timed_run(cmd + trace, H.cache_env(root, **ENV.get(variant, {})))
        if variant == "cold":
            shutil.rmtree(root, ignore_errors=True)
        if p.returncode:
            # a row that says why, and the other variants and workloads still run
            raise H.Skip(f"the child process failed: {(p.stderr or p.stdout)[-800:]}")
        r = json.loads(p.stdout.strip().splitlines()[-1])
        calls.append({**r, "process_s": secs})
        return H.Timed(None, r["overhead_s"] * 1e3)

    return H.Case(fn, info={"calls": calls, "what": "first decode minus the steady median (ms)"})


class Triton:
    """Triton's compilation and autotuning listeners: kernels compiled vs loaded from its cache, autotune runs."""

    def __init__(self):
        self.c = {"compiled": 0, "compile_s": 0.0, "cache_hits": 0, "cache_load_s": 0.0, "autotuned": 0,
                  "autotune_s": 0.0, "autotune_cache_hits": 0, "binaries_loaded": 0, "binary_load_s": 0.0,
                  "names_compiled": []}
        self._t = 0.0
        try:
            from triton import knobs

            knobs.compilation.listener  # noqa: B018 (Triton 3.4+)
        except (ImportError, AttributeError):
            self.c["available"] = False
            return
        knobs.compilation.listener = self.on_compile
        knobs.autotuning.listener = self.on_autotune
        try:  # the cubin into the CUDA context (hook chains since Triton 3.5; absent before: not counted)
            knobs.runtime.kernel_load_start_hook.add(self.on_load_start)
            knobs.runtime.kernel_load_end_hook.add(self.on_load_end)
        except AttributeError:
            self.c["binaries_loaded"] = None
        self.c["autotune_disk_cache"] = bool(knobs.autotuning.cache)

    def on_compile(self, *, src, metadata, metadata_group, times, cache_hit):
        total = times.total / 1e6  # (Triton reports microseconds)
        if cache_hit:
            self.c["cache_hits"] += 1
            self.c["cache_load_s"] += total
        else:
            self.c["compiled"] += 1
            self.c["compile_s"] += total
            self.c["names_compiled"].append(str(metadata.get("name", "?"))[:60])

    def on_load_start(self, *a):
        self._t = time.perf_counter()

    def on_load_end(self, *a):
        self.c["binaries_loaded"] = (self.c["binaries_loaded"] or 0) + 1
        self.c["binary_load_s"] += time.perf_counter() - self._t

    def on_autotune(self, *, fn, key, best_config, configs_timings, duration, cache_hit):
        self.c["autotuned"] += 1
        self.c["autotune_cache_hits"] += bool(cache_hit)
        self.c["autotune_s"] += duration or 0.0

    def snapshot(self) -> dict:
        return {k: (list(v) if isinstance(v, list) else v) for k, v in self.c.items()}


def _host_alloc(torch, dev) -> dict:
    """Pinned host memory allocated so far (count, bytes, ms), from torch's host allocator, where it reports them."""
    if dev.type != "cuda" or not hasattr(torch.cuda, "host_memory_stats"):
        return {}
    s = torch.cuda.host_memory_stats()
    return {"allocations": s.get("num_host_alloc", 0), "bytes": s.get("allocated_bytes.current", 0),
            "alloc_ms": s.get("host_alloc_time.total", 0) / 1e3}


def _profiled(torch, fn, cuda: bool = False, trace: str | None = None):
    """Run fn under torch.profiler: CPU ops (and with `cuda`, kernels and CUDA runtime calls; trace: the Chrome trace
    written there, gzipped). -> (fn's result, {"shapes": self CPU ms per op and input shapes, "names": (self CPU ms,
    count) per item, "kernels": (GPU ms, count) per kernel})."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts, record_shapes=True) as prof:
        out = fn()
        if cuda:
            torch.cuda.synchronize()
    rows = {}
    for e in prof.key_averages(group_by_input_shape=True):
        rows[f"{e.key} {e.input_shapes}"[:140]] = e.self_cpu_time_total / 1e3  # ms
    names, kernels = {}, {}
    for e in prof.key_averages():
        if "cuda" in str(getattr(e, "device_type", "")).lower():  # a kernel, a memcpy or a memset on the GPU
            kernels[e.key[:160]] = (getattr(e, "self_device_time_total", 0) / 1e3, e.count)
        else:
            names[e.key[:160]] = (e.self_cpu_time_total / 1e3, e.count)
    if trace:
        import gzip

        prof.export_chrome_trace(trace)
        with open(trace, "rb") as f, gzip.open(trace + ".gz", "wb") as g:
            shutil.copyfileobj(f, g)
        os.remove(trace)
    return out, {"shapes": rows, "names": names, "kernels": kernels}


# What a profiler item's self CPU time is spent on, by name (the first match; CUDA runtime calls are children of the
# op that makes them, so an op's self time is its host-side work: cuDNN's heuristics and plans, cuBLAS's choices)
KINDS = (("cudnn", ("cudnn",)), ("cublas", ("aten::bmm", "aten::mm", "aten::addmm", "aten::baddbmm", "cublas")),
         ("kernel loading", ("cudaFuncGetAttributes", "cuModuleLoad", "cuModuleGetFunction", "cuLibrary",
                             "cudaGetFuncBySymbol", "cuFuncGetAttribute", "cuKernelGet")),
         ("allocator", ("cudaMalloc", "cudaFree", "cuMemCreate", "cuMemMap", "cuMemAddressReserve")),
         ("host pinning", ("cudaHostRegister", "cudaHostAlloc", "cudaMallocHost", "cudaHostUnregister")),
         ("waits", ("Synchronize", "cudaEventQuery", "cudaStreamWaitEvent")),
         ("launches", ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cudaMemcpy", "cudaMemset")))


def _kind(item: str) -> str:
    return next((k for k, names in KINDS if any(n in item for n in names)), "other")


def _first_only(first: dict, steady: dict, top: int) -> dict:
    """What the first decode's profile has beyond the steady one's: items by CPU time (first - steady), the kernels
    that ran only in the first decode, and the GPU busy time of each."""
    names = sorted(((k, v[0], v[1], steady["names"].get(k, (0.0, 0))) for k, v in first["names"].items()),
                   key=lambda r: -(r[1] - r[3][0]))
    only = sorted(((k, v) for k, v in first["kernels"].items() if k not in steady["kernels"]), key=lambda r: -r[1][0])
    more = sorted(((k, v[1] - steady["kernels"][k][1]) for k, v in first["kernels"].items()
                   if k in steady["kernels"] and v[1] > steady["kernels"][k][1]), key=lambda r: -r[1])
    kinds: dict[str, float] = {}
    for k, a, _, b in names:
        kinds[_kind(k)] = kinds.get(_kind(k), 0.0) + a - b[0]
    return {
        "by_kind_ms": {k: round(v, 3) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
        "cpu_items": [{"item": k, "first_ms": round(a, 3), "first_n": n, "steady_ms": round(b[0], 3),
                       "steady_n": b[1]} for k, a, n, b in names[:top]],
        "first_only_kernels": [{"kernel": k, "ms": round(v[0], 3), "n": v[1]} for k, v in only[:top]],
        "first_only_kernel_count": len(only),
        "first_only_kernel_ms": round(sum(v[0] for _, v in only), 3),
        "kernels_launched_more": [{"kernel": k, "extra": n} for k, n in more[:top]],
        "gpu_busy_ms": {"first": round(sum(v[0] for v in first["kernels"].values()), 3),
                        "steady": round(sum(v[0] for v in steady["kernels"].values()), 3)},
    }


def child(args) -> None:
    import torch

    from vaeopt import prewarm
    from vaeopt.loading import LoadedVAE
    from vaeopt.pipeline import Options, Pipeline

    phases = {"import_s": time.perf_counter() - T0}
    tri = Triton()
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    ctx = H.Ctx(args.workload, *H.workload_shape(args), dev, H.DTYPES[args.dtype], args)
    budget = args.vram_budget or (None if args.tiny else BUDGET_GB.get(args.workload))
    opts = Options(device=str(dev), dtype=ctx.dtype_name, vram_budget_gb=budget, decode_shape=tuple(ctx.shape),
                   graphs="on" if args.child == "graphs" else "auto",
                   cudnn_autotune="on" if args.child == "autotune" else "auto")
    key = prewarm.key(f"benchmark:{args.workload}{':tiny' if args.tiny else ''}", opts)
    t = time.perf_counter()
    pw = prewarm.start(dev, ctx.dtype, key, video=len(ctx.shape) == 5)  # (None on the CPU)
    model = ctx.model(torch.float32)
    phases["build_s"] = time.perf_counter() - t
    if pw is not None:
        pw.join(lambda s: print(s, file=sys.stderr))
    phases["prewarm"] = pw.summary() if pw else None
    record = prewarm.Record(key, dev)
    record.__enter__()  # (the kernels this process loads: the next process of the variant preloads them)
    lines = []  # each stage's line comes when it is done: the gaps are the stages' times
    t = time.perf_counter()
    last = [t]

    def log(s):
        now = time.perf_counter()
        lines.append({"s": round(now - last[0], 4), "line": s[:160]})
        last[0] = now

    pipe = Pipeline(LoadedVAE(model, ctx.family, "benchmark", None, [], None), opts, log=log)
    phases["stages_s"] = time.perf_counter() - t
    t = time.perf_counter()
    plan = pipe.plan(ctx.shape)
    phases["plan_s"] = time.perf_counter() - t
    t = time.perf_counter()
    pipe.setup_graphs(plan, ctx.shape, 1 + args.steady)  # as vaeopt.decode / run_jobs decide them before a first decode
    pipe.autotune(1, plan)
    phases["decide_s"] = time.perf_counter() - t
    triton_before = tri.snapshot()
    z = ctx.latent()
    host0 = _host_alloc(torch, dev)
    t = time.perf_counter()
    cuda = bool(args.trace) and dev.type == "cuda"
    (_, st), first_prof = _profiled(torch, lambda: pipe.decode(z, plan), cuda,
                                    args.trace if args.trace_file else None)
    phases["first_decode_wall_s"] = time.perf_counter() - t
    phases["first_decode_s"] = st.seconds
    host1 = _host_alloc(torch, dev)
    steady = [pipe.decode(z, plan)[1].seconds for _ in range(max(1, args.steady))]
    (_, st_prof), steady_prof = _profiled(torch, lambda: pipe.decode(z, plan), cuda)
    record.__exit__(None, None, None)
    phases["steady_s"] = statistics.median(steady)
    def since(v, b):  # what the first decode added to a counter, a time or a list of names
        if v is None or isinstance(v, bool):
            return v
        return v - (b or 0) if isinstance(v, (int, float)) else v[len(b or []):]

    tri_first = {k: since(v, triton_before.get(k)) for k, v in tri.snapshot().items()}
    diff = sorted(((k, v, steady_prof["shapes"].get(k, 0.0)) for k, v in first_prof["shapes"].items()),
                  key=lambda r: -(r[1] - r[2]))
    g = pipe.graphed
    print(json.dumps({
        **phases, "overhead_s": st.seconds - phases["steady_s"], "steady_all_s": steady,
        "plan": plan.mode, "plan_reason": plan.reason[:200], "first_over_steady": st.seconds / phases["steady_s"],
        "kernels_recorded": record.added,
        "stage_lines": lines, "triton_before_first_decode": triton_before, "triton_first_decode": tri_first,
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        "host_pinned_first_decode": {k: host1[k] - host0.get(k, 0) for k in host1},
        "graph_capture_s": g.capture_s if g is not None else None,
        "profile_first_vs_steady_ms": [{"item": k, "first_ms": round(a, 3), "steady_ms": round(b, 3)}
                                       for k, a, b in diff[:args.top]],
        "steady_profiled_s": st_prof.seconds, "overhead_profiled_s": st.seconds - st_prof.seconds,
        "tiling_first": _tiling_summary(st.tiling), "tiling_steady": _tiling_summary(st_prof.tiling),
        "trace": {**_first_only(first_prof, steady_prof, args.top),
                  "file": args.trace + ".gz" if args.trace_file else None} if args.trace else None,
    }))


def _tiling_summary(t: dict | None) -> dict | None:
    """The tiled decode's choices that bear on its first call: tile, host store, the pinning thread."""
    if not t:
        return None
    return {k: t.get(k) for k in ("tile", "storage", "host_store_bytes", "pin_ahead")}


def table(results: list[dict]) -> str:
    """One line per process: its phases (variant/1st: the warm-up process, which filled the caches)."""
    out = [f"{'workload':<12} {'variant':<15} {'import':>7} {'build':>7} {'stages':>7} {'plan':>7} {'first':>8} "
           f"{'steady':>8} {'over':>8} {'x1st':>5} {'pw/wait':>9} {'trit c/h':>9} {'process':>8}  (s; x1st: first / "
           "steady; pw: the warm-up thread's time, and the join's wait; trit: kernels compiled/cache hits)"]
    for res in results:
        for r in res["rows"]:
            if r["status"] != "ok" or not r["info"]["calls"]:
                out.append(f"{res['workload']:<12} {r['variant']:<15} {r['status']}: {r.get('reason', '')[:80]}")
                continue
            for i, c in enumerate(r["info"]["calls"]):
                tf, tb = c["triton_first_decode"], c["triton_before_first_decode"]
                name = r["variant"] + ("/1st" if i == 0 and r["variant"] != "cold" else "")  # (it filled the caches)
                pw = c["prewarm"] or {"seconds": 0.0, "waited": 0.0}  # (None: no GPU, or VAEOPT_PREWARM=off)
                out.append(f"{res['workload']:<12} {name:<15} {c['import_s']:7.2f} {c['build_s']:7.2f} "
                           f"{c['stages_s']:7.2f} {c['plan_s']:7.2f} {c['first_decode_s']:8.3f} {c['steady_s']:8.3f} "
                           f"{c['overhead_s']:8.3f} {c['first_over_steady']:5.2f} "
                           f"{pw['seconds']:4.2f}/{pw['waited']:4.2f} "
                           f"{tb['compiled'] + tf['compiled']:>4}/"
                           f"{tb['cache_hits'] + tf['cache_hits']:<4} {c['process_s']:8.1f}")
    return "\n".join(out)


def trace_table(results: list[dict], top: int = 12) -> str:
    """Per profiled process: where its first decode's time went beyond the steady decode's."""
    out = []
    for res in results:
        for r in res["rows"]:
            for i, c in enumerate(r["info"]["calls"] if r["status"] == "ok" else []):
                tr = c.get("trace")
                if not tr:
                    continue
                busy = tr["gpu_busy_ms"]
                tf = c.get("tiling_first") or {}
                out.append(f"\n{res['workload']} {r['variant']} process {i + 1}: "
                           f"first {c['first_decode_s'] * 1e3:.1f} ms, steady {c['steady_s'] * 1e3:.1f} ms "
                           f"(profiled {c['steady_profiled_s'] * 1e3:.1f} ms, "
                           f"over/prof {c['overhead_profiled_s'] * 1e3:.1f} ms); GPU busy {busy['first']:.1f} ms "
                           f"first vs {busy['steady']:.1f} ms steady; {tr['first_only_kernel_count']} kernels only in "
                           f"the first ({tr['first_only_kernel_ms']:.1f} ms)"
                           + (f"; tile {tf.get('tile')}, host {(tf.get('host_store_bytes') or 0) / 2**30:.1f} GiB, "
                              f"pin-ahead {tf.get('pin_ahead')}" if tf else "")
                           + (f"; trace {tr['file']}" if tr["file"] else ""))
                out.append("  self CPU time, first - steady (ms): " + ", ".join(
                    f"{k} {v:+.1f}" for k, v in tr.get("by_kind_ms", {}).items()))
                out.append(f"  {'first ms':>9} {'n':>6} {'steady ms':>9} {'n':>6}  CPU item (by first - steady)")
                for x in tr["cpu_items"][:top]:
                    out.append(f"  {x['first_ms']:9.2f} {x['first_n']:6d} {x['steady_ms']:9.2f} {x['steady_n']:6d}  "
                               f"{x['item'][:100]}")
                for x in tr["first_only_kernels"][:top]:
                    out.append(f"  {x['ms']:9.2f} {x['n']:6d} {'':>9} {'':>6}  first only: {x['kernel'][:100]}")
                for x in tr["kernels_launched_more"][:5]:
                    out.append(f"  {'':>9} {'+' + str(x['extra']):>6} {'':>9} {'':>6}  "
                               f"launched more: {x['kernel'][:90]}")
    return "\n".join(out)


def main(argv: list[str]) -> list[dict]:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--workloads", default=None)
    ap.add_argument("--out", default=None)
    known, rest = ap.parse_known_args(argv)
    wls = known.workloads.split(",") if known.workloads else [None]
    results = []
    for w in wls:
        a = rest + (["--workload", w] if w else [])
        if known.out:
            a += ["--json", os.path.join(known.out, f"first_call_{w or 'sdxl-1024'}.json")]
        try:
            results.append(H.main("first_call", a))
        except Exception as e:  # (one workload's failure leaves the others' results)
            print(f"{w}: failed: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr)
    print("\n" + table(results))
    if "--trace" in rest:
        print(trace_table(results))
    return results


if __name__ == "__main__":
    if "--child" in sys.argv:
        child(H.parse("first_call"))
    else:
        main(sys.argv[1:])
