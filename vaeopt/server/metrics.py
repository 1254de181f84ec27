"""GET /metrics in the Prometheus text exposition format (version 0.0.4), written by hand: a few counters, two
histograms and some gauges need no client library."""

from __future__ import annotations

import os
import threading

import torch

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Histogram:
    def __init__(self):
        self.counts = [0] * (len(BUCKETS) + 1)
        self.sum = 0.0

    def observe(self, v: float) -> None:
        i = next((i for i, b in enumerate(BUCKETS) if v <= b), len(BUCKETS))
        self.counts[i] += 1
        self.sum += v

    def lines(self, name: str, labels: str) -> list[str]:
        out, acc = [], 0
        sep = "," if labels else ""
        for b, c in zip(BUCKETS + (float("inf"),), self.counts):
            acc += c
            le = "+Inf" if b == float("inf") else repr(b)
            out.append(f'{name}_bucket{{{labels}{sep}le="{le}"}} {acc}')
        out.append(f"{name}_sum{{{labels}}} {self.sum:.6f}")
        out.append(f"{name}_count{{{labels}}} {acc}")
        return out


def _esc(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def host_rss_bytes() -> int | None:
    """This process's resident memory (Linux /proc; None elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class Metrics:
    def __init__(self):
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, str, int], int] = {}  # (model, output_type, status) -> count
        self.latency: dict[str, Histogram] = {}  # per model: request seconds, body read to last byte built
        self.decode: dict[str, Histogram] = {}  # per model: decode seconds on the worker
        self.disconnects = 0

    def request(self, model: str, output: str, status: int, seconds: float | None = None,
                decode_s: float | None = None) -> None:
        with self._lock:
            k = (model, output, status)
            self.requests[k] = self.requests.get(k, 0) + 1
            if seconds is not None:
                self.latency.setdefault(model, Histogram()).observe(seconds)
            if decode_s is not None:
                self.decode.setdefault(model, Histogram()).observe(decode_s)

    def render(self, pool) -> str:
        L = ["# HELP vaeopt_requests_total Decode requests answered, by model, output type and HTTP status.",
             "# TYPE vaeopt_requests_total counter"]
        with self._lock:
            for (m, o, s), n in sorted(self.requests.items()):
                L.append(f'vaeopt_requests_total{{model="{_esc(m)}",output_type="{_esc(o)}",status="{s}"}} {n}')
            L += ["# HELP vaeopt_request_seconds Time from the request's arrival to its answer (2xx only).",
                  "# TYPE vaeopt_request_seconds histogram"]
            for m, h in sorted(self.latency.items()):
                L += h.lines("vaeopt_request_seconds", f'model="{_esc(m)}"')
            L += ["# HELP vaeopt_decode_seconds Decode time on the worker (a batch counts once per request).",
                  "# TYPE vaeopt_decode_seconds histogram"]
            for m, h in sorted(self.decode.items()):
                L += h.lines("vaeopt_decode_seconds", f'model="{_esc(m)}"')
            L += ["# HELP vaeopt_client_disconnects_total Clients that went away before their answer.",
                  "# TYPE vaeopt_client_disconnects_total counter", f"vaeopt_client_disconnects_total {self.disconnects}"]
        L += ["# HELP vaeopt_queue_depth Requests queued or decoding, per worker.", "# TYPE vaeopt_queue_depth gauge"]
        L += [f'vaeopt_queue_depth{{device="{w.label}"}} {w.depth}' for w in pool.workers]
        L += ["# HELP vaeopt_worker_ready 1 once the worker's models are loaded and optimized.",
              "# TYPE vaeopt_worker_ready gauge"]
        L += [f'vaeopt_worker_ready{{device="{w.label}"}} {int(w.state == "ready")}' for w in pool.workers]
        L += ["# HELP vaeopt_oom_retries_total Decodes retried tiled after running out of memory.",
              "# TYPE vaeopt_oom_retries_total counter"]
        L += [f'vaeopt_oom_retries_total{{device="{w.label}"}} {w.oom_retries}' for w in pool.workers]
        L += ["# HELP vaeopt_dropped_total Queued requests skipped because their client had gone.",
              "# TYPE vaeopt_dropped_total counter"]
        L += [f'vaeopt_dropped_total{{device="{w.label}"}} {w.dropped}' for w in pool.workers]
        gpus = [w.device for w in pool.workers if w.device.type == "cuda"]
        if gpus:
            L += ["# HELP vaeopt_gpu_memory_allocated_bytes Tensor memory allocated by torch on the GPU.",
                  "# TYPE vaeopt_gpu_memory_allocated_bytes gauge"]
            L += [f'vaeopt_gpu_memory_allocated_bytes{{device="{d}"}} {torch.cuda.memory_allocated(d)}' for d in gpus]
            L += ["# HELP vaeopt_gpu_memory_reserved_bytes Memory held by torch's caching allocator on the GPU.",
                  "# TYPE vaeopt_gpu_memory_reserved_bytes gauge"]
            L += [f'vaeopt_gpu_memory_reserved_bytes{{device="{d}"}} {torch.cuda.memory_reserved(d)}' for d in gpus]
            L += ["# HELP vaeopt_gpu_memory_free_bytes Free memory on the GPU (all processes).",
                  "# TYPE vaeopt_gpu_memory_free_bytes gauge"]
            L += [f'vaeopt_gpu_memory_free_bytes{{device="{d}"}} {torch.cuda.mem_get_info(d)[0]}' for d in gpus]
        rss = host_rss_bytes()
        if rss is not None:
            L += ["# HELP vaeopt_host_rss_bytes Resident host memory of the server process.",
                  "# TYPE vaeopt_host_rss_bytes gauge", f"vaeopt_host_rss_bytes {rss}"]
        return "\n".join(L) + "\n"
