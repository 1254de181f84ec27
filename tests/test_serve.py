"""`vaeopt serve` with diffusers' own remote_decode client, against one server (CPU, the bundled tiny VAEs) for the
whole module; bad input and faults each get a 4xx/5xx JSON answer and the server keeps serving."""

from __future__ import annotations

import base64
import concurrent.futures
import io
import json
import math
import socket
import sys
import threading
import time

import numpy as np
import pytest
import torch

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
requests = pytest.importorskip("requests")

import vaeopt  # noqa: E402
from vaeopt import outputs  # noqa: E402
from vaeopt.server import worker as worker_mod  # noqa: E402
from vaeopt.server.app import Config, Server, bind  # noqa: E402
from vaeopt.server.metrics import host_rss_bytes  # noqa: E402

from diffusers.utils.remote_utils import remote_decode  # noqa: E402

from conftest import ROOT, SAMPLES  # noqa: E402

IMG = SAMPLES / "tiny_kl_image.safetensors"
VID = SAMPLES / "tiny_wan_video.safetensors"
TOKEN = "a-test-token-of-some-length"


@pytest.fixture(scope="module")
def srv():
    cfg = Config({"img": str(IMG), "vid": str(VID)}, [torch.device("cpu")], max_queue=3, body_timeout_s=1.0,
                 timeout_s=60.0)
    s = Server(cfg)
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    thread = s.start_background(sock)
    base = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    while time.monotonic() - t0 < 120:
        try:
            if requests.get(base + "/health", timeout=2).status_code == 200:
                break
        except requests.RequestException:
            pass
        time.sleep(0.1)
    else:
        pytest.fail("the server did not become ready in 120 s")
    s.base = base
    s.port = port
    yield s
    s.shutdown()
    thread.join(10)


@pytest.fixture(scope="module")
def ref():
    """The same checkpoints loaded on their own: what `vaeopt decode` makes of the same latents."""
    return {"img": vaeopt.load_vae(IMG), "vid": vaeopt.load_vae(VID)}


@pytest.fixture(scope="module")
def z_img():
    # a 128x128 crop of the astronaut, as the pipeline hands it out (scaled)
    return torch.load(SAMPLES / "tiny_kl_image_latents.pt", weights_only=True)["astronaut"][:, :, 24:40, 24:40] \
        .contiguous()


@pytest.fixture(scope="module")
def z_vid():
    # 2 latent frames (5 frames out) of 64x64, raw (as the sample is stored)
    return torch.load(SAMPLES / "tiny_wan_video_latents.pt", weights_only=True)["coffee_zoom"][:, :, :2, 12:20, 12:20] \
        .contiguous().float()


def scaling(ref):
    return ref["img"].family.config["scaling_factor"]


def post(srv, path="/img", shape=(1, 4, 8, 8), dtype="float32", body=None, headers=None, **params):
    n = math.prod(shape) * {"float32": 4, "float16": 2, "bfloat16": 2}.get(dtype, 4)
    body = bytes(n) if body is None else body
    q = {"shape": list(shape), "dtype": dtype, "output_type": "pt", **params}
    h = {"Content-Type": "tensor/binary", **(headers or {})}
    return requests.post(srv.base + path, params=q, data=body, headers=h, timeout=30)


def psnr(a, b) -> float:
    mse = float(((a.astype(np.float64) - b.astype(np.float64)) ** 2).mean())
    return float("inf") if mse == 0 else 10 * math.log10(255 ** 2 / mse)


# ---------------------------------------------------------------------------------------------- the client, images
def test_image_png_and_jpeg_equal_the_direct_decode(srv, ref, z_img):
    want = outputs.to_uint8_images(vaeopt.decode(z_img, ref["img"]))[0].numpy()
    png = remote_decode(srv.base + "/img", z_img, scaling_factor=scaling(ref), image_format="png")
    assert png.format == "png" and png.size == (128, 128)
    assert np.array_equal(np.asarray(png), want)  # lossless: the very pixels `vaeopt decode` writes
    jpg = remote_decode(srv.base + "/img", z_img, scaling_factor=scaling(ref), image_format="jpg")
    assert jpg.format == "jpeg" and jpg.size == (128, 128)
    assert psnr(np.asarray(jpg), want) >= 45


def test_image_pt_is_bitwise_in_the_latents_dtype(srv, ref, z_img):
    direct = vaeopt.decode(z_img, ref["img"])  # float32 in [-1, 1]
    z32 = z_img.float()
    pt = remote_decode(srv.base + "/img", z32, scaling_factor=scaling(ref), output_type="pt", return_type="pt")
    assert pt.dtype == torch.float32 and torch.equal(pt, direct)
    z16 = z_img.half()  # what a fp16 pipeline hands out: the answer comes back in float16
    pt16 = remote_decode(srv.base + "/img", z16, scaling_factor=scaling(ref), output_type="pt", return_type="pt")
    assert pt16.dtype == torch.float16 and torch.equal(pt16, vaeopt.decode(z16, ref["img"]).half())
    zb = z_img.bfloat16()
    ptb = remote_decode(srv.base + "/img", zb, scaling_factor=scaling(ref), output_type="pt", return_type="pt")
    assert ptb.dtype == torch.bfloat16 and torch.equal(ptb, vaeopt.decode(zb, ref["img"]).bfloat16())
    u8 = remote_decode(srv.base + "/img", z32, scaling_factor=scaling(ref), output_type="pt", return_type="pt",
                       partial_postprocess=True)
    assert u8.dtype == torch.uint8 and torch.equal(u8, outputs.to_uint8_images(direct))  # (N, H, W, 3)
    img = remote_decode(srv.base + "/img", z32, scaling_factor=scaling(ref), output_type="pt", return_type="pil",
                        partial_postprocess=True)
    assert np.array_equal(np.asarray(img), u8[0].numpy())


def test_image_processor_path_and_raw_latents(srv, ref, z_img):
    from diffusers.image_processor import VaeImageProcessor

    direct = vaeopt.decode(z_img, ref["img"])
    # the client's processor post-processes the [-1, 1] tensor itself
    img = remote_decode(srv.base + "/img", z_img.float(), processor=VaeImageProcessor(), output_type="pt",
                        return_type="pil", scaling_factor=scaling(ref))
    assert psnr(np.asarray(img), outputs.to_uint8_images(direct)[0].numpy()) > 50
    # do_scaling=False, no factors: the latents are sent raw (already divided)
    raw = (z_img.float() / scaling(ref))
    pt = remote_decode(srv.base + "/img", raw, do_scaling=False, output_type="pt", return_type="pt")
    assert torch.equal(pt, vaeopt.decode(raw, ref["img"], latent_space="raw"))


def test_packed_latents_are_unpacked_as_flux_pipeline_does(srv, ref, z_img):
    """(B, H/2*W/2, 4C) with height/width: the same tensor as the (B, C, H, W) latents it packs (4-channel here)."""
    b, c, h, w = z_img.shape
    packed = z_img.float().view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, h * w // 4, c * 4)
    pt = remote_decode(srv.base + "/img", packed, scaling_factor=scaling(ref), output_type="pt", return_type="pt",
                       height=h * 8, width=w * 8)
    assert torch.equal(pt, vaeopt.decode(z_img.float(), ref["img"]))
    r = post(srv, shape=(1, h * w // 4, c * 4))  # packed without the image size: refused, said why
    assert r.status_code == 422 and "height and width" in r.json()["error"]


# ---------------------------------------------------------------------------------------------- the client, video
def test_video_mp4_and_pt(srv, ref, z_vid):
    import av

    mp4 = remote_decode(srv.base + "/vid", z_vid, do_scaling=False, output_type="mp4", return_type="mp4")
    assert isinstance(mp4, bytes)
    with av.open(io.BytesIO(mp4)) as c:
        frames = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    assert len(frames) == 5 and frames[0].shape == (64, 64, 3)
    direct = vaeopt.decode(z_vid, ref["vid"], latent_space="raw")
    want = outputs.to_uint8_images(direct)[0].numpy()  # (T, H, W, 3)
    assert psnr(np.stack(frames), want) > 30  # H.264 at crf 18
    pt = remote_decode(srv.base + "/vid", z_vid, do_scaling=False, output_type="pt", return_type="pt")
    assert pt.shape == (1, 3, 5, 64, 64) and torch.equal(pt, direct)
    u8 = remote_decode(srv.base + "/vid", z_vid, do_scaling=False, output_type="pt", return_type="pt",
                       partial_postprocess=True)
    assert torch.equal(u8, outputs.to_uint8_images(direct)[0])  # one clip: its (T, H, W, 3) frames


@pytest.mark.filterwarnings("ignore:`do_scaling` is deprecated:FutureWarning")  # the client's own, on its default
def test_video_pipeline_latents_and_processor(srv, ref, z_vid):
    """remote_decode's defaults (do_scaling, no factor): the model's own scaling, Wan's per-channel mean/std; with a
    VideoProcessor, output_type=pil comes back as [0, 1] frames that the client turns into PIL images."""
    from diffusers.video_processor import VideoProcessor

    scaled = ref["vid"].family.scale(z_vid)  # as WanPipeline(output_type="latent") hands them out
    pt = remote_decode(srv.base + "/vid", scaled, output_type="pt", return_type="pt")
    direct = vaeopt.decode(scaled, ref["vid"], latent_space="scaled")
    assert torch.equal(pt, direct)
    frames = remote_decode(srv.base + "/vid", scaled, processor=VideoProcessor(), output_type="pil",
                           return_type="pil")
    assert len(frames) == 5 and frames[0].size == (64, 64)
    want = outputs.to_uint8_images(direct)[0].numpy()
    assert psnr(np.stack([np.asarray(f) for f in frames]), want) > 50


# ---------------------------------------------------------------------------------------------- bad input
def test_bad_input_gets_clear_json_errors_and_memory_stays(srv):
    cases = [
        (dict(dtype="int8"), 422, "dtype"),
        (dict(shape=(1, 16, 8, 8)), 422, "channels"),
        (dict(body=bytes(100)), 400, "body is 100 bytes"),
        (dict(body=bytes(4 * 4 * 8 * 8 + 4)), 400, "needs 1024"),
        (dict(body=torch.full((1, 4, 8, 8), float("nan")).numpy().tobytes()), 422, "non-finite"),
        (dict(body=torch.full((1, 4, 8, 8), float("inf")).numpy().tobytes()), 422, "non-finite"),
        (dict(shape=(1, 4, 1000000, 1000000), body=b"x"), 413, "more than this server takes"),
        (dict(shape=(1, 4, 10**12, 8), body=b"x"), 422, "between 1 and"),
        (dict(shape=(64, 4, 4096, 4096), body=b"x"), 413, "MiB of latents"),
        (dict(output_type="mp4"), 422, "image VAE"),
        (dict(output_type="pil", headers={"Accept": "image/png"}, shape=(2, 4, 8, 8)), 422, "one image"),
        (dict(headers={"Content-Type": "image/png"}), 415, "tensor/binary"),
        (dict(path="/nope"), 404, "no model named 'nope'"),
        (dict(scaling_factor=0), 422, "scaling_factor=0"),
        (dict(evil="../../etc/passwd"), 400, "unknown query parameter"),
    ]
    rss = []
    for rnd in range(3):
        for kw, status, words in cases:
            t0 = time.monotonic()
            r = post(srv, **kw)
            assert r.status_code == status, (kw, r.text)
            assert words in r.json()["error"], (kw, r.json())
            assert time.monotonic() - t0 < 5  # refused before allocating or decoding anything large
        rss.append(host_rss_bytes())
    assert rss[-1] - rss[0] < 32 * 2**20  # no growth from round to round
    ok = post(srv, body=torch.zeros(1, 4, 8, 8).numpy().tobytes())
    assert ok.status_code == 200 and json.loads(ok.headers["shape"]) == [1, 3, 64, 64]


def test_slow_body_and_disconnect(srv):
    head = ("POST /img?shape=1&shape=4&shape=8&shape=8&dtype=float32&output_type=pt HTTP/1.1\r\n"
            "Host: 127.0.0.1\r\nContent-Type: tensor/binary\r\nContent-Length: 1024\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:  # half the body, then nothing
        s.sendall(head + bytes(512))
        reply = b""
        while b"}" not in reply:  # (headers and the JSON body may come in two packets)
            more = s.recv(4096)
            if not more:
                break
            reply += more
        reply = reply.decode(errors="replace")
    assert reply.startswith("HTTP/1.1 408") and "did not arrive within" in reply
    before = srv.metrics.disconnects
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)  # gone mid-body
    s.sendall(head + bytes(100))
    s.close()
    t0 = time.monotonic()
    while srv.metrics.disconnects == before and time.monotonic() - t0 < 5:
        time.sleep(0.05)
    assert srv.metrics.disconnects == before + 1
    assert requests.get(srv.base + "/health", timeout=5).status_code == 200


class Gate:
    """A decode stand-in that waits for a signal (bounded) before the real decode: holds the worker busy."""

    def __init__(self, real):
        self.real = real
        self.open = threading.Event()
        self.calls = 0
        self.shapes = []

    def __call__(self, z, loaded, **kw):
        self.calls += 1
        self.shapes.append(tuple(z.shape))
        self.open.wait(10)
        return self.real(z, loaded, **kw)


def _wait_depth(srv, n, limit=5.0):
    t0 = time.monotonic()
    while srv.pool.workers[0].depth < n and time.monotonic() - t0 < limit:
        time.sleep(0.02)
    assert srv.pool.workers[0].depth >= n


def test_full_queue_answers_503_with_retry_after(srv, monkeypatch):
    gate = Gate(worker_mod.decode)
    monkeypatch.setattr(worker_mod, "decode", gate)
    body = [torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(i)).numpy().tobytes() for i in range(4)]
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        futs = []
        for i in range(4):  # one decoding, three queued (the queue holds 3)
            futs.append(ex.submit(post, srv, body=body[i]))
            _wait_depth(srv, i + 1)
        r = post(srv, body=body[0])
        assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1
        assert "queue is full" in r.json()["error"]
        gate.open.set()
        answers = [f.result() for f in futs]
    assert [a.status_code for a in answers] == [200] * 4
    for i, a in enumerate(answers):  # each its own latents' decode
        want = vaeopt.decode(torch.frombuffer(bytearray(body[i]), dtype=torch.float32).view(1, 4, 8, 8),
                             srv.pool.workers[0].models["img"], latent_space="raw")
        assert torch.equal(torch.frombuffer(bytearray(a.content), dtype=torch.float32).view(1, 3, 64, 64), want)


def test_batching_same_shape_images(srv, monkeypatch):
    gate = Gate(worker_mod.decode)
    monkeypatch.setattr(worker_mod, "decode", gate)
    monkeypatch.setattr(srv.pool.workers[0], "max_batch", 3)
    zs = [torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(10 + i)) for i in range(4)]
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        futs = []
        for i in range(4):
            futs.append(ex.submit(post, srv, body=zs[i].numpy().tobytes()))
            _wait_depth(srv, i + 1)
        gate.open.set()
        answers = [f.result() for f in futs]
    assert gate.shapes == [(1, 4, 8, 8), (3, 4, 8, 8)]  # the first alone, the three queued behind it together
    assert [a.headers.get("x-vaeopt-batch") for a in answers[1:]] == ["3"] * 3
    model = srv.pool.workers[0].models["img"]
    for z, a in zip(zs, answers):
        got = torch.frombuffer(bytearray(a.content), dtype=torch.float32).view(1, 3, 64, 64)
        want = vaeopt.decode(z, model, latent_space="raw")
        assert (got - want).abs().max() < 1e-4  # its own image (a batched conv may round differently)


def test_a_batch_of_real_client_requests_each_gets_its_own_answer(srv, ref, monkeypatch):
    """diffusers' remote_decode from several threads at once, different latents and answer kinds (PNG, JPEG, float32
    and float16 pt, uint8 pt) of one shape: queued behind a held decode, they are decoded as one batch; each answer
    is its own latents' image (closest to its own expected output, far from the others')."""
    gate = Gate(worker_mod.decode)
    monkeypatch.setattr(worker_mod, "decode", gate)
    monkeypatch.setattr(srv.pool.workers[0], "max_batch", 8)
    monkeypatch.setattr(srv.pool.workers[0], "max_queue", 8)
    sf = scaling(ref)
    zs = [torch.randn(1, 4, 12, 12, generator=torch.Generator().manual_seed(50 + i)) * 4 for i in range(6)]
    kinds = [dict(image_format="png"), dict(image_format="jpg"), dict(output_type="pt", return_type="pt"),
             dict(output_type="pt", return_type="pt", dtype16=True),
             dict(output_type="pt", return_type="pt", partial_postprocess=True), dict(image_format="png")]

    def call(i):
        kw = dict(kinds[i])
        z = zs[i].half() if kw.pop("dtype16", False) else zs[i]
        return remote_decode(srv.base + "/img", z, scaling_factor=sf, **kw)

    with concurrent.futures.ThreadPoolExecutor(6) as ex:
        futs = []
        for i in range(6):  # the first decodes (held), the other five queue behind it
            futs.append(ex.submit(call, i))
            _wait_depth(srv, i + 1)
        gate.open.set()
        answers = [f.result() for f in futs]
    assert gate.shapes == [(1, 4, 12, 12), (5, 4, 12, 12)]
    want = [outputs.to_uint8_images(vaeopt.decode(z, ref["img"]))[0].numpy().astype(np.int16) for z in zs]

    def as_u8(a):
        if isinstance(a, torch.Tensor):
            return (a[0] if a.dtype == torch.uint8 else outputs.to_uint8_images(a.float())[0]).numpy()
        return np.asarray(a)

    for i, a in enumerate(answers):
        got = as_u8(a).astype(np.int16)
        assert got.shape == (96, 96, 3)
        err = [np.abs(got - w).mean() for w in want]
        assert int(np.argmin(err)) == i, (i, err)  # its own, not a neighbour's
        if kinds[i].get("image_format") != "jpg":
            assert np.abs(got - want[i]).max() <= 2  # a batched conv may round differently (here: bitwise or 1)
        else:
            assert psnr(got, want[i]) >= 40


def test_uint8_answers_equal_diffusers_postprocessing():
    """The server's (and `vaeopt decode`'s) uint8 images are diffusers' VaeImageProcessor.postprocess(..., "pil")
    bytes, over the whole [-1, 1] range, the values that land exactly between two levels included."""
    from diffusers.image_processor import VaeImageProcessor

    from vaeopt.server.protocol import DecodeRequest, prepare

    k = torch.arange(256, dtype=torch.float64)
    halves = ((k + 0.5) / 127.5 - 1).float()  # ties: round half to even on both sides
    near = torch.cat([halves, torch.nextafter(halves, torch.tensor(2.0)), torch.nextafter(halves, torch.tensor(-2.0))])
    x = torch.cat([torch.linspace(-1, 1, 3 * 256 * 256 - near.numel()), near]).clamp(-1, 1).view(1, 3, 256, 256)
    theirs = np.asarray(VaeImageProcessor().postprocess(x, output_type="pil")[0])
    assert np.array_equal(outputs.to_uint8_images(x)[0].numpy(), theirs)
    req = DecodeRequest((1, 4, 32, 32), torch.float32, "pil", "png", False, False, None, None, False, None, None, 16)
    assert np.array_equal(prepare(x, req)[0].numpy(), theirs)


def test_out_of_memory_is_retried_then_answered_503(srv, monkeypatch):
    real = worker_mod.decode
    calls = []

    def oom_once(z, loaded, **kw):
        calls.append(kw["options"].tiling)
        if len(calls) == 1:
            torch.ones(1024)  # (the failed attempt's tensors go with its frame)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return real(z, loaded, **kw)

    monkeypatch.setattr(worker_mod, "decode", oom_once)
    r = post(srv, body=torch.zeros(1, 4, 8, 8).numpy().tobytes())
    assert r.status_code == 200 and "retried tiled" in r.headers["x-vaeopt-retries"]
    assert calls == ["auto", "on"]

    def oom_always(z, loaded, **kw):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(worker_mod, "decode", oom_always)
    r = post(srv)
    assert r.status_code == 503 and "out of memory" in r.json()["error"] and int(r.headers["Retry-After"]) >= 1

    def crash(z, loaded, **kw):
        raise ValueError("something broke")

    monkeypatch.setattr(worker_mod, "decode", crash)
    r = post(srv)
    assert r.status_code == 500 and "something broke" in r.json()["error"]
    monkeypatch.setattr(worker_mod, "decode", real)
    assert post(srv).status_code == 200  # and it goes on serving


def test_out_of_memory_making_the_answer_is_503(srv, monkeypatch):
    """The answer tensor (uint8, half) is made after the decode (on a CPU server, on the encode threads): running out
    of memory there is a 503 too, and the server goes on."""
    from vaeopt.server import app as app_mod

    def oom(decoded, req):
        raise MemoryError("cannot allocate the answer")

    monkeypatch.setattr(app_mod, "prepare", oom)
    r = post(srv)
    assert r.status_code == 503 and "out of memory making the answer" in r.json()["error"] and "Retry-After" in r.headers
    monkeypatch.undo()
    assert post(srv).status_code == 200


def test_per_request_time_limit(srv, monkeypatch):
    gate = Gate(worker_mod.decode)
    monkeypatch.setattr(worker_mod, "decode", gate)
    monkeypatch.setattr(srv.cfg, "timeout_s", 0.5)
    r = post(srv)
    gate.open.set()
    assert r.status_code == 504 and "time limit" in r.json()["error"]
    monkeypatch.setattr(srv.cfg, "timeout_s", 60.0)
    assert post(srv).status_code == 200


# ---------------------------------------------------------------------------------------------- security, pages
def test_token_is_checked_on_every_request(srv, ref, z_img, monkeypatch):
    monkeypatch.setattr(srv.cfg, "token", TOKEN)
    for path in ("/health", "/metrics"):
        r = requests.get(srv.base + path, timeout=5)
        assert r.status_code == 401 and "token" in r.json()["error"]
    assert post(srv, headers={"Authorization": "Bearer wrong-token-of-some-length"}).status_code == 401
    assert post(srv, headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
    basic = base64.b64encode(f"x:{TOKEN}".encode()).decode()
    assert post(srv, headers={"Authorization": f"Basic {basic}"}).status_code == 200
    with pytest.raises(RuntimeError, match="token"):
        remote_decode(srv.base + "/img", z_img, scaling_factor=scaling(ref), output_type="pt", return_type="pt")
    # diffusers' client takes no headers: the token goes in the endpoint's user-info (requests sends it as Basic)
    pt = remote_decode(f"http://vaeopt:{TOKEN}@127.0.0.1:{srv.port}/img", z_img, scaling_factor=scaling(ref),
                       output_type="pt", return_type="pt")
    assert pt.shape == (1, 3, 128, 128)


def test_health_and_metrics(srv):
    h = requests.get(srv.base + "/health", timeout=5).json()
    assert h["status"] == "ready" and h["models"]["img"]["family"] == "sd15" and h["models"]["vid"]["family"] == "wan21"
    assert h["workers"] == [{"device": "cpu", "state": "ready", "queue": 0}]
    assert post(srv, path="/vid", shape=(1, 4, 8, 8)).status_code == 422  # counted under its status
    assert post(srv, path="/nope").status_code == 404
    assert post(srv).status_code == 200
    text = requests.get(srv.base + "/metrics", timeout=5).text
    samples = {}
    for line in text.splitlines():
        if not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    assert samples['vaeopt_requests_total{model="vid",output_type="pt",status="422"}'] >= 1
    assert samples['vaeopt_requests_total{model="(unknown)",output_type="pt",status="404"}'] >= 1  # not "nope"
    assert not any("nope" in k for k in samples)
    assert samples['vaeopt_requests_total{model="img",output_type="pt",status="200"}'] >= 1
    assert samples['vaeopt_queue_depth{device="cpu"}'] == 0
    assert samples['vaeopt_request_seconds_bucket{model="img",le="+Inf"}'] == \
        samples['vaeopt_request_seconds_count{model="img"}'] > 0
    assert samples["vaeopt_host_rss_bytes"] > 0


def test_routes_of_one_unnamed_model():
    """One model is served at /, health answers 503 until it is loaded (not started here)."""
    from starlette.testclient import TestClient

    s = Server(Config({"": str(IMG)}, [torch.device("cpu")], token=TOKEN))
    with TestClient(s.app) as c:
        auth = {"Authorization": f"Bearer {TOKEN}"}
        assert c.get("/health").status_code == 401
        r = c.get("/health", headers=auth)
        assert r.status_code == 503 and r.json()["status"] == "loading" and r.headers["Retry-After"] == "5"
        r = c.post("/", headers=auth, params={"shape": [1, 4, 8, 8]}, content=bytes(1024))
        assert r.status_code == 503 and "loading" in r.json()["error"]
        r = c.post("/img", headers=auth, content=b"")
        assert r.status_code == 404 and "POST latents to /" in r.json()["error"]


def test_cli_refuses_open_host_without_token_and_bad_models(tmp_path):
    from typer.testing import CliRunner

    from vaeopt.cli import app

    run = lambda *a, **kw: CliRunner().invoke(app, ["serve", *map(str, a)], **kw)  # noqa: E731
    r = run("--model", IMG, "--host", "0.0.0.0", env={"VAEOPT_TOKEN": ""})
    assert r.exit_code == 2 and "token" in r.output
    r = run("--model", tmp_path / "missing.safetensors")
    assert r.exit_code == 2 and "checkpoint not found" in r.output
    r = run("--model", f"a={IMG}", "--model", IMG)
    assert r.exit_code == 2 and "need names" in r.output
    r = run("--model", f"health={IMG}")
    assert r.exit_code == 2 and "/health" in r.output
    r = run("--model", IMG, "--host", "0.0.0.0", "--token", "short")
    assert r.exit_code == 2 and "16 characters" in r.output
    for spec, said in (("~nosuchuser_vaeopt/v.safetensors", "--model ~nosuchuser_vaeopt/v.safetensors: '"),
                       ("a=~nosuchuser_vaeopt/v.safetensors", "--model a: ~nosuchuser_vaeopt/v.safetensors: '")):
        r = run("--model", spec)  # one line, exit 2 (it was an internal error)
        assert r.exit_code == 2 and said + "~nosuchuser_vaeopt' names no user" in r.output, r.output


def test_load_script_against_the_server(srv, tmp_path, monkeypatch, capsys):
    """benchmarks/serve_load.py, 4 clients x 20 requests (run in this process: no second torch import)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("serve_load", ROOT / "benchmarks" / "serve_load.py")
    load_mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(load_mod)
    out = tmp_path / "load.json"
    monkeypatch.setattr(sys, "argv", ["serve_load.py", "--url", srv.base + "/img", "--model", str(IMG), "--shapes",
                                      "8x8,6x10", "--clients", "4", "--requests", "20", "--single", "3", "--direct", "2", "--out",
                                      str(out)])
    load_mod.main()  # (exits non-zero where a request failed or did not match)
    res = json.loads(out.read_text())
    load = res["load"]
    assert load["requests"] == load["answered"] == load["ok"] == 20
    assert load["lost"] == load["duplicated"] == load["mismatched"] == 0
    assert load["latency"]["p50_ms"] <= load["latency"]["p99_ms"] and load["throughput_rps"] > 0
    assert set(load["by_kind"]) <= {"png", "jpg", "pt", "pt-uint8"} and len(load["by_kind"]) >= 3
    assert res["single_client"]["ok"] == 3 and res["single_client"]["overhead_p50_ms"] is not None
    assert res["direct"]["shape"] == "8x8" and res["direct"]["png"]["n"] == 2
    assert res["direct"]["uint8_on_device_equals_host"] is True
    assert [v["load"] for v in res["variants"]] == [load]
    assert capsys.readouterr().out.splitlines()[-1].split()[:2] == ["server", "20/20"]  # the table's row, last


def test_pool_sends_each_job_to_the_shortest_queue():
    """Dispatch over several workers (no threads started: the queues only fill)."""
    import asyncio

    from vaeopt.server.protocol import ProtocolError

    ws = [worker_mod.Worker(torch.device("cpu"), {"img": str(IMG)}, vaeopt.Options(), max_queue=2) for _ in range(3)]
    pool = worker_mod.Pool(ws)
    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(ProtocolError, match="still loading"):
            pool.submit(worker_mod.Job("img", torch.zeros(1, 4, 8, 8), loop, True))
        for w in ws:
            w.state = "ready"
        for _ in range(6):
            pool.submit(worker_mod.Job("img", torch.zeros(1, 4, 8, 8), loop, True))
        assert [w.depth for w in ws] == [2, 2, 2]  # spread, not piled on the first
        with pytest.raises(ProtocolError, match="queue is full") as e:
            pool.submit(worker_mod.Job("img", torch.zeros(1, 4, 8, 8), loop, True))
        assert e.value.status == 503 and int(e.value.headers["Retry-After"]) >= 1
    finally:
        loop.close()


def test_stage_lines_suggest_nothing_the_server_cannot_take(caplog):
    """A worker's model load logs the stage lines of its warm-up decode; a setting they suggest is named by the flags
    of `vaeopt decode` (or serve's own --dtype), never as vaeopt.Options(...), which a `vaeopt serve` user cannot
    pass."""
    w = worker_mod.Worker(torch.device("cpu"), {"img": str(IMG)}, vaeopt.Options(), max_queue=2)
    with caplog.at_level("INFO", logger="vaeopt.server"):
        w.load()
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == f"model img: loading {IMG} on cpu" and lines[-1].startswith("model img: "), lines
    fp8 = [m for m in lines if "fp8: skipped" in m]
    assert fp8 and "enable with `vaeopt decode --fp8 on` (vaeopt serve decodes with the defaults);" in fp8[0], fp8
    assert not any("Options(" in m for m in lines), lines
    assert worker_mod.spell_serve((vaeopt.stages.Hint("dtype", "fp32"),)) == "--dtype fp32"


@pytest.mark.parametrize("shape", [(1, 1, 3), (3, 5, 3), (257, 129, 3), (700, 600, 3), (64, 64), (33, 17, 4)])
def test_png_encoder_is_lossless(shape):
    """The server's PNG writer (Up filter, deflate in bands on threads): any reader gets the exact pixels back;
    700x600 RGB is several bands ("non-aligned": the last band is short)."""
    from PIL import Image

    from vaeopt.server import png

    a = np.random.default_rng(0).integers(0, 256, shape, dtype=np.uint8)
    a[: shape[0] // 2] = 7  # a smooth half (runs) and a noisy half
    data = png.encode(a)
    Image.open(io.BytesIO(data)).verify()  # chunk CRCs
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(data))).reshape(a.shape), a)


def test_cli_argument_mistakes_before_torch_loads(tmp_path):
    """serve's argument mistakes (a bad --dtype, --device, --log-level, port, missing model) are one line and exit
    2, said before torch loads and before the server binds; a bad --log-level used to end in an internal KeyError
    after the server had started."""
    import os
    import subprocess

    code = ("import sys\nfrom vaeopt.cli import app\n"
            "try:\n    app(sys.argv[1:])\nexcept SystemExit as e:\n    code = e.code\n"
            "print('torch loaded' if 'torch' in sys.modules else 'torch not loaded', code)\n")
    for args, msg in ((["--dtype", "fp64"], "unknown dtype 'fp64' (auto, fp32, bf16, fp16)"),
                      (["--device", "tpu"], "--device tpu: expected cpu, cuda or cuda:N"),
                      (["--log-level", "bogus"], "--log-level bogus: one of debug, info, warning"),
                      (["--port", "-1"], "--port -1: between 0 and 65535"),
                      (["--gpus", "0"], "--gpus 0: must be at least 1"),
                      (["--device", "cpu", "--gpus", "1"], "--device and --gpus: give one")):
        p = subprocess.run([sys.executable, "-c", code, "serve", "--model", str(IMG), "--port", "0", *args],
                           capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
        assert "torch not loaded 2" in p.stdout and msg in p.stderr, (args, p.stdout, p.stderr)
    p = subprocess.run([sys.executable, "-c", code, "serve", "--model", str(tmp_path / "gone.safetensors")],
                       capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
    assert "torch not loaded 2" in p.stdout and "checkpoint not found" in p.stderr, (p.stdout, p.stderr)


def test_cli_address_mistakes_before_torch_loads():
    """A --host that is no address here, or a --port another server holds, is an argument mistake too: said before
    torch loads (at once), not after seconds of imports."""
    import os
    import subprocess

    code = ("import sys\nfrom vaeopt.cli import app\n"
            "try:\n    app(sys.argv[1:])\nexcept SystemExit as e:\n    code = e.code\n"
            "print('torch loaded' if 'torch' in sys.modules else 'torch not loaded', code)\n")
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        for args, msg in ((["--host", "0.0.0.0.0", "--port", "0"], "--host 0.0.0.0.0: not an address here"),
                          (["--port", str(taken.getsockname()[1])], "(another server is there: pick another --port)")):
            p = subprocess.run([sys.executable, "-c", code, "serve", "--model", str(IMG), *args], capture_output=True,
                               text=True, timeout=60, env={**os.environ, "COLUMNS": "200", "VAEOPT_TOKEN": TOKEN})
            assert "torch not loaded 2" in p.stdout and msg in p.stderr, (args, p.stdout, p.stderr)
    finally:
        taken.close()
