"""The decode's switches (Options) and the checks on their values, without torch: `vaeopt decode` rejects a
misspelled switch, dtype or device before torch and diffusers load (seconds), as it does a missing file."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from vaeopt.errors import VaeoptError

SWITCHES = ("auto", "on", "off")
# The stages' lines suggest settings as Hint groups (Options fields); the CLI names them by its flags (`vaeopt decode`,
# and `vaeopt serve`, whose users set them there).
FLAG_OF = {"gate_db": "fp8-gate", "vram_budget_gb": "vram-budget"}  # Options fields whose flag is named otherwise


def hint_flags(group) -> list[tuple[str, str]]:
    """A hint group as (flag name, value) pairs: [("triton", "on"), ("fp8-gate", "30")]."""
    return [(FLAG_OF.get(h.option, h.option.replace("_", "-")), "" if h.value is None else f"{h.value}")
            for h in group]


def spell_flags(group) -> str:
    """A hint group as `vaeopt decode`'s flags: `--triton on --conv-kernel on`."""
    return " ".join(f"--{n}" + (f" {v}" if v else "") for n, v in hint_flags(group))


# --fp8 also takes one level alone: "weights" (level 1: e4m3 weight storage, any device) and "gemm" (levels 1-2: plus
# the 1x1 convs and linears as fp8 GEMMs, sm_89+); "on"/"auto" take level 3 where it runs (stages/triton_conv)
FP8_MODES = SWITCHES + ("weights", "gemm")


@dataclass
class Options:
    device: str | None = None
    dtype: str = "auto"
    channels_last: str = "auto"
    triton: str = "auto"
    epilogues: str = "auto"  # conv bias folded into norms, fused residual(+upsample) epilogues, chunked attention
    attention: str = "auto"
    upsample_conv: str = "auto"  # upsample + 3x3 conv as four 2x2 phase convs on the low-resolution input
    stack_conv3d: str = "auto"  # Wan's causal Conv3d as a Conv2d over time-stacked channels
    conv_kernel: str = "auto"  # Triton implicit-GEMM conv for the layers where it measured faster than cuDNN
    fp8: str = "off"
    graphs: str = "auto"
    cudnn_autotune: str = "auto"  # cuDNN times engine configs per new conv shape (pays for many same-shape decodes)
    tiling: str = "auto"
    tile: int | None = None  # latent px per tile side
    chunk: int | None = None  # latent frames per decoder call (video)
    vram_budget_gb: float | None = None
    gate_db: float = 40.0  # fidelity gate for lossy stages (PSNR vs fp32 reference)
    # the latent shape (N, C, H, W) the decodes will have, where the caller knows it (vaeopt decode: the largest
    # input; vaeopt benchmark: the workload): the int8 convs' gate measures at that size (stages/triton_conv)
    decode_shape: tuple | None = None

    def validate(self) -> None:
        for name in ("channels_last", "triton", "epilogues", "attention", "upsample_conv", "stack_conv3d",
                     "conv_kernel", "fp8", "graphs", "cudnn_autotune", "tiling"):
            v = getattr(self, name)
            allowed = FP8_MODES if name == "fp8" else SWITCHES
            if v not in allowed:
                where = "Options.attention: no CLI flag" if name == "attention" else f"--{name.replace('_', '-')}"
                raise VaeoptError(f"{name} ({where}) must be one of {', '.join(allowed)}, got {v!r}")
        for name, flag in (("tile", "--tile"), ("chunk", "--chunk")):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                raise VaeoptError(f"{name} ({flag}) must be a whole number of latent "
                                  f"{'pixels' if name == 'tile' else 'frames'}, got {v!r}")
        for name, flag in (("vram_budget_gb", "--vram-budget"), ("gate_db", "--fp8-gate")):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise VaeoptError(f"{name} ({flag}) must be a number, got {v!r}")
        if self.tile is not None and self.tile < 8:
            raise VaeoptError(f"--tile {self.tile}: tiles must be at least 8 latent pixels")
        if self.chunk is not None and self.chunk < 1:
            raise VaeoptError(f"--chunk {self.chunk}: must be at least 1 latent frame")
        if self.vram_budget_gb is not None and not (0 < self.vram_budget_gb < float("inf")):
            raise VaeoptError(f"--vram-budget must be a positive number of GB, got {self.vram_budget_gb}")
        if not 0 <= self.gate_db < float("inf"):  # NaN fails this too
            raise VaeoptError(f"--fp8-gate must be a PSNR in dB, 0 or more, got {self.gate_db}")
        ds = self.decode_shape
        if ds is not None and (not isinstance(ds, (tuple, list)) or len(ds) < 3
                               or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in ds)):
            raise VaeoptError(f"decode_shape must be a latent shape such as (1, 4, 128, 128), got {ds!r}")
        if self.tile is not None and self.tiling == "off":
            raise VaeoptError("--tile conflicts with --tiling off")


DTYPE_WORDS = ("auto", "fp32", "float32", "bf16", "bfloat16", "fp16", "float16", "half")


def check_dtype_name(dtype: str | None) -> None:
    if (dtype or "auto").lower() not in DTYPE_WORDS:  # (hw.DTYPE_NAMES maps torch dtypes to these)
        raise VaeoptError(f"unknown dtype '{dtype}' (auto, fp32, bf16, fp16)")


def check_device_name(device: str | None) -> None:
    """The spelling (cpu, cuda, cuda:N), and a GPU asked of a torch built without GPU support (its version file says
    so without importing it: seconds saved on the most common mistake of a CPU machine); whether that GPU exists is
    for torch to say."""
    if device in (None, "", "auto"):
        return
    kind, _, index = device.partition(":")
    if kind not in ("cpu", "cuda") or (index and not index.isdigit()) or device.endswith(":"):
        raise VaeoptError(f"--device {device}: expected cpu, cuda or cuda:N")
    if kind == "cuda" and (version := cpu_only_torch()):
        raise VaeoptError(f"--device {device}: no CUDA GPU is visible to torch {version} (a CPU-only build of torch)")


def expand_home(path, what: str, error: type[VaeoptError] = VaeoptError) -> Path:
    """Path(path).expanduser(), with a '~name' whose user does not exist reported as an input error naming `what`
    (Python's own "Could not determine home directory." names neither the path nor the user)."""
    p = Path(path)
    try:
        return p.expanduser()
    except (RuntimeError, KeyError):
        user = str(path).split("/", 1)[0]
        raise error(f"{what} {path}: '{user}' names no user on this system (so no home folder)") from None


def cpu_only_torch() -> str | None:
    """The installed torch's version if its build has neither CUDA nor ROCm (torch/version.py, read as text), else
    None: a GPU build, torch already imported (it answers for itself), or a version file this cannot read."""
    import importlib.util
    import re
    import sys

    if "torch" in sys.modules:
        return None
    try:
        spec = importlib.util.find_spec("torch")
        path = Path(spec.origin).with_name("version.py") if spec and spec.origin else None
        text = path.read_text() if path else ""
    except (OSError, ValueError, ImportError):
        return None
    fields = dict(re.findall(r"^(\w+)(?:\s*:[^=\n]*)?\s*=\s*(.+?)\s*$", text, re.M))
    if fields.get("cuda") == "None" and fields.get("hip") == "None" and "__version__" in fields:
        return fields["__version__"].strip("'\"")
    return None


def check_limits(max_outputs, max_output_gb) -> None:
    if isinstance(max_outputs, bool) or not isinstance(max_outputs, int) or max_outputs < 1:
        raise VaeoptError(f"--max-outputs must be a whole number of at least 1, got {max_outputs}")
    if not (isinstance(max_output_gb, int | float) and 0 < max_output_gb < float("inf")):
        raise VaeoptError(f"--max-output-gb must be a positive number of GB, got {max_output_gb}")


def parse_shape(text: str) -> tuple[int, ...]:
    """'1,4,128,128' or '1x4x128x128' -> (1, 4, 128, 128); bad input -> VaeoptError (one line, exit 2)."""
    try:
        shp = tuple(int(s) for s in text.replace("x", ",").split(","))
    except ValueError:
        raise VaeoptError(f"--shape '{text}': expected integers like 1,4,128,128") from None
    if not shp or any(d < 1 for d in shp):
        raise VaeoptError(f"--shape '{text}': every dimension must be at least 1")
    return shp
