"""`vaeopt serve`: decodes over HTTP for diffusers' remote_decode client."""

from __future__ import annotations

from typing import List, Optional

import typer

from vaeopt.cli.exits import clean_errors


@clean_errors
def serve(
    model: List[str] = typer.Option(..., "--model", "-m", help="VAE checkpoint to serve at http://HOST:PORT/, or "
                                    "NAME=PATH (repeatable) to serve each at /NAME."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on; any but loopback needs a token."),
    port: int = typer.Option(8000, "--port", help="TCP port (0: a free one)."),
    token: Optional[str] = typer.Option(None, "--token", envvar="VAEOPT_TOKEN", show_envvar=True,
                                        help="Require Authorization: Bearer TOKEN on every request (prefer the "
                                             "environment variable: the command line shows in `ps`)."),
    device: Optional[str] = typer.Option(None, "--device", help="One device to serve on (cpu, cuda:1)."),
    gpus: Optional[int] = typer.Option(None, "--gpus", help="One worker on each of the first N GPUs (default: all "
                                                            "visible GPUs, else the CPU)."),
    dtype: str = typer.Option("auto", "--dtype", help="auto | fp32 | bf16 | fp16."),
    queue: int = typer.Option(64, "--queue", help="Requests waiting per worker before 503 + Retry-After."),
    batch: int = typer.Option(4, "--batch", help="Decode up to N queued same-shape image latents as one batch "
                                                  "(1: off; a batch never waits to fill)."),
    timeout: float = typer.Option(120.0, "--timeout", help="Seconds per request (body, queue, decode, encoding)."),
    body_timeout: float = typer.Option(30.0, "--body-timeout", help="Seconds to receive a request's body."),
    max_body_mb: float = typer.Option(256.0, "--max-body-mb", help="Largest latents accepted per request (MiB)."),
    max_megapixels: float = typer.Option(128.0, "--max-megapixels", help="Largest output per request (Mi pixels, "
                                                                        "all frames and images)."),
    jpeg_quality: int = typer.Option(95, "--jpeg-quality", help="Quality of image_format=jpg answers."),
    log_level: str = typer.Option("info", "--log-level", help="debug (one line per request) | info | warning."),
):
    """Serve decodes over HTTP to diffusers' remote_decode client (needs starlette and uvicorn: the 'serve' extra)."""
    from vaeopt.server import serve as run_server

    run_server(model, host=host, port=port, token=token, device=device, gpus=gpus, dtype=dtype, max_queue=queue,
               batch=batch, timeout_s=timeout, body_timeout_s=body_timeout, max_body_mb=max_body_mb,
               max_megapixels=max_megapixels, jpeg_quality=jpeg_quality, log_level=log_level)
