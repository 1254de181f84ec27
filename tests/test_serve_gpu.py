"""`vaeopt serve` on GPUs: one worker per GPU (the shortest queue gets each request; also run with two workers on
the CPU, which the server numbers as two devices), answers computed on the GPU equal the direct decode's bytes, and
GPU memory back to its baseline after good requests, bad ones and out-of-memory faults."""

from __future__ import annotations

import concurrent.futures
import time

import pytest
import torch

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
requests = pytest.importorskip("requests")

import vaeopt  # noqa: E402
from vaeopt.server import worker as worker_mod  # noqa: E402
from vaeopt.server.app import Config, Server, bind  # noqa: E402

from conftest import SAMPLES  # noqa: E402

IMG = SAMPLES / "tiny_kl_image.safetensors"


def start(devices, **kw):
    s = Server(Config({"img": str(IMG)}, devices, **kw))
    sock = bind("127.0.0.1", 0)
    s.base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    s.thread = s.start_background(sock)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 300:
        try:
            if requests.get(s.base + "/health", timeout=2).status_code == 200:
                return s
        except requests.RequestException:
            pass
        time.sleep(0.2)
    s.shutdown()
    pytest.fail("the server did not become ready in 300 s")


def post(s, z: torch.Tensor, **params):
    return requests.post(s.base + "/img", params={"shape": list(z.shape), "dtype": "float32", "output_type": "pt",
                                                  **params},
                         data=z.numpy().tobytes(), headers={"Content-Type": "tensor/binary"}, timeout=120)


def as_tensor(r):
    import json

    return torch.frombuffer(bytearray(r.content), dtype=torch.float32).view(json.loads(r.headers["shape"]))


@pytest.mark.parametrize("devices,tol", [
    pytest.param(("cpu", "cpu"), 0.0, id="two-workers-on-cpu"),  # the same code path, two labels on one device
    pytest.param(("cuda:0", "cuda:1"), 2e-2, id="two-gpus", marks=[
        pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]),
])
def test_one_worker_per_gpu_shares_the_load(devices, tol):
    s = start([torch.device(d) for d in devices], max_queue=64)
    labels = [w.label for w in s.pool.workers]
    try:
        side = 64 if devices[0].startswith("cuda") else 8
        zs = [torch.randn(1, 4, side, side, generator=torch.Generator().manual_seed(i)) for i in range(32)]
        with concurrent.futures.ThreadPoolExecutor(8) as ex:
            answers = list(ex.map(lambda z: post(s, z), zs))
        assert [a.status_code for a in answers] == [200] * 32
        done = [w.done for w in s.pool.workers]
        assert all(d >= 4 for d in done), done  # both GPUs decoded a share
        ref = s.pool.workers[0].models["img"]
        for z, a in zip(zs, answers):  # each its own image, whichever GPU decoded it
            want = vaeopt.decode(z, ref, latent_space="raw", options=s.pool.workers[0].options)
            assert (as_tensor(a) - want).abs().max() <= tol
        text = requests.get(s.base + "/metrics", timeout=5).text
        assert len(set(labels)) == 2
        for d in labels:
            assert f'vaeopt_worker_ready{{device="{d}"}} 1' in text
            if d.startswith("cuda"):
                assert f'vaeopt_gpu_memory_allocated_bytes{{device="{d}"}}' in text
        health = requests.get(s.base + "/health", timeout=5).json()
        assert [w["device"] for w in health["workers"]] == labels
    finally:
        s.shutdown()
        s.thread.join(10)


@pytest.mark.gpu
def test_answers_made_on_the_gpu_equal_the_direct_decode():
    """uint8 and half answers are computed on the GPU and copied to pinned memory: the same bytes as
    `vaeopt decode` (the float32 output on the host, converted there), for every kind of answer."""
    import io

    import numpy as np
    from PIL import Image

    from vaeopt import outputs

    s = start([torch.device("cuda", 0)], max_queue=8)
    try:
        w = s.pool.workers[0]
        for i, shape in enumerate(((1, 4, 64, 64), (1, 4, 40, 72))):
            z = torch.randn(shape, generator=torch.Generator().manual_seed(i)) * 3  # some values beyond [-1, 1]
            direct = vaeopt.decode(z, w.models["img"], latent_space="raw", options=w.options)
            pt = post(s, z)
            assert torch.equal(as_tensor(pt), direct)
            half = requests.post(s.base + "/img", params={"shape": list(shape), "dtype": "float16",
                                                          "output_type": "pt"}, data=z.half().numpy().tobytes(),
                                 headers={"Content-Type": "tensor/binary"}, timeout=60)
            want16 = vaeopt.decode(z.half(), w.models["img"], latent_space="raw", options=w.options).half()
            got16 = torch.frombuffer(bytearray(half.content), dtype=torch.float16).view(want16.shape)
            assert torch.equal(got16, want16)
            u8 = post(s, z, partial_postprocess=True)
            want = outputs.to_uint8_images(direct)
            got = torch.frombuffer(bytearray(u8.content), dtype=torch.uint8).view(want.shape)
            assert torch.equal(got, want)
            png = requests.post(s.base + "/img", params={"shape": list(shape), "dtype": "float32",
                                                         "output_type": "pil", "image_format": "png"},
                                data=z.numpy().tobytes(), headers={"Content-Type": "tensor/binary",
                                                                   "Accept": "image/png"}, timeout=60)
            assert np.array_equal(np.asarray(Image.open(io.BytesIO(png.content))), want[0].numpy())
    finally:
        s.shutdown()
        s.thread.join(10)


@pytest.mark.gpu
def test_gpu_memory_returns_to_baseline(monkeypatch):
    s = start([torch.device("cuda", 0)], max_queue=8)
    try:
        dev = torch.device("cuda", 0)
        z = torch.randn(1, 4, 128, 128)
        assert post(s, z).status_code == 200  # the shape's first decode (cuDNN picks its algorithms)
        torch.cuda.synchronize(dev)
        base = torch.cuda.memory_allocated(dev)
        for shape in ((1, 4, 128, 128), (2, 4, 96, 64), (1, 4, 256, 256)):
            assert post(s, torch.randn(shape)).status_code == 200
        bad = [post(s, torch.full((1, 4, 64, 64), float("nan"))),
               requests.post(s.base + "/img", params={"shape": [1, 4, 100000, 100000]}, data=b"x",
                             headers={"Content-Type": "tensor/binary"}, timeout=10)]
        assert [b.status_code for b in bad] == [422, 413]
        real = worker_mod.decode

        def oom(zz, loaded, **kw):  # a real allocation on the GPU, then the error
            junk = torch.empty(512 * 2**20, dtype=torch.uint8, device=dev)  # noqa: F841
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

        monkeypatch.setattr(worker_mod, "decode", oom)
        r = post(s, z)
        assert r.status_code == 503 and "out of memory" in r.json()["error"]
        monkeypatch.setattr(worker_mod, "decode", real)
        assert post(s, z).status_code == 200
        torch.cuda.synchronize(dev)
        after = torch.cuda.memory_allocated(dev)
        assert after - base <= 16 * 2**20, (base, after)  # nothing a request made is kept
    finally:
        s.shutdown()
        s.thread.join(10)
