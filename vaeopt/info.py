"""What each pipeline stage will do on this machine (for `vaeopt info`)."""

from __future__ import annotations

import importlib

import torch

from vaeopt.families import family_names, get_family
from vaeopt.hw import MachineInfo
from vaeopt.kernels import interpreter_hint
from vaeopt.stages import Hint, Said, spelled


def stage_outlook(mi: MachineInfo, spell=None) -> list[dict]:
    """spell: how the stages' hints are written (`vaeopt info`: as `vaeopt decode`'s flags)."""
    dev = torch.device("cuda") if mi.gpus else torch.device("cpu")
    g = mi.gpus[0] if mi.gpus else None
    rows = []

    def row(stage, runs, why):
        rows.append({"stage": stage, "runs": bool(runs), "why": spelled(why, spell)})

    if g:
        row("precision", True, "bf16 (tensor cores)" if g.bf16 else "fp16 (no bf16 on " + g.sm + ")")
    else:
        row("precision", True, "fp32 on CPU")
    if g and g.fp8:
        row("fp8", True, f"{g.sm} has FP8 tensor cores; opt-in (--fp8 on: 8-bit convs where they run, else e4m3 "
                         "weights + fp8 GEMMs; --fp8 weights / gemm for level 1 / 1-2 alone), gated on PSNR vs fp32")
    else:
        row("fp8", False, (f"GPU {g.sm} has no FP8 tensor cores" if g else "no CUDA GPU") + "; --fp8 weights (e4m3 "
                          "weight storage alone, dequantized per layer) still runs")
    for name in ("fused_norms", "fused_epilogues", "upsample_conv", "stacked_conv3d", "triton_conv", "channels_last",
                 "graphs", "cudnn_autotune"):
        try:
            mod = importlib.import_module(f"vaeopt.stages.{name}")
            ok, why = mod.available(dev)
        except ImportError as e:
            ok, why = False, f"not importable ({e})"
        if ok and not g and name in ("fused_norms", "fused_epilogues"):  # as the pipeline decides on the CPU
            ok, why = False, Said("CPU decode: the Triton kernels would run only through the interpreter ("
                                  + interpreter_hint() + ")", Hint("triton", "on"))
        what = {"fused_norms": "Triton GroupNorm+SiLU / RMSNorm+SiLU, NHWC-native",
                "fused_epilogues": "conv biases folded into norms, residual(+upsample) epilogues (Wan: summed by the "
                                   "next norm), chunked attention; the 3-channel conv_out as a norm+GEMM kernel and "
                                   "a tap sum",
                "upsample_conv": "upsample + 3x3 conv as four 2x2 phase convs on the low-res input (4/9 FLOPs)",
                "stacked_conv3d": "Wan 2.1's 384-ch causal Conv3d (and its 96-ch ones where triton_conv's TMA "
                                  "kernel does not take them) as a Conv2d over time-stacked channels (auto on "
                                  "sm_90, where measured)",
                "triton_conv": "Triton implicit-GEMM conv for Wan's <=128-ch Conv3d not stacked (auto on sm_90; "
                               "bf16 96- and 192-ch convs on a warp-specialized Gluon TMA kernel where Triton has "
                               "Gluon, else the 96-ch ones on its TMA variant); "
                               "FP8 level 3's e4m3 convs (TMA boxes on sm_90, where image decoders' upsampler "
                               "convs and 128-ch convs join them)",
                "channels_last": "NHWC / NDHWC convs and activations (GPU: with the fused norms; CPU: alone)",
                "graphs": "capture + replay for repeated same-shape decodes",
                "cudnn_autotune": "cuDNN engine configs timed per new conv shape (auto from "
                                  "many same-shape decodes; --cudnn-autotune on)"}[name]
        row(name, ok, what if ok else why)
    if g:
        row("attention", True, "SDPA; backend chosen per head dim at load")
    else:
        row("attention", False, "nothing to change on the CPU: diffusers' attention is already SDPA (CPU kernels)")
    if g:
        row("planner", True, f"tiles/chunks planned from {g.free_gib:.1f} GiB free VRAM")
    else:
        row("planner", True, "CPU: whole decode where it fits in half the available host memory, else tiled (or --tile); video chunks planned from the same")
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
