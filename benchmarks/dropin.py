"""`vaeopt.optimize(pipe.vae)` on the diffusers class a pipeline loads, against that class's own decode: the drop-in
as a diffusers pipeline calls it (`vae.decode(z).sample`, one call per picture or clip).

    python benchmarks/dropin.py --workload qwenimage-1328 [--variants diffusers,optimize,graphs]
    python benchmarks/dropin.py --workload wan21-480p --variants diffusers,optimize --repeats 3

Variants: diffusers (the stock model's decode: for Qwen-Image diffusers' AutoencoderKLQwenImage, its frame loop),
optimize (vaeopt.optimize on a copy, its eager decodes), graphs (the same once the drop-in's CUDA graph rule has
captured the shape: called until it does, as a pipeline decoding picture after picture). Each row says how many
vae.decode calls went through vaeopt's chunk decoder (0: diffusers' frame loop ran).
"""

import inspect

import torch

import harness as H

VARIANTS = ("diffusers", "optimize", "graphs")
DEFAULTS = {"workload": "qwenimage-1328", "repeats": 10}
add_args = H.decode_args
items = H.decode_items()


def stock(ctx, dtype=None) -> torch.nn.Module:
    """The workload's model as its pipeline loads it: Qwen-Image as diffusers' AutoencoderKLQwenImage (the same
    weights under the same names; vaeopt's loader builds it as an AutoencoderKLWan), the others as built."""
    m = ctx.model(dtype)
    if ctx.family.name != "qwenimage":
        return m
    from diffusers import AutoencoderKLQwenImage

    cfg = {("input_channels" if k == "in_channels" else k): v for k, v in dict(m.config).items()}
    params = inspect.signature(AutoencoderKLQwenImage.__init__).parameters
    with torch.device("meta"):
        q = AutoencoderKLQwenImage(**{k: v for k, v in cfg.items() if k in params})
    q.load_state_dict(m.state_dict(), assign=True)
    return q.eval().requires_grad_(False)


def setup(variant, shape, ctx):
    import vaeopt
    from vaeopt import video

    flops, z = ctx.flops(), ctx.latent()

    def reference():  # fp32, diffusers' own decode of the same weights
        return stock(ctx, torch.float32).decode(z.float()).sample

    vae = stock(ctx)
    if variant == "diffusers":
        return H.Case(lambda: vae.decode(z).sample, reference, image=True, flops=flops,
                      info={"class": type(vae).__name__})
    lines: list[str] = []
    vaeopt.optimize(vae, log=lines.append)
    calls = [0]
    real = video.decode_video

    def counted(*a, **k):
        calls[0] += 1
        return real(*a, **k)

    video.decode_video = counted  # (this process only: one row per setup)
    info = {"class": type(vae).__name__, "optimize_log": lines, "chunk_decoder_calls": calls}
    if variant == "graphs":
        if z.device.type != "cuda":
            raise H.Skip("CUDA graphs need a GPU")
        g = getattr(vae.decode, "graphs", None)
        key = (tuple(z.shape), z.dtype)
        with torch.inference_mode():
            for n in range(1, 501):
                vae.decode(z)
                if g is not None and key in g.shapes:
                    break
        if g is None or key not in g.shapes:
            raise H.Skip(f"the drop-in did not capture {tuple(z.shape)} within 500 decodes")
        info["captured_after_calls"] = n
    return H.Case(lambda: vae.decode(z).sample, reference, image=True, flops=flops, info=info)


if __name__ == "__main__":
    H.main("dropin")
