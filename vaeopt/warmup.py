"""`vaeopt warmup`: run the decodes a later `vaeopt decode` will run, once, so that what they compile, choose and
measure (Triton's kernel cache; vaeopt's cache: FP8 verdicts, plans, the kernels to preload) is on disk before the
first real decode. cuDNN's and the driver's per-process state and CUDA graphs live and die with a process. An FP8
verdict is per weights, so `--fp8 on` needs the checkpoint itself, not a --workload's random weights.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from vaeopt import cache, prewarm
from vaeopt.errors import VaeoptError
from vaeopt.hw import resolve_device
from vaeopt.loading import LoadedVAE
from vaeopt.options import parse_shape
from vaeopt.pipeline import Options, Pipeline


@dataclass
class Warmed:
    shape: tuple
    plan: str  # the plan's reason, as `vaeopt decode` logs it
    seconds: float  # the warm-up decode, launch to last kernel (compiles included)
    compiled: int  # Triton kernels compiled by it
    loaded: int  # Triton kernels it found in Triton's cache


@dataclass
class Report:
    shapes: list[Warmed] = field(default_factory=list)
    triton_dir: str | None = None
    device: str = "cpu"
    cache_dir: Path = field(default_factory=cache.cache_dir)
    written: list[Path] = field(default_factory=list)  # vaeopt cache entries written or rewritten
    prepare: tuple[int, int] = (0, 0)  # Triton kernels compiled / loaded while the stages were prepared
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return {"shapes": [{**vars(w), "shape": list(w.shape)} for w in self.shapes], "triton_dir": self.triton_dir,
                "prepare_triton": list(self.prepare), "cache_dir": str(self.cache_dir), "cache_enabled": cache.enabled(),
                "written": [str(p) for p in self.written], "seconds": self.seconds}


def triton_cache_dir() -> str | None:
    """Where Triton keeps compiled kernels (None: no Triton)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return None
    from vaeopt.kernels import triton_cache_entries

    return triton_cache_entries()[0]


class TritonCount:
    """Kernels compiled vs found in Triton's cache while it is installed (Triton's compilation listener)."""

    def __init__(self):
        self.compiled = self.loaded = 0
        self._knobs = self._prev = None

    def __enter__(self) -> TritonCount:
        try:
            from triton import knobs
        except ImportError:
            return self
        self._knobs, self._prev = knobs, knobs.compilation.listener
        knobs.compilation.listener = self._on
        return self

    def _on(self, *, cache_hit: bool, **_) -> None:
        if cache_hit:
            self.loaded += 1
        else:
            self.compiled += 1

    def __exit__(self, *exc) -> None:
        if self._knobs is not None:
            self._knobs.compilation.listener = self._prev


def check_shape(loaded: LoadedVAE, shape: tuple) -> None:
    fam = loaded.family
    want = 5 if fam.is_video else 4
    if len(shape) != want or shape[1] != fam.latent_channels:
        raise VaeoptError(f"--shape {','.join(map(str, shape))} does not fit {fam.title}: expected {want} dims "
                          f"(N,C,{'T,' if fam.is_video else ''}H,W) with {fam.latent_channels} channels")


def run(loaded: LoadedVAE, shapes: list[tuple], options: Options | None = None,
        log: Callable[[str], None] | None = None, spell: Callable | None = None) -> Report:
    """One planned decode of random latents per shape through the pipeline `vaeopt decode` builds with `options`
    (decode_shape: the largest image shape, as decode sets it), and what that wrote. spell: how the stage lines'
    hints are written (the caller's own spelling, as Pipeline takes it)."""
    if not shapes:
        raise VaeoptError("warmup needs at least one latent shape")
    for s in shapes:
        check_shape(loaded, s)
    opts = options or Options()
    images = [s for s in shapes if len(s) == 4]
    if images and opts.decode_shape is None:
        opts.decode_shape = (1, *max(images, key=lambda s: s[-2] * s[-1])[1:])
    t0 = time.perf_counter()
    before = {p: p.stat().st_mtime_ns for p in cache.entries()}
    dev = resolve_device(opts.device)
    rep = Report(triton_dir=triton_cache_dir(), device=str(dev))
    source = prewarm.source_id(loaded.path) if loaded.path is not None else f"random:{loaded.family.name}"
    # the kernels loaded here are stored for `vaeopt decode` of the same checkpoint to load beside its checkpoint read
    with prewarm.Record(prewarm.key(source, opts), dev, log) if dev.type == "cuda" else contextlib.nullcontext():
        with TritonCount() as prep:  # (the FP8 gate's probes compile kernels here)
            pipe = Pipeline(loaded, opts, log=log, spell=spell)
        rep.prepare = (prep.compiled, prep.loaded)
        for shape in shapes:
            with TritonCount() as n:
                plan = pipe.plan(shape)
                z = torch.randn(shape, generator=torch.Generator().manual_seed(0))
                pipe.autotune(1, plan)  # as a one-shot decode decides it (off for one decode)
                _, st = pipe.decode(z, plan)
            rep.shapes.append(Warmed(tuple(shape), plan.reason, st.seconds, n.compiled, n.loaded))
    rep.written = [p for p in cache.entries() if before.get(p) != p.stat().st_mtime_ns]
    rep.seconds = time.perf_counter() - t0
    return rep


def summary(rep: Report) -> list[str]:
    """The lines `vaeopt warmup` prints."""
    out = []
    if any(rep.prepare):
        out.append(f"stages: Triton kernels: {rep.prepare[0]} compiled, {rep.prepare[1]} from its cache")
    for w in rep.shapes:
        trit = f"; Triton kernels: {w.compiled} compiled, {w.loaded} from its cache" if w.compiled or w.loaded else ""
        out.append(f"{'x'.join(map(str, w.shape))}: decoded in {w.seconds:.2f} s{trit} ({w.plan})")
    used = any(rep.prepare) or any(w.compiled or w.loaded for w in rep.shapes)
    if not rep.triton_dir:
        out.append("Triton: not installed")
    elif used or not rep.device.startswith("cpu"):
        out.append(f"Triton's kernel cache: {rep.triton_dir}")
    else:  # (a CPU decode runs torch's kernels: nothing of Triton's to keep)
        out.append("Triton: not used on the CPU")
    if not cache.enabled():
        out.append("vaeopt's cache: off (VAEOPT_CACHE=off)")
    else:
        kinds = sorted({p.relative_to(rep.cache_dir).parts[0] for p in rep.written})
        n = len(rep.written)
        what = f"{n} entr{'y' if n == 1 else 'ies'} written: {', '.join(kinds)}" if n else "nothing new to store"
        out.append(f"vaeopt's cache: {rep.cache_dir} ({what})")
    return out


def load(model: str | Path | None, workload: str | None, family: str | None = None,
         shapes: list[str] | None = None, device: torch.device | None = None) -> tuple[LoadedVAE, list[tuple]]:
    """The model to warm up (a checkpoint, else --workload's / --family's architecture with random weights: the
    same kernels and plans) and the shapes (--shape, else the workload's, else the family's standard one)."""
    from vaeopt import benchmark as bm
    from vaeopt.families import build_model, get_family
    from vaeopt.loading import load_vae

    if workload is not None and workload not in bm.WORKLOADS:
        raise VaeoptError(f"unknown workload '{workload}' (known: {', '.join(bm.WORKLOADS)})")
    if model is not None:
        loaded = load_vae(model, family=family)
    elif workload is not None or family is not None:
        spec = get_family(family or bm.WORKLOADS[workload][0])
        torch.manual_seed(0)
        loaded = LoadedVAE(build_model(spec).eval().requires_grad_(False), spec, "random-init", None,
                           [f"{spec.title}: its architecture with random weights (the same kernels and plans as "
                            "trained weights; an FP8 verdict is per checkpoint)"])
    else:
        raise VaeoptError("warmup needs a checkpoint, --workload or --family")
    if shapes:
        out = [parse_shape(s) for s in shapes]
    elif workload is not None and bm.WORKLOADS[workload][0] == loaded.family.name:
        out = [tuple(bm.WORKLOADS[workload][1])]
    else:
        out = [tuple(bm.default_shape(loaded.family, device or torch.device("cpu"))[0])]
    return loaded, out
