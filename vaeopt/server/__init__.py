"""`vaeopt serve`: a decode server that diffusers' own remote VAE client (`remote_decode`) talks to.

protocol: the wire format, both ways (pure functions); worker: one decode thread and queue per device; metrics: the
Prometheus page; app: the Starlette application and the uvicorn server. Needs the `serve` extra
(pip install 'vaeopt[serve]': starlette, uvicorn).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
from pathlib import Path

from vaeopt.errors import VaeoptError
from vaeopt.options import Options, check_device_name, check_dtype_name, expand_home

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_RESERVED = {"health", "metrics"}


def _is_file(spec: str) -> bool:
    """Whether the whole spec names something on disk (a checkpoint whose name holds an '=')."""
    try:
        return Path(spec).expanduser().exists()
    except (OSError, RuntimeError):  # '~nosuchuser/...': then it is not one (said when it is expanded)
        return False


def parse_models(specs: list[str]) -> dict[str, str]:
    """--model PATH (one model, served at /) or --model NAME=PATH ... (each at /NAME)."""
    if not specs:
        raise VaeoptError("no model: pass --model path/to/vae.safetensors (or --model NAME=PATH, repeated)")
    models: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or _is_file(spec) or not _NAME.match(name):
            name, path = "", spec  # a path (that may hold an '=')
        if name in _RESERVED:
            raise VaeoptError(f"--model {spec}: {name!r} is the server's own page (/{name}); choose another name")
        if name in models:
            raise VaeoptError(f"--model {spec}: " + (f"the name {name!r} is given twice" if name else
                              "several models need names: --model NAME=PATH for each (each is served at /NAME)"))
        p = expand_home(path, f"--model {name}:" if name else "--model")
        if not p.exists():
            raise VaeoptError(f"--model {spec}: checkpoint not found: {p}")
        models[name] = str(p)
    if "" in models and len(models) > 1:
        raise VaeoptError("several models need names: --model NAME=PATH for each (each is served at /NAME)")
    return models


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def devices(device: str | None, gpus: int | None):
    """One worker per device: --device names one; else --gpus N of the visible GPUs, by default all; else the CPU."""
    import torch

    from vaeopt.hw import resolve_device

    if device is not None and gpus is not None:
        raise VaeoptError("--device and --gpus: give one (--device cuda:1 serves on that GPU alone)")
    if device is not None:
        return [resolve_device(device)]
    n = torch.cuda.device_count()
    if gpus is not None:
        if gpus < 1:
            raise VaeoptError(f"--gpus {gpus}: must be at least 1")
        if gpus > n:
            raise VaeoptError(f"--gpus {gpus}: only {n} CUDA GPU(s) visible")
        return [torch.device("cuda", i) for i in range(gpus)]
    return [torch.device("cuda", i) for i in range(n)] or [torch.device("cpu")]


def serve(models: list[str], host: str = "127.0.0.1", port: int = 8000, token: str | None = None,
          device: str | None = None, gpus: int | None = None, dtype: str = "auto", max_queue: int = 64,
          batch: int = 4, timeout_s: float = 120.0, body_timeout_s: float = 30.0, max_body_mb: float = 256,
          max_megapixels: float = 128, jpeg_quality: int = 95, log_level: str = "info") -> None:
    """Check everything, bind, and serve until Ctrl-C / SIGTERM."""
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise VaeoptError("vaeopt serve needs starlette and uvicorn: pip install 'vaeopt[serve]'") from None
    # argument mistakes first, before torch loads (seconds)
    token = token or os.environ.get("VAEOPT_TOKEN") or None
    if not is_loopback(host) and not token:
        raise VaeoptError(f"--host {host} lets other machines in: give a token (--token, or VAEOPT_TOKEN in the "
                          "environment, which `ps` does not show); clients send it as Authorization: Bearer TOKEN")
    if token is not None and len(token) < 16:
        raise VaeoptError("the token is shorter than 16 characters: use a long random one (python3 -c 'import "
                          "secrets; print(secrets.token_urlsafe(32))')")
    for name, v, lo in (("--queue", max_queue, 1), ("--batch", batch, 1)):
        if v < lo:
            raise VaeoptError(f"{name} {v}: must be at least {lo}")
    for name, v in (("--timeout", timeout_s), ("--body-timeout", body_timeout_s), ("--max-body-mb", max_body_mb),
                    ("--max-megapixels", max_megapixels)):
        if not 0 < v < float("inf"):
            raise VaeoptError(f"{name} {v}: must be a positive number")
    if not 1 <= jpeg_quality <= 100:
        raise VaeoptError(f"--jpeg-quality {jpeg_quality}: between 1 and 100")
    if not 0 <= port <= 65535:
        raise VaeoptError(f"--port {port}: between 0 and 65535")
    if log_level.lower() not in ("debug", "info", "warning"):
        raise VaeoptError(f"--log-level {log_level}: one of debug, info, warning")
    log_level = log_level.lower()
    check_dtype_name(dtype)
    check_device_name(device)
    if device is not None and gpus is not None:
        raise VaeoptError("--device and --gpus: give one (--device cuda:1 serves on that GPU alone)")
    if gpus is not None and gpus < 1:
        raise VaeoptError(f"--gpus {gpus}: must be at least 1")
    named = parse_models(models)
    from vaeopt.server.listen import bind

    sock = bind(host, port)  # a bad --host or a port in use: said now, before torch loads
    from vaeopt.server.app import Config, Server
    from vaeopt.server.protocol import Limits

    devs = devices(device, gpus)
    opts = Options(dtype=dtype)
    opts.validate()
    cfg = Config(named, devs, opts, token=token, max_queue=max_queue, max_batch=batch, timeout_s=timeout_s,
                 body_timeout_s=body_timeout_s, jpeg_quality=jpeg_quality,
                 limits=Limits(int(max_body_mb * 2**20), int(max_megapixels * 2**20)))
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO), format="%(message)s")
    where = sock.getsockname()
    shown = f"[{where[0]}]" if ":" in where[0] else where[0]
    log = logging.getLogger("vaeopt.server")
    for name in named:
        log.info("serving %s at http://%s:%d/%s", named[name], shown, where[1], name)
    log.info("workers: %s; queue %d each%s; GET /health answers 200 once the models are loaded and optimized",
             ", ".join(map(str, devs)), max_queue, f"; batches of up to {batch}" if batch > 1 else "")
    server = Server(cfg)
    try:
        server.run(sock, log_level)
    except KeyboardInterrupt:  # uvicorn stopped gracefully on Ctrl-C / SIGTERM, then passed the signal on
        log.info("stopped")
    if server.pool.failed:
        raise VaeoptError(f"a model did not load: {server.pool.failed}")
