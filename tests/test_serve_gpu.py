"""`vaeopt serve` on GPUs: one worker per GPU (the shortest queue gets each request), and GPU memory back to its
baseline after good requests, bad ones and out-of-memory faults."""

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

pytestmark = pytest.mark.gpu
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


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_one_worker_per_gpu_shares_the_load():
    s = start([torch.device("cuda", 0), torch.device("cuda", 1)], max_queue=64)
    try:
        zs = [torch.randn(1, 4, 64, 64, generator=torch.Generator().manual_seed(i)) for i in range(32)]
        with concurrent.futures.ThreadPoolExecutor(8) as ex:
            answers = list(ex.map(lambda z: post(s, z), zs))
        assert [a.status_code for a in answers] == [200] * 32
        done = [w.done for w in s.pool.workers]
        assert all(d >= 4 for d in done), done  # both GPUs decoded a share
        ref = s.pool.workers[0].models["img"]
        for z, a in zip(zs, answers):  # each its own image, whichever GPU decoded it
            want = vaeopt.decode(z, ref, latent_space="raw", options=s.pool.workers[0].options)
            assert (as_tensor(a) - want).abs().max() < 2e-2
        text = requests.get(s.base + "/metrics", timeout=5).text
        for d in ("cuda:0", "cuda:1"):
            assert f'vaeopt_gpu_memory_allocated_bytes{{device="{d}"}}' in text
            assert f'vaeopt_worker_ready{{device="{d}"}} 1' in text
    finally:
        s.shutdown()
        s.thread.join(10)


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
