"""The plain diffusers script a one-shot `vaeopt decode` is timed against: from_pretrained of a model folder, one
decode, then a PNG (PIL) or an MP4 (PyAV: libx264, crf 18, as vaeopt writes clips). Nothing of vaeopt is imported,
as in a user's own script. bf16 on a GPU, fp32 on a CPU.

    python benchmarks/plain_decode.py MODEL_DIR LATENTS.pt OUT DEVICE [TILED]    # TILED 1: vae.enable_tiling()

Prints {"decode_s", "in_process_s"} last. With $PHASES_T0 and $PHASES_OUT set (scripts/one_shot_phases.py), the
seconds since PHASES_T0 at the end of each of that script's phases go to PHASES_OUT at exit.
"""

import time

T0 = time.perf_counter()

import atexit  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

MARKS: list = []


def mark(*names: str) -> None:
    if "PHASES_T0" in os.environ:
        MARKS.extend((n, time.time() - float(os.environ["PHASES_T0"])) for n in names)


if "PHASES_OUT" in os.environ:
    atexit.register(lambda: (mark("atexit"), open(os.environ["PHASES_OUT"], "w").write(json.dumps({"marks": MARKS}))))
mark("python", "cli")
import diffusers  # noqa: E402
import torch  # noqa: E402

mark("torch", "read")
folder, lat, out, device = sys.argv[1:5]
cuda = device.startswith("cuda")
dtype = torch.bfloat16 if cuda else torch.float32
cls = getattr(diffusers, json.load(open(os.path.join(folder, "config.json")))["_class_name"])
mark("diffusers")
vae = cls.from_pretrained(folder, torch_dtype=dtype).to(device).eval()
if sys.argv[5:6] == ["1"]:
    vae.enable_tiling()
z = torch.load(lat, weights_only=True).to(device, dtype)
if cuda:
    torch.cuda.synchronize()
mark("load", "plan", "stages")
with torch.inference_mode():
    t = time.perf_counter()
    x = vae.decode(z).sample
    if cuda:
        torch.cuda.synchronize()
    decode_s = time.perf_counter() - t
mark("decode")
x = ((x.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).cpu()
if x.dim() == 4:
    from PIL import Image

    Image.fromarray(x[0].permute(1, 2, 0).numpy()).save(out)
else:
    import av

    frames = x[0].permute(1, 2, 3, 0).numpy()  # T, H, W, 3
    with av.open(out, "w") as c:
        s = c.add_stream("libx264", rate=16)
        s.width, s.height, s.pix_fmt, s.options = frames.shape[2], frames.shape[1], "yuv420p", {"crf": "18"}
        for f in frames:
            c.mux(s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        c.mux(s.encode())
mark("write", "report")
print(json.dumps({"decode_s": decode_s, "in_process_s": time.perf_counter() - T0}))
