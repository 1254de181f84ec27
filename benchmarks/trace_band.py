"""Read the per-rank chrome traces of a band-parallel decode (`gpu_distributed.py --profile --trace`) on any machine:
why the compute stream waits between kernels.

For each kernel of a rank's compute stream (the non-NCCL stream with the most kernel time) the gap after the previous
kernel on that stream is charged to
  * host: the kernel's launch call returned less than 5 us before it started (the host was late),
  * comm: an NCCL kernel (on its own stream) ended within 20 us before it started (a halo exchange / gather wait),
  * other: anything else (a stream wait on something else, the allocator, ...).
Plus, per rank: NCCL kernel count and time, kernel time on the compute stream, cuDNN convs under 200 us (at these
shapes, the halo rows' convs) and copy kernels, when the host had launched everything, and (same host clock) the skew
between the ranks' n-th SendRecv kernel starts.

    python benchmarks/trace_band.py band_trace_..._rank0.json.gz band_trace_..._rank1.json.gz [--json OUT.json]
"""
import argparse
import bisect
import collections
import gzip
import json
import statistics


def load(path):
    return json.load(gzip.open(path) if path.endswith(".gz") else open(path))["traceEvents"]


def analyse(ev) -> dict:
    kern = [e for e in ev if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    launch = {}
    for e in ev:
        if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver"):
            c = (e.get("args") or {}).get("correlation")
            if c is not None:
                launch[c] = e["ts"] + e["dur"]
    by_stream = collections.defaultdict(list)
    nccl = []
    for e in kern:
        if "nccl" in e["name"].lower():
            nccl.append(e)
        else:
            by_stream[e.get("tid")].append(e)
    comp_tid = max(by_stream, key=lambda t: sum(e["dur"] for e in by_stream[t]))
    comp = sorted(by_stream[comp_tid], key=lambda e: e["ts"])
    nccl_ends = sorted(e["ts"] + e["dur"] for e in nccl)
    gaps = collections.Counter()
    counts = collections.Counter()
    big = []
    for prev, k in zip(comp, comp[1:]):
        gap = k["ts"] - (prev["ts"] + prev["dur"])
        if gap <= 2.0:
            continue
        le = launch.get((k.get("args") or {}).get("correlation"))
        i = bisect.bisect_right(nccl_ends, k["ts"])
        if le is not None and le >= k["ts"] - 5.0:
            why = "host"
        elif i > 0 and k["ts"] - nccl_ends[i - 1] <= 20.0:
            why = "comm"
        else:
            why = "other"
        gaps[why] += gap
        counts[why] += 1
        big.append((gap, why, prev["name"][:60], k["name"][:60]))
    big.sort(reverse=True)
    host_end = max((e["ts"] + e["dur"] for e in ev if e.get("ph") == "X" and e.get("cat") == "cuda_runtime"
                    and "Synchronize" not in e["name"]), default=None)
    t0 = comp[0]["ts"]
    send = sorted(e["ts"] for e in nccl if "SendRecv" in e["name"])
    small = [e for e in comp if "fprop" in e["name"] and e["dur"] < 200.0]  # cuDNN convs under 200 us: the halo convs
    copies = [e for e in comp if "direct_copy" in e["name"] or "CatArray" in e["name"]]
    return {
        "small_cudnn_convs": {"count": len(small), "ms": sum(e["dur"] for e in small) / 1e3},
        "copy_kernels": {"count": len(copies), "ms": sum(e["dur"] for e in copies) / 1e3},
        "compute_span_ms": (comp[-1]["ts"] + comp[-1]["dur"] - t0) / 1e3,
        "compute_kernel_ms": sum(e["dur"] for e in comp) / 1e3,
        "compute_kernels": len(comp),
        "gap_ms": {k: v / 1e3 for k, v in gaps.items()},
        "gap_count": dict(counts),
        "largest_gaps_us": big[:12],
        "nccl": {n: {"count": sum(1 for e in nccl if e["name"].startswith(n)),
                     "ms": sum(e["dur"] for e in nccl if e["name"].startswith(n)) / 1e3}
                 for n in sorted({e["name"].split("(")[0] for e in nccl})},
        "host_launched_everything_by_ms": None if host_end is None else (host_end - t0) / 1e3,
        "_sendrecv_starts": send,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--json")
    args = ap.parse_args()
    res = {p: analyse(load(p)) for p in args.traces}
    starts = [r.pop("_sendrecv_starts") for r in res.values()]
    out = {"ranks": res}
    if len(starts) >= 2 and len(starts[0]) == len(starts[1]) and starts[0]:
        d = [b - a for a, b in zip(starts[0], starts[1])]
        out["sendrecv_start_skew_us_rank1_minus_rank0"] = {
            "median": statistics.median(d), "min": min(d), "max": max(d), "n": len(d)}
    print(json.dumps(out, indent=1))
    if args.json:
        json.dump(out, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
