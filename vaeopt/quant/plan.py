"""The per-layer format plan of the fp8 stage: which decoder convs / linears it converts and how.

Each layer gets a path: "gemm" (level 2: a linear or plain 1x1 conv as an fp8 GEMM, e4m3 operands, per-tensor scales),
"storage" (level 1: e4m3 weights with one scale per output channel, dequantized to the compute dtype per call) or
"kept" (stays in the compute dtype: conv_in / conv_out, and the layers the fidelity gate keeps). The module wrappers
(vaeopt/stages/fp8.py) convert what this plan says; the sensitivity measurement (quant/sensitivity.py) emulates the
same plan on any device; the gate (quant/gate.py) chooses `keep`.
"""

from __future__ import annotations

from torch import nn

KEEP = ("conv_in", "conv_out")  # the decoder's first and last layers: most sensitive, cheapest to keep
MODES = ("stage", "w8a8")


def decoder_of(model: nn.Module) -> nn.Module:
    """The decoder of a VAE (its `.decoder`), or the module itself."""
    return getattr(model, "decoder", model)


def gemm_eligible(layer: nn.Module) -> bool:
    """Can `layer` run as a level-2 fp8 GEMM (on a CUDA device): a linear or a plain 1x1 conv, dims multiple of 16."""
    w = layer.weight
    return w.shape[0] % 16 == 0 and w[0].numel() % 16 == 0 and (
        type(layer) is nn.Linear
        or (type(layer) is nn.Conv2d and layer.kernel_size == (1, 1) and layer.groups == 1
            and layer.stride == (1, 1) and layer.padding == (0, 0)))


def is_kept(name: str, keep: tuple[str, ...] | list[str]) -> bool:
    """Whether layer `name` is one of `keep` or inside one."""
    return name in keep or name.startswith(tuple(k + "." for k in keep))


def plan_layers(model: nn.Module, keep=KEEP, compute: bool = True) -> list[tuple[str, nn.Module, str, nn.Module, str]]:
    """Every decoder conv/linear as (full name, parent, attribute, layer, path), path one of "gemm" (level 2),
    "storage" (level 1) or "kept" (stays in the compute dtype). `compute` is taken as given (the caller decides
    whether a GPU is there): the sensitivity measurement uses this to emulate the GPU's choice on a CPU."""
    out = []
    for parent_name, parent in decoder_of(model).named_modules():
        for name, child in parent.named_children():
            full = f"{parent_name}.{name}" if parent_name else name
            if not isinstance(child, (nn.Conv2d, nn.Conv3d, nn.Linear)) or child.weight is None:
                continue
            if is_kept(full, keep):
                path = "kept"
            elif compute and gemm_eligible(child):
                path = "gemm"
            elif isinstance(child, (nn.Conv2d, nn.Conv3d)):
                path = "storage"
            else:
                continue  # a linear the GEMM path cannot take: not converted
            out.append((full, parent, name, child, path))
    return out


def recipe(path: str, mode: str) -> tuple[bool, bool]:
    """(weights per output channel?, activations quantized?) for a layer on the stage's `path` under `mode`."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: one of {MODES}")
    if mode == "w8a8":
        return True, True
    return (False, True) if path == "gemm" else (True, False)


def candidates(model: nn.Module, compute: bool = True) -> list[tuple[str, nn.Module, str]]:
    """(name, layer, path) of every layer the fp8 stage could convert, conv_in/conv_out included (so they get
    measured too); path is what the stage would do with it on an FP8 GPU ("gemm" or "storage")."""
    return [(n, layer, "gemm" if p == "gemm" else "storage")
            for n, _parent, _attr, layer, p in plan_layers(model, keep=(), compute=compute)]
