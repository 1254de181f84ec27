"""Every byte HunyuanVideo 1.5's / LTX-2's chunk decoder moves outside its convs, counted on the meta device.

    python benchmarks/stream_bytes.py --workload ltx2-768 [--chunk 16] [--layout cl|cf] [--top 25]
    python benchmarks/stream_bytes.py --workload hunyuan15-480p --fed   # feed_buffers, sub_major on

The workload's full-size decoder is built on the meta device in bf16 with the pipeline's stages as they are on CUDA
(channels_last_3d, the fused RMS norm + SiLU modules) and `video_stream.decode_clip` runs it (clamped output, as
`vaeopt decode`): no compute, every aten op seen by a dispatch mode. Each op is charged the bytes it reads (an
expanded operand once) and writes, and filed as conv / norm (the fused kernel: x read, its output written) / sdpa
(q, k, v read, the output written) / a copy or elementwise op, "dense" where all its operands share one dense layout
(a vectorized kernel on CUDA), "strided" otherwise (CUDA's generic elementwise_kernel<128, 4>, the one the GPU
profiles show), "gather" where an input is also read at a stride along the output's contiguous dim (most of each
memory sector it loads goes unused), with the vaeopt or diffusers source line that issued it. Convs whose input is
not in the weights' layout are listed too (cuDNN transposes those).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from vaeopt import video_stream  # noqa: E402
from vaeopt.benchmark import WORKLOADS  # noqa: E402
from vaeopt.engine.stream import StreamDecoder  # noqa: E402
from vaeopt.families import build_model, get_family  # noqa: E402
from vaeopt.stages import channels_last, fused_norms  # noqa: E402

_FREE = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "detach", "lift_fresh",
         "_to_copy_meta", "_unsafe_view", "set_", "resize_", "sym_size", "sym_stride", "sym_numel",
         "sym_storage_offset"}
_HERE = (os.sep + "vaeopt" + os.sep, os.sep + "diffusers" + os.sep)


def _read_bytes(t: torch.Tensor) -> int:
    """Bytes of t's distinct elements (an expanded dim is read once)."""
    n = 1
    for s, st in zip(t.shape, t.stride()):
        if st:
            n *= s
    return n * t.element_size()


def _dense(t: torch.Tensor) -> bool:
    return t.is_contiguous() or t.is_contiguous(memory_format=torch.channels_last_3d) or (
        t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last))


def _strides(t: torch.Tensor) -> tuple[int, ...]:
    """t's strides where they matter (a dim of size 1 has any)."""
    return tuple(st if n > 1 else 0 for n, st in zip(t.shape, t.stride()))


def _gathers(ins: list[torch.Tensor], outs: list[torch.Tensor]) -> bool:
    """Along the output's unit-stride dim an input steps by more than one element: neighbouring threads read
    scattered elements (a fraction of each memory sector is used)."""
    o = outs[0] if outs else None
    if o is None or o.dim() == 0:
        return False
    d = next((i for i in reversed(range(o.dim())) if o.stride(i) == 1 and o.shape[i] > 1), None)
    return d is not None and any(t.dim() == o.dim() and t.stride(d) not in (0, 1) for t in ins)


def _site() -> str:
    """The innermost vaeopt or diffusers source line on the stack (not this file)."""
    f = sys._getframe(2)
    while f is not None:
        fn = f.f_code.co_filename
        if any(h in fn for h in _HERE) and "fused_norms" not in fn:
            return f"{fn.split(os.sep + 'site-packages' + os.sep)[-1].split(os.sep + 'vaeopt' + os.sep, 1)[-1]}" \
                   f":{f.f_lineno} {f.f_code.co_name}"
        f = f.f_back
    return "?"


class Ledger(TorchDispatchMode):
    """(kind, op, site) -> [calls, bytes read + written]."""

    def __init__(self):
        super().__init__()
        self.rows: dict[tuple[str, str, str], list[int]] = collections.defaultdict(lambda: [0, 0])
        self.relayout: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])

    def charge(self, kind: str, op: str, nbytes: int, site: str | None = None) -> None:
        r = self.rows[(kind, op, site or _site())]
        r[0] += 1
        r[1] += nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if func.is_view or name in _FREE:
            return out
        schema = func._schema
        ins, outs = [], []
        for a, v in zip(schema.arguments, list(args) + [kwargs.get(a.name) for a in schema.arguments[len(args):]]):
            if isinstance(v, torch.Tensor):
                (outs if a.is_out or (a.alias_info is not None and a.alias_info.is_write) else ins).append(v)
            elif isinstance(v, (list, tuple)):
                ins += [t for t in v if isinstance(t, torch.Tensor)]
        if not outs:
            outs = [t for t in (out if isinstance(out, (list, tuple)) else [out]) if isinstance(t, torch.Tensor)]
        if name == "copy_":
            ins = [args[1]]
        if name in ("convolution", "_convolution", "cudnn_convolution", "mkldnn_convolution"):
            x, w = args[0], args[1]
            fmt = torch.channels_last_3d if x.dim() == 5 else torch.channels_last
            x_cl = not x.is_contiguous() and x.is_contiguous(memory_format=fmt)
            # a 1x1 conv's weight is in both layouts: cuDNN then follows the input's
            if not (w.is_contiguous() if not x_cl else w.is_contiguous(memory_format=fmt)):
                self.relayout[_site()][0] += 1
                self.relayout[_site()][1] += 2 * x.numel() * x.element_size()
            self.charge("conv", name, 0)
            if out.is_meta and x_cl and w.is_contiguous(memory_format=fmt) and out.is_contiguous():
                out = torch.empty(out.shape, dtype=out.dtype, device=out.device, memory_format=fmt)  # (as cuDNN)
            return out
        ops = ins + outs
        same = all(_dense(t) for t in ops) and len({_strides(t) for t in ops if t.numel() > 1}) <= 1
        nbytes = sum(_read_bytes(t) for t in ins) + sum(t.numel() * t.element_size() for t in outs)
        self.charge("dense" if same else "gather" if _gathers(ins, outs) else "strided", name, nbytes)
        return out


class _Kernels(TorchFunctionMode):
    """SDPA as one fused kernel (q, k, v read, the output written), not the meta device's math decomposition."""

    def __init__(self, ledger: Ledger):
        super().__init__()
        self.ledger = ledger

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k, v = args[:3]
            o = q.new_empty((*q.shape[:-1], v.shape[-1]))
            self.ledger.charge("sdpa", "sdpa", sum(t.numel() * t.element_size() for t in (q, k, v, o)))
            return o
        return func(*args, **kwargs)


def _fake_norm(ledger: Ledger):
    """The fused RMS norm + SiLU modules' forward as the kernel's traffic: x read once, the output written once
    (into `out` when given, a padded buffer's interior)."""

    def forward(self, x, out=None):
        with torch.utils._python_dispatch._disable_current_modes():
            y = torch.empty_like(x) if out is None else out
        ledger.charge("norm", "rms_norm_silu", 2 * x.numel() * x.element_size(), _site())
        return y

    return forward


def count(workload: str, chunk: int | None, layout: str, switches: dict) -> Ledger:
    fam_name, shape = WORKLOADS[workload]
    fam = get_family(fam_name)
    with torch.device("meta"):
        vae = build_model(fam).to(torch.bfloat16)
    if layout == "cl":
        channels_last.apply(vae)
    real = fused_norms.triton_available
    fused_norms.triton_available = lambda device=None: (True, "meta (counted)")
    try:
        fused_norms.apply(vae)
    finally:
        fused_norms.triton_available = real
    ledger = Ledger()
    patched = {cls: cls.forward for cls in (fused_norms.FusedRMSNormSiLU, fused_norms.FusedPixelRMSNormSiLU)}
    old = {k: getattr(StreamDecoder, k) for k in switches}
    for cls in patched:
        cls.forward = _fake_norm(ledger)
    for k, v in switches.items():
        setattr(StreamDecoder, k, v)
    z = torch.empty(shape, device="meta", dtype=torch.bfloat16)
    try:
        with torch.no_grad(), _Kernels(ledger), ledger:
            video_stream.decode_clip(vae, z, chunk or shape[2], clamp=True)
    finally:
        for cls, f in patched.items():
            cls.forward = f
        for k, v in old.items():
            setattr(StreamDecoder, k, v)
    return ledger


def report(ledger: Ledger, top: int) -> None:
    by_kind = collections.Counter()
    for (kind, _, _), (_, b) in ledger.rows.items():
        by_kind[kind] += b
    print("bytes by kind (GB): " + ", ".join(f"{k} {b / 1e9:.1f}" for k, b in by_kind.most_common()))
    rl = sum(b for _, b in ledger.relayout.values())
    print(f"conv inputs not in the weights' layout: {sum(c for c, _ in ledger.relayout.values())} convs, "
          f"{rl / 1e9:.1f} GB of transposes")
    print(f"\n{'kind':<8} {'op':<16} {'calls':>6} {'GB':>7}  site")
    rows = sorted(((b, c, k) for k, (c, b) in ledger.rows.items() if k[0] not in ("conv",)), reverse=True)
    for b, c, (kind, op, site) in rows[:top]:
        print(f"{kind:<8} {op:<16} {c:>6} {b / 1e9:7.2f}  {site}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", default="ltx2-768", choices=[w for w, (f, _) in WORKLOADS.items()
                                                              if f in ("ltx2", "hunyuanvideo15")])
    ap.add_argument("--chunk", type=int, default=None, help="latent frames per call (default: the whole clip)")
    ap.add_argument("--layout", default="cl", choices=("cl", "cf"), help="channels_last_3d or channels-first")
    ap.add_argument("--fed", action="store_true",
                    help="StreamDecoder's feed_buffers and sub_major on (sums written into the conv buffers, "
                         "sub-position-major upsampler channels)")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    switches = {"feed_buffers": True, "sub_major": True} if a.fed else {}
    report(count(a.workload, a.chunk, a.layout, switches), a.top)


if __name__ == "__main__":
    main()
