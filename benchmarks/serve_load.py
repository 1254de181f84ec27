"""Load test of `vaeopt serve` with a bounded asyncio client: N concurrent clients, M mixed requests, every
response checked against its own expected output (a direct vaeopt.decode of that request's latents).

Each request carries its own random latents, so a lost, duplicated or mixed-up answer fails its check. Phases:
1. servers: one per --batch value, spawned at once (they load and warm up while the references are computed);
2. references: vaeopt.decode of every request's latents in this process, as uint8 images;
3. direct: the first shape decoded in this process, timed, as the public API gives it (float32 on the host) and as
   the server makes a PNG answer (decode, uint8 on the device, PNG encoding): the server's overhead is the one-client
   latency over the latter;
4. one client: --single sequential PNG requests at the first shape (on the first server);
5. load, per server: --clients concurrent clients share the --requests requests (PNG, JPEG, pt, pt uint8, mixed
   shapes), the same requests for every --batch value.
Writes one JSON document to --out and prints a short table last.

    # GPU: random-weight SDXL (as `vaeopt benchmark --workload sdxl-1024` builds it), the servers spawned here
    python benchmarks/serve_load.py --family sdxl --shapes 128x128,96x96,64x64 --clients 32 --requests 500 \\
        --batch 1,2,4,8 --out benchmarks/results/serve_load_sdxl.json
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
from urllib.parse import urlsplit

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the harness, which puts the repository first

import harness as H  # noqa: E402
import vaeopt  # noqa: E402
from vaeopt import outputs  # noqa: E402

KINDS = ("png", "jpg", "pt", "pt-uint8")


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    d = a.to(torch.int32) - b.to(torch.int32)
    mse = float((d * d).sum()) / max(1, d.numel())
    return float("inf") if mse == 0 else 10 * math.log10(255.0 ** 2 / mse)


def as_uint8(kind: str, body: bytes, headers) -> torch.Tensor:
    """A response as the (H, W, 3) uint8 image it carries."""
    if kind in ("png", "jpg"):
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


_PORTS: set[int] = set()


def free_port() -> int:
    """A free port, never one already handed to another server spawned here (they bind seconds later)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _PORTS:
            _PORTS.add(port)
            return port


def start_server(model: Path, args, batch: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "vaeopt", "serve", "--model", str(model), "--port", str(port), "--log-level",
           "warning", "--queue", str(max(64, args.clients * 2)), "--batch", str(batch)]
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
    return "{0.scheme}://{0.netloc}/health".format(urlsplit(url))


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
                    r["batch"] = int(resp.headers.get("x-vaeopt-batch", "1"))
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
    other = spec.get("other")
    if torch.equal(got, want) and (other is None or not torch.equal(want, other)):
        return {"match": True, "psnr_db": "inf", "exact": True}  # its own image, and no other's
    own = psnr(got, want)
    vs_other = psnr(got, other) if other is not None and other.shape == got.shape else None
    need = 30.0 if spec["kind"] == "jpg" else 40.0
    ok = own >= need and (vs_other is None or own > vs_other + 3)
    return {"match": ok, "psnr_db": round(own, 2) if math.isfinite(own) else "inf", "exact": bool(torch.equal(got, want)),
            "psnr_vs_other_db": None if vs_other is None else (round(vs_other, 2) if math.isfinite(vs_other) else "inf")}


async def warm(url: str, shapes, batch: int, channels: int, scaling: dict, hdr: dict) -> None:
    """Untimed: each shape's first decodes on a server, alone and (2 x batch at once) in batches."""
    import httpx

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), headers=hdr) as http:
        for sh in shapes:
            z = torch.zeros(1, channels, *sh, dtype=torch.float16)
            post = lambda: http.post(url, params=params("png", z.shape, scaling), content=z.numpy().tobytes(),  # noqa
                                     headers={"Content-Type": "tensor/binary", "Accept": "image/png"})
            await post()
            if batch > 1:
                await asyncio.gather(*[post() for _ in range(2 * batch)])


def tally(rs: list[dict], n: int) -> dict:
    ok = [r for r in rs if r.get("status") == 200 and r.get("match")]
    ids = [r["i"] for r in rs]
    by_status: dict[str, int] = {}
    for r in rs:
        by_status[str(r["status"])] = by_status.get(str(r["status"]), 0) + 1
    kinds_ = {k: summary([r["ms"] for r in ok if r["kind"] == k]) for k in sorted({r["kind"] for r in rs})}
    batches = [r["batch"] for r in ok if "batch" in r]
    return {"requests": n, "answered": len(rs), "ok": len(ok), "lost": n - len(set(ids)),
            "duplicated": len(ids) - len(set(ids)),
            "mismatched": sum(1 for r in rs if r.get("status") == 200 and not r.get("match")),
            "exact": sum(1 for r in ok if r.get("exact")), "by_status": by_status,
            # bytes equal to `vaeopt decode`'s, per kind (PNG and pt uint8 are, unbatched; JPEG and fp16 pt cannot be)
            "exact_by_kind": {k: f"{sum(1 for r in ok if r['kind'] == k and r.get('exact'))}/"
                                 f"{sum(1 for r in ok if r['kind'] == k)}" for k in sorted({r["kind"] for r in ok})},
            "retried_503": sum(1 for r in rs if r.get("tries", 1) > 1),
            "latency": summary([r["ms"] for r in ok]), "by_kind": kinds_,
            "server_decode": summary([r["server_decode_ms"] for r in ok]),  # the worker's part of it
            "mean_batch": round(statistics.fmean(batches), 2) if batches else None,
            "failures": [r for r in rs if not (r.get("status") == 200 and r.get("match"))][:10]}


def table(result: dict) -> str:
    s = result["single_client"]
    d = result["direct"]
    lines = [f"serve_load: {result['gpu'] or 'cpu'}, {result['model']}, {result['clients']} clients",
             f"one client PNG {s['shape']}: p50 {fmt(s['latency']['p50_ms'])} ms, p99 {fmt(s['latency']['p99_ms'])} ms"
             f" (direct: decode {fmt(d['decode_p50_ms'])} ms, decode+PNG {fmt(d['png_p50_ms'])} ms; server overhead "
             f"{fmt(s['overhead_p50_ms'])} ms); uint8 made on the device = on the host: "
             f"{d['uint8_on_device_equals_host']}",
             f"{'batch':>6} {'ok':>9} {'lost':>4} {'dup':>4} {'mixed':>5} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>7} "
             f"{'mean batch':>10} {'decode p50':>10}  exact png / pt-uint8"]
    for v in result["variants"]:
        L = v["load"]
        lines.append(f"{str(v['batch']):>6} {L['ok']:>4}/{L['requests']:<4} {L['lost']:>4} {L['duplicated']:>4} "
                     f"{L['mismatched']:>5} {fmt(L['latency']['p50_ms']):>8} {fmt(L['latency']['p99_ms']):>8} "
                     f"{fmt(L['throughput_rps']):>7} {fmt(L['mean_batch']):>10} "
                     f"{fmt(L['server_decode']['p50_ms']):>10}  {L['exact_by_kind'].get('png', '-')} / "
                     f"{L['exact_by_kind'].get('pt-uint8', '-')}")
    return "\n".join(lines)


def fmt(v) -> str:
    return "-" if v is None else f"{v:.1f}" if isinstance(v, float) else str(v)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="checkpoint (served here, and used for the expected outputs)")
    ap.add_argument("--family", help="random-weight model of this family instead (sdxl)")
    ap.add_argument("--url", help="a running server's endpoint (default: start them here)")
    ap.add_argument("--device", help="--device for the spawned servers and the reference decodes")
    ap.add_argument("--gpus", type=int, help="--gpus for the spawned servers")
    ap.add_argument("--batch", default="1", help="--batch values, one spawned server each: 1,2,4,8")
    ap.add_argument("--shapes", default="128x128", help="latent HxW sizes, comma separated (first: one-client phase)")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"response kinds to mix: {', '.join(KINDS)}")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--single", type=int, default=20, help="sequential PNG requests of the one-client phase")
    ap.add_argument("--direct", type=int, default=20, help="timed direct decodes of the first shape")
    ap.add_argument("--deadline", type=float, default=120.0, help="seconds for each load phase at most")
    ap.add_argument("--token", default=os.environ.get("VAEOPT_TOKEN"))
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    t_start = time.perf_counter()
    if not 1 <= a.clients <= 1024 or not 1 <= a.requests <= 100_000 or a.single < 0 or a.direct < 1:
        raise SystemExit("--clients 1..1024, --requests 1..100000, --single >= 0, --direct >= 1")
    kinds = [k for k in a.kinds.split(",") if k]
    if not kinds or any(k not in KINDS for k in kinds):
        raise SystemExit(f"--kinds: choose from {', '.join(KINDS)}")
    try:
        batches = [int(b) for b in a.batch.split(",") if b]
    except ValueError:
        raise SystemExit(f"--batch {a.batch}: whole numbers, comma separated") from None
    if not batches or min(batches) < 1:
        raise SystemExit(f"--batch {a.batch}: whole numbers of at least 1")
    if a.url and len(batches) > 1:
        raise SystemExit("--url: the running server has its own --batch; give one --batch value (its label)")
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    tmp = tempfile.TemporaryDirectory(prefix="vaeopt-load-")
    if a.model is None and a.family != "sdxl":
        raise SystemExit("give --model PATH or --family sdxl")
    model = a.model or H.save_model("sdxl", Path(tmp.name) / "sdxl")  # (its config keeps SDXL's scaling factor)

    # 1. the servers: started first, they load while the references are computed
    servers = [(None, a.url)] if a.url else [start_server(model, a, b) for b in batches]
    try:
        result = run(a, model, shapes, kinds, batches, servers)
    finally:
        procs = [proc for proc, _ in servers if proc is not None]
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        tmp.cleanup()
    result["seconds"] = round(time.perf_counter() - t_start, 1)
    H.write_json(result, a.out)
    print(f"-> {a.out} ({result['seconds']} s)")
    print(table(result), flush=True)
    s_sum = result["single_client"]
    if s_sum["ok"] != s_sum["requests"] or any(v["load"]["ok"] != v["load"]["requests"] for v in result["variants"]):
        sys.exit(1)


def run(a, model: Path, shapes, kinds, batches, servers) -> dict:
    import httpx

    from vaeopt.server import png

    # 2. references: each request's own latents, decoded directly as `vaeopt decode` does (float32 to the host, uint8
    # made there), so that an exact answer also shows the server's uint8 made on the GPU to be the same bytes
    loaded = vaeopt.load_vae(model)
    fam = loaded.family
    opts = vaeopt.Options(device=a.device) if a.device else None
    scaling = {"scaling_factor": fam.config.get("scaling_factor"), "shift_factor": fam.config.get("shift_factor")}
    if fam.config.get("latents_mean") is not None:
        raise SystemExit("image VAEs with a scalar scaling factor only (SD, SDXL, SD3, FLUX)")

    def reference(z):
        return outputs.to_uint8_images(vaeopt.decode(z, loaded, options=opts))

    def as_server_does(z):  # the float32 output left on the device, uint8 made there
        return outputs.to_uint8_images(vaeopt.decode(z, loaded, options=opts, on_device=True), on_device=True).cpu()

    rng = random.Random(0)
    n_total = a.single + a.requests
    specs = []
    for sh in shapes:  # warm: the first decode of a shape builds/tunes, not measured
        reference(torch.zeros(1, fam.latent_channels, *sh, dtype=torch.float16))
    t_ref = time.perf_counter()
    for i in range(n_total):
        single = i < a.single
        sh = shapes[0] if single else shapes[rng.randrange(len(shapes))]
        kind = "png" if single else kinds[rng.randrange(len(kinds))]
        g = torch.Generator().manual_seed(1000 + i)
        z = torch.randn(1, fam.latent_channels, *sh, generator=g).to(torch.float16)
        accept = {"png": "image/png", "jpg": "image/jpeg"}.get(kind, "tensor/binary")
        specs.append({"i": i, "kind": kind, "shape": list(z.shape), "params": params(kind, z.shape, scaling),
                      "body": z.numpy().tobytes(), "headers": {"Content-Type": "tensor/binary", "Accept": accept},
                      "expected": reference(z)[0]})
    for i, s in enumerate(specs):  # another request's image of the same size: a mix-up would match it better
        s["other"] = next((o["expected"] for o in specs[i + 1:] + specs[:i] if o["shape"] == s["shape"]), None)
    ref_s = time.perf_counter() - t_ref
    print(f"references: {n_total} decodes in {ref_s:.1f} s", flush=True)

    ready = [wait_ready(health_url(url), proc, 900) for proc, url in servers]
    print(f"servers ready ({', '.join(f'{r:.1f}' for r in ready)} s after the references)", flush=True)

    # 3. direct decodes of the first shape, timed while the servers idle (the public API; a PNG answer without HTTP)
    def latents(spec):
        return torch.from_numpy(np.frombuffer(spec["body"], dtype=np.float16).copy()).view(spec["shape"])

    z0 = latents(specs[0])
    t_dec, t_png = [], []
    for _ in range(a.direct):
        t0 = time.perf_counter()
        vaeopt.decode(z0, loaded, options=opts)
        t_dec.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        png.encode(as_server_does(z0)[0].numpy())
        t_png.append((time.perf_counter() - t0) * 1e3)
    same_bytes = all(torch.equal(as_server_does(latents(o)), reference(latents(o)))  # 8 of them, every shape
                     for o in specs[:: max(1, len(specs) // 8)])
    loaded = None  # its GPU memory back for the servers
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

    hdr = {"Authorization": f"Bearer {a.token}"} if a.token else {}
    variants = []
    single: list[dict] = []
    for k, ((proc, url), b) in enumerate(zip(servers, batches)):
        asyncio.run(warm(url, shapes, b, fam.latent_channels, scaling, hdr))
        if k == 0 and a.single:  # 4. one client (batching cannot apply)
            single = asyncio.run(run_load(url, specs[:a.single], 1, a.deadline, hdr))
        t0 = time.perf_counter()  # 5. load
        load = asyncio.run(run_load(url, specs[a.single:], a.clients, a.deadline, hdr))
        wall = time.perf_counter() - t0
        metrics = httpx.get(health_url(url).replace("/health", "/metrics"), headers=hdr, timeout=10).text
        tl = tally(load, a.requests)
        tl.update(wall_s=round(wall, 3),
                  throughput_rps=round(sum(1 for r in load if r.get("status") == 200) / wall, 2) if wall else None)
        variants.append({"batch": b if proc is not None else "server", "url": url, "load": tl,
                         "server_metrics": [ln for ln in metrics.splitlines() if ln.startswith((
                             "vaeopt_requests_total", "vaeopt_gpu_memory", "vaeopt_oom", "vaeopt_dropped",
                             "vaeopt_host"))]})
        print(f"batch {b}: {tl['ok']}/{tl['requests']} ok, p50 {fmt(tl['latency']['p50_ms'])} ms, "
              f"{tl['throughput_rps']} req/s", flush=True)

    first = "x".join(map(str, shapes[0]))
    s_sum = tally(single, a.single)
    d50, p50 = statistics.median(t_dec), statistics.median(t_png)
    return {
        "model": str(a.model) if a.model else f"{a.family} (random weights)", "family": fam.name,
        "device": a.device or ("cuda" if torch.cuda.is_available() else "cpu"),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch": torch.__version__, "vaeopt": vaeopt.__version__, "spawned_server": servers[0][0] is not None,
        "server_ready_s": [round(r, 1) for r in ready], "clients": a.clients, "shapes": [list(s) for s in shapes],
        "kinds": kinds, "references_s": round(ref_s, 1),
        "direct": {"shape": first, "decode": summary(t_dec), "decode_p50_ms": d50, "png": summary(t_png),
                   "png_p50_ms": p50, "uint8_on_device_equals_host": same_bytes},
        "single_client": {**s_sum, "shape": first,
                          "overhead_p50_ms": (s_sum["latency"]["p50_ms"] - p50)
                          if s_sum["latency"]["p50_ms"] is not None else None},
        "variants": variants,
        "load": variants[0]["load"],  # the first --batch value's
    }


if __name__ == "__main__":
    main()
