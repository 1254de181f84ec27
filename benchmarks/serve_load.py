"""Load test of `vaeopt serve` with a bounded asyncio client: N concurrent clients, M mixed requests, every
response checked against its own expected output (a direct vaeopt.decode of that request's latents).

Each request carries its own random latents, so a lost, duplicated or mixed-up answer fails its check. Phases:
1. reference: vaeopt.decode of every request's latents in this process (also the direct-decode time per shape);
2. one client: --single sequential PNG requests at the first shape (its p50 vs the direct decode: the server's
   overhead);
3. load: --clients concurrent clients share the --requests requests (PNG, JPEG, pt, pt uint8, mixed shapes).
Writes one JSON document to --out.

    # GPU: random-weight SDXL (as `vaeopt benchmark --workload sdxl-1024` builds it), the server spawned here
    python benchmarks/serve_load.py --family sdxl --shapes 128x128,96x96,64x64 --clients 32 --requests 500 \
        --out benchmarks/results/serve_load_sdxl.json
    # against a running server (its model given too, for the expected outputs)
    python benchmarks/serve_load.py --url http://127.0.0.1:8000/ --model vae.safetensors ...
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import math
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import vaeopt  # noqa: E402
from vaeopt import outputs  # noqa: E402

KINDS = ("png", "jpg", "pt", "pt-uint8")


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = float(((a.float() - b.float()) ** 2).mean())
    return float("inf") if mse == 0 else 10 * math.log10(255.0 ** 2 / mse)


def as_uint8(kind: str, body: bytes, headers) -> torch.Tensor:
    """A response as the (H, W, 3) uint8 image it carries."""
    if kind in ("png", "jpg"):
        import numpy as np
        from PIL import Image

        return torch.from_numpy(np.asarray(Image.open(io.BytesIO(body)).convert("RGB")).copy())
    dt = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "uint8": torch.uint8}
    t = torch.frombuffer(bytearray(body), dtype=dt[headers["dtype"]]).reshape(json.loads(headers["shape"]))
    return t[0] if kind == "pt-uint8" else outputs.to_uint8_images(t.float())[0]


def params(kind: str, shape, scaling) -> dict:
    p = {"shape": list(shape), "dtype": "float16", "partial_postprocess": kind == "pt-uint8",
         "output_type": "pil" if kind in ("png", "jpg") else "pt", "image_format": "png" if kind == "png" else "jpg"}
    if scaling.get("scaling_factor") is not None:
        p["scaling_factor"] = scaling["scaling_factor"]
    if scaling.get("shift_factor"):
        p["shift_factor"] = scaling["shift_factor"]
    return p


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))]


def summary(ms: list[float]) -> dict:
    return {"n": len(ms), "p50_ms": pct(ms, 50), "p90_ms": pct(ms, 90), "p99_ms": pct(ms, 99),
            "mean_ms": statistics.fmean(ms) if ms else None, "max_ms": max(ms) if ms else None}


def random_sdxl(folder: Path) -> Path:
    """SDXL's full-size VAE with random weights, as `vaeopt benchmark --workload sdxl-1024` builds it, saved as a
    diffusers folder (its config keeps SDXL's scaling factor)."""
    from vaeopt.families import build_model, get_family

    torch.manual_seed(0)
    build_model(get_family("sdxl")).save_pretrained(folder)
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: Path, args) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "vaeopt", "serve", "--model", str(model), "--port", str(port), "--log-level",
           "warning", "--queue", str(max(64, args.clients * 2)), "--batch", str(args.batch)]
    if args.device:
        cmd += ["--device", args.device]
    if args.gpus:
        cmd += ["--gpus", str(args.gpus)]
    print("server:", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd)
    return proc, f"http://127.0.0.1:{port}/"


def wait_ready(health: str, proc, limit_s: float) -> float:
    import httpx

    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode}) before it was ready")
        try:
            if httpx.get(health, timeout=2).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the server was not ready within {limit_s:g} s")


def health_url(url: str) -> str:
    from urllib.parse import urlsplit

    u = urlsplit(url)
    return f"{u.scheme}://{u.netloc}/health"


async def run_load(url: str, specs: list[dict], clients: int, deadline_s: float, headers: dict) -> list[dict]:
    """`clients` coroutines pull the requests from one queue; each result is checked (off the event loop) as soon as
    it arrives. Bounded: in count (the queue) and in time (deadline_s; what is left is reported lost)."""
    import httpx

    q: asyncio.Queue = asyncio.Queue()
    for s in specs:
        q.put_nowait(s)
    results: list[dict] = []
    loop = asyncio.get_running_loop()
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)

    async def client(http):
        while True:
            try:
                s = q.get_nowait()
            except asyncio.QueueEmpty:
                return
            r = {"i": s["i"], "kind": s["kind"], "shape": s["shape"], "status": None, "tries": 0}
            for attempt in range(4):  # 503 (queue full): after its Retry-After, at most 3 more times
                r["tries"] = attempt + 1
                t0 = time.perf_counter()
                try:
                    resp = await http.post(url, params=s["params"], content=s["body"], headers=s["headers"])
                except httpx.HTTPError as e:
                    r["status"], r["error"] = "error", f"{type(e).__name__}: {e}"
                    break
                r["ms"] = (time.perf_counter() - t0) * 1e3
                r["status"] = resp.status_code
                if resp.status_code == 503 and attempt < 3:
                    await asyncio.sleep(min(5.0, float(resp.headers.get("retry-after", "1"))))
                    continue
                if resp.status_code == 200:
                    r["server_decode_ms"] = float(resp.headers.get("x-vaeopt-decode-ms", "nan"))
                    r.update(await loop.run_in_executor(None, check, s, resp.content, resp.headers))
                else:
                    r["error"] = resp.text[:300]
                break
            results.append(r)

    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits, headers=headers) as http:
        tasks = [asyncio.create_task(client(http)) for _ in range(clients)]
        done, pending = await asyncio.wait(tasks, timeout=deadline_s)
        for t in pending:
            t.cancel()
    return results


def check(spec: dict, body: bytes, headers) -> dict:
    """This response against its own expected image, and against another request's (a mix-up shows as a better
    match with the other)."""
    try:
        got = as_uint8(spec["kind"], body, headers)
    except Exception as e:  # noqa: BLE001 — an unreadable answer is a failed check
        return {"match": False, "check_error": f"{type(e).__name__}: {e}"}
    want = spec["expected"]
    if got.shape != want.shape:
        return {"match": False, "check_error": f"shape {tuple(got.shape)} != {tuple(want.shape)}"}
    own = psnr(got, want)
    other = spec.get("other")
    vs_other = psnr(got, other) if other is not None and other.shape == got.shape else None
    need = 30.0 if spec["kind"] == "jpg" else 40.0
    ok = own >= need and (vs_other is None or own > vs_other + 3)
    return {"match": ok, "psnr_db": round(own, 2) if math.isfinite(own) else "inf", "exact": bool(torch.equal(got, want)),
            "psnr_vs_other_db": None if vs_other is None else (round(vs_other, 2) if math.isfinite(vs_other) else "inf")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="checkpoint (served here, and used for the expected outputs)")
    ap.add_argument("--family", help="random-weight model of this family instead (sdxl)")
    ap.add_argument("--url", help="a running server's endpoint (default: start one here)")
    ap.add_argument("--device", help="--device for the spawned server and the reference decodes")
    ap.add_argument("--gpus", type=int, help="--gpus for the spawned server")
    ap.add_argument("--batch", type=int, default=1, help="--batch for the spawned server")
    ap.add_argument("--shapes", default="128x128", help="latent HxW sizes, comma separated (first: the one-client "
                                                        "phase)")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"response kinds to mix: {', '.join(KINDS)}")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--single", type=int, default=20, help="sequential PNG requests of the one-client phase")
    ap.add_argument("--deadline", type=float, default=1200.0, help="seconds for the load phase at most")
    ap.add_argument("--token", default=os.environ.get("VAEOPT_TOKEN"))
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    if not 1 <= a.clients <= 1024 or not 1 <= a.requests <= 100_000 or a.single < 0:
        raise SystemExit("--clients 1..1024, --requests 1..100000, --single >= 0")
    kinds = [k for k in a.kinds.split(",") if k]
    if not kinds or any(k not in KINDS for k in kinds):
        raise SystemExit(f"--kinds: choose from {', '.join(KINDS)}")
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    tmp = tempfile.TemporaryDirectory(prefix="vaeopt-load-")
    if a.model is None and a.family != "sdxl":
        raise SystemExit("give --model PATH or --family sdxl")
    model = a.model or random_sdxl(Path(tmp.name) / "sdxl")

    # 1. references: each request's own latents, decoded directly
    loaded = vaeopt.load_vae(model)
    fam = loaded.family
    opts = vaeopt.Options(device=a.device) if a.device else None
    scaling = {"scaling_factor": fam.config.get("scaling_factor"), "shift_factor": fam.config.get("shift_factor")}
    if fam.config.get("latents_mean") is not None:
        raise SystemExit("image VAEs with a scalar scaling factor only (SD, SDXL, SD3, FLUX)")
    rng = random.Random(0)
    n_total = a.single + a.requests
    specs, direct = [], {}
    for sh in shapes:  # warm: the first decode of a shape builds/tunes, not measured
        vaeopt.decode(torch.zeros(1, fam.latent_channels, *sh, dtype=torch.float16), loaded, options=opts)
    t_ref = time.perf_counter()
    for i in range(n_total):
        single = i < a.single
        sh = shapes[0] if single else shapes[rng.randrange(len(shapes))]
        kind = "png" if single else kinds[rng.randrange(len(kinds))]
        g = torch.Generator().manual_seed(1000 + i)
        z = torch.randn(1, fam.latent_channels, *sh, generator=g).to(torch.float16)
        t0 = time.perf_counter()
        out = vaeopt.decode(z, loaded, options=opts)
        direct.setdefault("x".join(map(str, sh)), []).append((time.perf_counter() - t0) * 1e3)
        body = z.numpy().tobytes()
        accept = {"png": "image/png", "jpg": "image/jpeg"}.get(kind, "tensor/binary")
        specs.append({"i": i, "kind": kind, "shape": list(z.shape), "params": params(kind, z.shape, scaling),
                      "body": body, "headers": {"Content-Type": "tensor/binary", "Accept": accept},
                      "expected": outputs.to_uint8_images(out)[0]})
    for i, s in enumerate(specs):  # another request's image of the same size: a mix-up would match it better
        s["other"] = next((o["expected"] for o in specs[i + 1:] + specs[:i] if o["shape"] == s["shape"]), None)
    ref_s = time.perf_counter() - t_ref
    del loaded
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    print(f"references: {n_total} decodes in {ref_s:.1f} s", flush=True)

    proc = None
    url = a.url
    if url is None:
        proc, url = start_server(model, a)
    try:
        ready_s = wait_ready(health_url(url), proc, 900)
        hdr = {"Authorization": f"Bearer {a.token}"} if a.token else {}
        import httpx

        for sh in shapes:  # untimed: each shape's first decode on the server picks its algorithms
            z = torch.zeros(1, fam.latent_channels, *sh, dtype=torch.float16)
            httpx.post(url, params=params("png", z.shape, scaling), content=z.numpy().tobytes(),
                       headers={**hdr, "Content-Type": "tensor/binary", "Accept": "image/png"}, timeout=600)
        # 2. one client
        single = asyncio.run(run_load(url, specs[:a.single], 1, a.deadline, hdr)) if a.single else []
        # 3. load
        t0 = time.perf_counter()
        load = asyncio.run(run_load(url, specs[a.single:], a.clients, a.deadline, hdr))
        wall = time.perf_counter() - t0
        metrics = httpx.get(health_url(url).replace("/health", "/metrics"), headers=hdr, timeout=10).text
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        tmp.cleanup()

    def tally(rs: list[dict], n: int) -> dict:
        ok = [r for r in rs if r.get("status") == 200 and r.get("match")]
        ids = [r["i"] for r in rs]
        by_status: dict[str, int] = {}
        for r in rs:
            by_status[str(r["status"])] = by_status.get(str(r["status"]), 0) + 1
        kinds_ = {k: summary([r["ms"] for r in ok if r["kind"] == k]) for k in sorted({r["kind"] for r in rs})}
        return {"requests": n, "answered": len(rs), "ok": len(ok), "lost": n - len(set(ids)),
                "duplicated": len(ids) - len(set(ids)),
                "mismatched": sum(1 for r in rs if r.get("status") == 200 and not r.get("match")),
                "exact": sum(1 for r in ok if r.get("exact")), "by_status": by_status,
                "retried_503": sum(1 for r in rs if r.get("tries", 1) > 1),
                "latency": summary([r["ms"] for r in ok]), "by_kind": kinds_,
                "server_decode": summary([r["server_decode_ms"] for r in ok]),  # the worker's part of it
                "failures": [r for r in rs if not (r.get("status") == 200 and r.get("match"))][:10]}

    first = "x".join(map(str, shapes[0]))
    from PIL import Image

    img = Image.fromarray(specs[0]["expected"].numpy())
    t_png = []
    for _ in range(5):  # what PNG encoding alone costs (the server encodes at zlib level 1)
        t1 = time.perf_counter()
        img.save(io.BytesIO(), format="PNG", compress_level=1)
        t_png.append((time.perf_counter() - t1) * 1e3)
    s_sum = tally(single, a.single)
    d50 = statistics.median(direct[first])
    result = {
        "model": str(a.model) if a.model else f"{a.family} (random weights)", "family": fam.name,
        "device": a.device or ("cuda" if torch.cuda.is_available() else "cpu"),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch": torch.__version__, "vaeopt": vaeopt.__version__, "url": url, "spawned_server": proc is not None,
        "server_ready_s": round(ready_s, 1), "clients": a.clients, "shapes": [list(s) for s in shapes],
        "kinds": kinds, "batch": a.batch,
        "direct_decode": {k: summary(v) for k, v in direct.items()},
        "png_encode_ms": statistics.median(t_png),
        "single_client": {**s_sum, "shape": first, "overhead_p50_ms": (s_sum["latency"]["p50_ms"] - d50)
                          if s_sum["latency"]["p50_ms"] is not None else None},
        "load": {**tally(load, a.requests), "wall_s": round(wall, 3),
                 "throughput_rps": round(sum(1 for r in load if r.get("status") == 200) / wall, 2) if wall else None},
        "server_metrics": [ln for ln in metrics.splitlines() if ln.startswith(("vaeopt_requests_total",
                                                                               "vaeopt_gpu_memory", "vaeopt_oom",
                                                                               "vaeopt_dropped", "vaeopt_host"))],
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = a.out.with_name(f".{a.out.name}.partial")
    tmp_out.write_text(json.dumps(result, indent=1, default=str))
    os.replace(tmp_out, a.out)
    L = result["load"]
    print(f"one client PNG {first}: p50 {s_sum['latency']['p50_ms']} ms (direct decode p50 {d50:.1f} ms); load: "
          f"{L['ok']}/{L['requests']} ok, {L['mismatched']} mismatched, {L['lost']} lost, p50 "
          f"{L['latency']['p50_ms']} ms, p99 {L['latency']['p99_ms']} ms, {L['throughput_rps']} req/s -> {a.out}")
    if L["ok"] != L["requests"] or s_sum["ok"] != s_sum["requests"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
