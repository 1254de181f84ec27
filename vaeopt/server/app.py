"""The ASGI application (Starlette) and the server object that runs it under uvicorn."""

from __future__ import annotations

import asyncio
import base64
import binascii
import concurrent.futures
import functools
import hmac
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

import vaeopt
from vaeopt.server import worker as worker_mod
from vaeopt.server.listen import bind  # noqa: F401 (the listening socket Server.run takes)
from vaeopt.server.metrics import Metrics
from vaeopt.server.protocol import Limits, ProtocolError, encode, latents_from_body, parse_request, prepare

log = logging.getLogger("vaeopt.server")


@dataclass
class Config:
    models: dict[str, str]  # name ("" for the one model served at /) -> checkpoint path
    devices: list[torch.device]
    options: vaeopt.Options = field(default_factory=vaeopt.Options)
    token: str | None = None
    limits: Limits = field(default_factory=Limits)
    timeout_s: float = 120.0  # per request: body, queue, decode and encoding together
    body_timeout_s: float = 30.0  # to receive the body (a client sending it slowly is cut off)
    max_queue: int = 64  # per worker; beyond it 503 + Retry-After
    max_batch: int = 1  # latents per batched decode of same-shape images (1: no batching)
    jpeg_quality: int = 95
    png_level: int = 1  # zlib level of PNG answers (vaeopt.server.png: lossless at any level)
    encode_threads: int = max(1, min(8, os.cpu_count() or 1))


def _error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": message, "status": status}, status_code=status, headers=headers)


class ClientGone(Exception):
    pass


async def _read_body(receive, expected: int) -> bytearray:
    """The body, refused as soon as it runs past `expected` bytes (a body longer than its shape is not read whole)."""
    body = bytearray()
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise ClientGone
        body += msg.get("body", b"")
        if len(body) > expected:
            raise ProtocolError(400, f"body is longer than its declared shape ({expected} bytes)")
        if not msg.get("more_body", False):
            return body


async def _until_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class DecodeEndpoint:
    """POST / or /NAME: diffusers' remote_decode protocol (vaeopt.server.protocol)."""

    def __init__(self, server: "Server"):
        self.s = server

    async def __call__(self, scope, receive, send) -> None:
        t0 = time.monotonic()
        s = self.s
        model = scope.get("path_params", {}).get("model", "")
        label = model if model in s.cfg.models else "(unknown)"  # metrics' labels: only the names served
        request = Request(scope, receive)
        out_type = request.query_params.get("output_type", "pil")
        if out_type not in ("pil", "pt", "mp4"):
            out_type = "other"
        status, decode_s = 500, None
        try:
            response, decode_s = await self._handle(request, model, receive, t0)
            status = response.status_code
        except ClientGone:
            s.metrics.disconnects += 1
            s.metrics.request(label, out_type, 499)
            return
        except ProtocolError as e:
            response = _error(e.status, e.message, e.headers)
            status = e.status
        except Exception as e:  # noqa: BLE001 — a bug: one request fails, the server stays up
            log.exception("request failed")
            response = _error(500, f"internal error: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}")
        s.metrics.request(label, out_type, status, time.monotonic() - t0 if status < 300 else None, decode_s)
        await response(scope, receive, send)

    async def _handle(self, request: Request, model: str, receive, t0: float):
        s = self.s
        if request.method != "POST":
            return _error(405, "POST the latents here (GET /health, GET /metrics)", {"Allow": "POST"}), None
        if model not in s.cfg.models:
            served = ", ".join(f"/{m}" for m in s.cfg.models)
            raise ProtocolError(404, f"no model named {model!r} here (serving {served})")
        family = s.pool.family(model)
        if family is None:
            raise ProtocolError(503, s.pool.failed or "the models are still loading", {"Retry-After": "5"})
        req = parse_request(list(request.query_params.multi_items()), request.headers.get("accept", ""),
                            request.headers.get("content-type", ""), family, s.cfg.limits)
        cl = request.headers.get("content-length")
        if cl is not None:
            try:
                n = int(cl)
            except ValueError:
                raise ProtocolError(400, f"Content-Length {cl!r} is not a number") from None
            if n != req.body_bytes:
                raise ProtocolError(400, f"body is {n} bytes, but shape {list(req.shape)} "
                                         f"{str(req.dtype).replace('torch.', '')} needs {req.body_bytes}")
        try:
            body = await asyncio.wait_for(_read_body(receive, req.body_bytes), s.cfg.body_timeout_s)
        except asyncio.TimeoutError:
            raise ProtocolError(408, f"the body did not arrive within {s.cfg.body_timeout_s:g} s") from None
        loop = asyncio.get_running_loop()
        z = await loop.run_in_executor(s.cpu, latents_from_body, body, req, family)
        del body
        job = worker_mod.Job(model, z, loop, batchable=not family.is_video, prepare=functools.partial(prepare, req=req))
        s.pool.submit(job)
        gone = asyncio.ensure_future(_until_disconnect(receive))
        left = s.cfg.timeout_s - (time.monotonic() - t0)
        try:
            done, _ = await asyncio.wait({job.future, gone}, timeout=max(0.0, left),
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if job.future not in done:
            job.future.cancel()  # a queued job is skipped; a running one finishes and is dropped
            if gone in done:
                raise ClientGone
            raise ProtocolError(504, f"no answer within the server's {s.cfg.timeout_s:g} s time limit per request "
                                     "(the GPU is busy: retry later, or with a smaller request)",
                                {"Retry-After": "5"})
        answer = job.future.result()  # a worker.Answer; a ProtocolError from the worker propagates
        try:
            reply = await loop.run_in_executor(s.cpu, lambda: encode(answer.wait(), req, s.cfg.jpeg_quality,
                                                                     s.cfg.png_level))
        except Exception as e:
            if not worker_mod.is_oom(e):
                raise
            raise ProtocolError(503, f"out of memory making the answer ({type(e).__name__}): retry later, or with a "
                                     "smaller request", {"Retry-After": "5"}) from None
        headers = dict(reply.headers)
        headers["x-vaeopt-decode-ms"] = f"{job.seconds * 1e3:.1f}"
        if job.batch > 1:
            headers["x-vaeopt-batch"] = str(job.batch)
        if job.retries:
            headers["x-vaeopt-retries"] = "; ".join(job.retries)[:200]
        return Response(reply.body, media_type=reply.media_type, headers=headers), job.seconds


class TokenCheck:
    """Every request carries the token: `Authorization: Bearer TOKEN`, or HTTP Basic with the token as the password
    (what diffusers' remote_decode sends for an endpoint written http://user:TOKEN@host:port/, or from ~/.netrc)."""

    def __init__(self, app, token: Callable[[], str | None]):
        self.app = app
        self.token = token  # read at each request

    @staticmethod
    def _ok(value: bytes, want: bytes) -> bool:
        scheme, _, cred = value.partition(b" ")
        cred = cred.strip()
        if scheme.lower() == b"bearer":
            return hmac.compare_digest(cred, want)
        if scheme.lower() == b"basic":
            try:
                _, _, pw = base64.b64decode(cred, validate=True).partition(b":")
            except (binascii.Error, ValueError):
                return False
            return hmac.compare_digest(pw, want)
        return False

    async def __call__(self, scope, receive, send):
        token = self.token()
        if scope["type"] != "http" or not token:
            return await self.app(scope, receive, send)
        auth = dict(scope.get("headers") or []).get(b"authorization", b"")
        if not self._ok(auth, token.encode()):
            resp = _error(401, "this server needs its token: Authorization: Bearer TOKEN (or http://user:TOKEN@host/ "
                               "as the endpoint)", {"WWW-Authenticate": 'Bearer realm="vaeopt"'})
            return await resp(scope, receive, send)
        return await self.app(scope, receive, send)


class Server:
    """The pool of decode workers, the HTTP application in front of them, and uvicorn running it."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.metrics = Metrics()
        self.cpu = concurrent.futures.ThreadPoolExecutor(cfg.encode_threads, thread_name_prefix="vaeopt-encode")
        self.pool = worker_mod.Pool([worker_mod.Worker(d, cfg.models, cfg.options, cfg.max_queue, cfg.max_batch)
                                     for d in cfg.devices])
        self.uvicorn = None
        self.app = self._build()

    def _build(self):
        ep = DecodeEndpoint(self)
        named = list(self.cfg.models) != [""]
        routes = [Route("/health", self.health, methods=["GET"]), Route("/metrics", self.metrics_page, methods=["GET"])]
        routes.append(Route("/{model}", ep, methods=["POST", "GET"]) if named else Route("/", ep, methods=["POST", "GET"]))
        app = Starlette(routes=routes)
        app.add_exception_handler(404, lambda r, e: _error(404, f"nothing at {r.url.path} (POST latents to "
                                                               + ", ".join(f"/{m}" for m in self.cfg.models) + ")"))
        app.add_exception_handler(405, lambda r, e: _error(405, f"{r.method} {r.url.path}: not allowed"))
        return TokenCheck(app, lambda: self.cfg.token)

    async def health(self, request: Request):
        workers = [{"device": w.label, "state": w.state, "queue": w.depth, **({"error": w.error} if w.error
                                                                                   else {})} for w in self.pool.workers]
        models = {m or "/": {"path": os.path.basename(p)} for m, p in self.cfg.models.items()}
        if self.pool.ready:
            for m in self.cfg.models:
                fam = self.pool.family(m)
                models[m or "/"]["family"] = fam.name
            return JSONResponse({"status": "ready", "models": models, "workers": workers})
        failed = self.pool.failed
        return JSONResponse({"status": "failed" if failed else "loading", "models": models, "workers": workers,
                             **({"error": failed} if failed else {})}, status_code=500 if failed else 503,
                            headers=None if failed else {"Retry-After": "5"})

    async def metrics_page(self, request: Request):
        return PlainTextResponse(self.metrics.render(self.pool), media_type="text/plain; version=0.0.4")

    # ---------------------------------------------------------------------------------------------- running
    def uvicorn_config(self, sock: socket.socket, log_level: str = "info"):
        import uvicorn

        return uvicorn.Config(self.app, log_level=log_level, timeout_keep_alive=5, timeout_graceful_shutdown=5,
                              limit_concurrency=max(64, 4 * self.cfg.max_queue * len(self.cfg.devices)),
                              h11_max_incomplete_event_size=64 * 1024, access_log=log_level == "debug",
                              server_header=False)

    def run(self, sock: socket.socket, log_level: str = "info") -> None:
        """Serve on the bound socket until Ctrl-C / SIGTERM (or a worker fails to load its models)."""
        import uvicorn

        self.pool.start()
        self.uvicorn = uvicorn.Server(self.uvicorn_config(sock, log_level))
        watch = threading.Thread(target=self._watch_loading, daemon=True, name="vaeopt-load-watch")
        watch.start()
        try:
            self.uvicorn.run(sockets=[sock])
        finally:
            self.pool.stop()
            self.cpu.shutdown(wait=False, cancel_futures=True)

    def _watch_loading(self) -> None:
        while not self.pool.ready:
            if self.pool.failed:
                log.error("stopping: %s", self.pool.failed)
                self.uvicorn.should_exit = True
                return
            time.sleep(0.1)

    def start_background(self, sock: socket.socket, log_level: str = "warning") -> threading.Thread:
        """Run in a thread (tests, benchmarks); stop with .shutdown()."""
        t = threading.Thread(target=self.run, args=(sock, log_level), daemon=True, name="vaeopt-server")
        t.start()
        return t

    def shutdown(self) -> None:
        if self.uvicorn is not None:
            self.uvicorn.should_exit = True
