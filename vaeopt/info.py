"""What each pipeline stage will do on this machine (for `vaeopt info`): the stage table's own decisions
(vaeopt.stage_table) for a representative workload of each decoder path, on this machine's device."""

from __future__ import annotations

import torch

from vaeopt import planner, stage_table
from vaeopt.engine.wan_ops import chunk_schedule
from vaeopt.families import family_names, get_family
from vaeopt.hw import DTYPE_NAMES, MachineInfo, resolve_dtype
from vaeopt.pipeline import Options
from vaeopt.stages import Hint, Said, join, spelled

# The workloads the outlook asks the table about, one per decoder path: a 1024² FLUX.1 image, an 81-frame 480p
# Wan 2.1 clip, a 33-frame 720p HunyuanVideo 1.5 clip (latent shapes), each decoded once.
WORKLOADS = (("flux", (1, 16, 128, 128)), ("wan21", (1, 16, 21, 60, 104)), ("hunyuanvideo15", (1, 32, 9, 45, 80)))

# What a stage does where the table runs it.
WHAT = {
    "fp8": "e4m3 weights + fp8 GEMMs, gated on PSNR vs fp32",
    "fp8 convs": "FP8 level 3: e4m3 / int8 implicit-GEMM convs written by the fused norms, gated on PSNR vs fp32",
    "channels_last": "NHWC / NDHWC convs and activations (GPU: with the fused norms; CPU: alone)",
    "fused_norms": "Triton GroupNorm+SiLU / RMSNorm+SiLU, NHWC-native",
    "fused_epilogues": "conv biases folded into norms, residual(+upsample) epilogues (Wan: summed by the next norm), "
                       "chunked attention; the 3-channel conv_out as a norm+GEMM kernel and a tap sum",
    "upsample_conv": "upsample + 3x3 conv as four 2x2 phase convs on the low-res input (4/9 FLOPs)",
    "stacked_conv3d": "Wan 2.1's 384-ch causal Conv3d (and its 96-ch ones where triton_conv's TMA kernel does not "
                      "take them) as a Conv2d over time-stacked channels",
    "triton_conv": "Triton implicit-GEMM conv for Wan's <=128-ch Conv3d not stacked (bf16 96- and 192-ch convs on a "
                   "warp-specialized Gluon TMA kernel where Triton has Gluon, else the 96-ch ones on its TMA variant)",
    "attention": "SDPA for diffusers' eager attention processors, HunyuanVideo's frame-causal mid-block (nothing to "
                 "change where the processors are SDPA already, as diffusers sets them)",
}


def _decisions(family, shape: tuple, dtype: torch.dtype, info: stage_table.DeviceInfo) -> dict[str, tuple]:
    """stage -> (runs, why) for one decode of `shape` with the default options (fp8, opt-in: as with it on)."""
    out = {r.name: r for r in stage_table.decide_stages(Options(), family, dtype, info)}
    for r in stage_table.decide_stages(Options(fp8="on"), family, dtype, info):
        if r.name in ("fp8", "fp8 convs"):
            out[r.name] = r
    rows = {n: (r.status == "applied", r.detail if r.status != "applied" else WHAT.get(n, ""))
            for n, r in out.items()}
    plan = planner.Plan("chunked" if family.is_video else "whole", None, 0)
    d = stage_table.decide_graphs(Options(), family, info, plan, shape, 1)
    rows["graphs"] = (d.kind is not None, d.why)
    if d.kind == "chunks":  # Wan: per clip, for the planner's chunk
        sched = chunk_schedule(shape[2], planner.MAX_CHUNK)
        px = shape[0] * family.temporal_factor * sched[1] * shape[3] * shape[4] * family.spatial_factor**2
        ok, why = stage_table.decide_chunk_graphs(d.why, info, sched, 1, px)
        rows["graphs"] = (ok, join("per chunk: ", why))
    rows["cudnn_autotune"] = stage_table.decide_autotune("auto", info, 1)
    return rows


def _grouped(got: list[tuple], n: int) -> str:
    """One stage's (family title, runs, why) over the workloads, as one text: the reason once where all agree, else
    each group's families before their reason."""
    groups: dict[tuple, list[str]] = {}
    for title, ok, why in got:
        groups.setdefault((ok, why), []).append(title)
    mixed = len({ok for ok, _ in groups}) > 1
    if len(groups) == 1 and len(got) == n:
        return next(iter(groups))[1]
    return "; ".join(f"{', '.join(titles)}{(' (runs)' if ok else ' (skipped)') if mixed else ''}: {why}"
                     for (ok, why), titles in groups.items())


# A GPU with FP8 tensor cores and the Triton kernels, as the table sees one: what `vaeopt info` describes for the FP8
# rows on a machine without FP8 compute (a CPU, an sm_80 GPU), instead of setting the GPU path's reasons beside its own.
_FP8_GPU = stage_table.DeviceInfo("cuda", "a GPU with FP8 tensor cores", (9, 0), triton=(True, ""),
                                  fp8_compute=(True, ""), graphs=(True, ""), cudnn=(True, ""))


def _on_fp8_gpu(spell) -> dict[str, str]:
    """The fp8 and fp8 convs rows' text for the WORKLOADS on _FP8_GPU (bf16, --fp8 on). A family whose FP8 runs as
    the 8-bit convs has the fp8 row point there."""
    per: dict[str, list] = {}
    for name, _ in WORKLOADS:
        family = get_family(name)
        rs = {r.name: r for r in stage_table.decide_stages(Options(fp8="on"), family, torch.bfloat16, _FP8_GPU)}
        for stage, r in rs.items():
            if stage not in ("fp8", "fp8 convs"):
                continue
            ok = r.status == "applied"
            why = WHAT[stage] if ok else r.detail
            if stage == "fp8" and not ok and getattr(rs.get("fp8 convs"), "status", None) == "applied":
                ok, why = True, "as 8-bit implicit-GEMM convs (the fp8 convs row)"
            per.setdefault(stage, []).append((family.title, ok, spelled(why, spell)))
    return {k: _grouped(v, len(WORKLOADS)) for k, v in per.items()}


def _storage_here(dtype: torch.dtype, info: stage_table.DeviceInfo, spell) -> str:
    """Whether level 1 (--fp8 weights: e4m3 weight storage, cast per layer) runs here, for the WORKLOADS."""
    weights = spelled(Said("{0}", Hint("fp8", "weights")), spell)
    got = []
    for name, _ in WORKLOADS:
        family = get_family(name)
        r = next(r for r in stage_table.decide_stages(Options(fp8="weights"), family, dtype, info) if r.name == "fp8")
        got.append((family.title, r.status == "applied", spelled(r.detail, spell)))
    if all(ok for _, ok, _ in got):
        return f"{weights} (level 1: e4m3 weight storage, cast per layer; less memory, no FP8 math) runs"
    return f"{weights}: " + _grouped(got, len(WORKLOADS))


def stage_outlook(mi: MachineInfo, spell=None) -> list[dict]:
    """One row per stage: whether it runs here for any of the WORKLOADS, and why (each workload's reason where they
    differ). spell: how the hints are written (`vaeopt info`: as `vaeopt decode`'s flags)."""
    dev = torch.device("cuda") if mi.gpus else torch.device("cpu")
    info = stage_table.DeviceInfo.of(dev)
    dtype = resolve_dtype("auto", dev)
    per: dict[str, list] = {}
    for name, shape in WORKLOADS:
        family = get_family(name)
        for stage, (ok, why) in _decisions(family, shape, dtype, info).items():
            per.setdefault(stage, []).append((family.title, ok, spelled(why, spell)))
    rows = [{"stage": "precision", "runs": True, "why": f"{DTYPE_NAMES[dtype]} on {info.name}"}]
    fp8_gpu = None if info.fp8_compute[0] else _on_fp8_gpu(spell)  # (what FP8 would do where it can run)
    for stage in [r.name for r in stage_table.ROWS[1:]] + ["graphs", "cudnn_autotune"]:
        got = per.get(stage)
        if not got:
            continue
        why = _grouped(got, len(WORKLOADS))
        if stage in ("fp8", "fp8 convs"):  # opt-in: what it would do
            on = spelled(Said("{0}", Hint("fp8", "on")), spell)
            if fp8_gpu is None:
                why = f"opt-in, with {on}: " + why
            else:  # no FP8 compute here: say so once, then what a GPU with it would do (not next to this device's)
                here = f"opt-in. Here {on} runs no FP8 compute" + (f" ({info.fp8_compute[1]})" if info.fp8_compute[1]
                                                                    else "")
                if stage == "fp8":
                    here += "; " + _storage_here(dtype, info, spell)
                why = f"{here}. On a GPU with FP8 tensor cores (sm_89+), with {on}: {fp8_gpu[stage]}"
        rows.append({"stage": stage, "runs": any(ok for _, ok, _ in got), "why": why})
    rows.append({"stage": "planner", "runs": True, "why": (
        f"tiles/chunks planned from {mi.gpus[0].free_gib:.1f} GiB free VRAM" if mi.gpus else
        "CPU: whole decode where it fits in half the available host memory, else tiled (or --tile); video chunks "
        "planned from the same")})
    return rows


# What the stages do for each family's decoder (the same on every machine; stage_outlook says what runs here).
_PATHS = {
    "AutoencoderKL": ("image path: fused GroupNorm+SiLU and epilogues, phase upsample convs, channels_last, FP8 convs, "
                      "exact layer-streamed tiling when a decode does not fit, the OOM fallback, multi-GPU bands"),
    "AutoencoderKLWan": ("Wan path: exact causal chunk decoder, fused RMSNorm+SiLU and epilogues, time-stacked and "
                         "Triton convs, per-chunk CUDA graphs, exact spatial tiling of chunks, the OOM fallback"),
    "AutoencoderKLHunyuanVideo": ("diffusers' decode with vaeopt's precision and attention (channels_last_3d off: "
                                  "its replicate padding undoes it), diffusers' spatial tiles when over budget"),
    "AutoencoderKLHunyuanVideo15": ("exact chunk decoder (causal convs' histories carried, frame-causal attention "
                                    "with kept keys/values), the largest chunk that fits, fused RMSNorm+SiLU "
                                    "(NCDHW on CUDA: channels_last_3d measured slower), exact spatial tiling when "
                                    "a chunk does not fit, the OOM fallback"),
    "AutoencoderKLLTX2Video": ("exact chunk decoder (non-causal convs hold one frame back), the whole clip in one "
                               "call where it fits, fused RMSNorm+SiLU (NCDHW on CUDA: channels_last_3d measured "
                               "slower), exact spatial tiling when a chunk does not fit, the OOM fallback"),
    "AutoencoderTiny": "tiny decoder: precision, channels_last, CUDA graphs for repeated shapes",
}


def family_outlook() -> list[dict]:
    """One row per family: name, title, the class vaeopt builds it as, its latent scaling and what the stages do."""
    rows = []
    for name in family_names():
        spec = get_family(name)
        stages = _PATHS.get(spec.cls_name, "plain path: diffusers' decode")
        if name == "flux2":
            stages = "as FLUX.1 (an AutoencoderKL decoder): " + stages
        elif name == "qwenimage":
            stages = "as Wan 2.1 (its decoder module for module): " + stages
        rows.append({"family": name, "title": spec.title, "class": spec.cls_name,
                     "latents": f"{spec.latent_channels} ch, {spec.spatial_factor}x"
                                + (f", {spec.temporal_factor}x time" if spec.is_video else ""),
                     "scaling": spec.describe_scaling(), "stages": stages})
    return rows
