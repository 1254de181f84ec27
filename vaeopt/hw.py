"""What this machine can do: versions, GPUs, capabilities. Used by `vaeopt info` and by the pipeline's stages."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field

import torch

from vaeopt.cache import package_version
from vaeopt.errors import VaeoptError
from vaeopt.options import check_dtype_name


@dataclass
class GPUInfo:
    index: int
    name: str
    sm: str  # "sm_90"
    capability: tuple[int, int]
    total_gib: float
    free_gib: float
    multiprocessors: int
    bf16: bool
    fp8: bool  # FP8 tensor cores (sm_89+)
    arch_in_build: bool  # is this arch (or compatible PTX) in torch's build


@dataclass
class MachineInfo:
    python: str
    platform: str
    torch: str
    cuda: str | None
    cudnn: str | None
    triton: str | None
    diffusers: str | None
    pyav: str | None
    torch_arch_list: list[str]
    gpus: list[GPUInfo] = field(default_factory=list)
    sdpa_backends: dict[str, bool] = field(default_factory=dict)
    triton_interpret: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


def gpu_info(index: int) -> GPUInfo:
    p = torch.cuda.get_device_properties(index)
    cap = (p.major, p.minor)
    free, total = torch.cuda.mem_get_info(index)
    arch_list = torch.cuda.get_arch_list()
    sm = f"sm_{p.major}{p.minor}"
    in_build = sm in arch_list or any(a.startswith("compute_") and int(a.split("_")[1]) <= p.major * 10 + p.minor
                                      for a in arch_list)
    return GPUInfo(index, p.name, sm, cap, total_gib=total / 2**30, free_gib=free / 2**30,
                   multiprocessors=p.multi_processor_count, bf16=cap >= (8, 0), fp8=cap >= (8, 9),
                   arch_in_build=in_build)


def sdpa_backends() -> dict[str, bool]:
    names = ("flash", "mem_efficient", "math", "cudnn")
    out = {n: bool(getattr(torch.backends.cuda, f"{n}_sdp_enabled")()) for n in names}
    if not torch.cuda.is_available():  # on CPU, SDPA has a flash kernel and the math path (same global switches)
        out = {k: (v and k in ("flash", "math")) for k, v in out.items()}
    return out


def machine_info(gpus: bool = True) -> MachineInfo:
    """gpus=False: without the per-GPU memory query, which creates a CUDA context on every GPU (a parent process
    that only records versions, beside the processes it times, must hold none)."""
    cuda = torch.version.cuda if torch.cuda.is_available() else None
    cudnn = None
    if torch.cuda.is_available() and torch.backends.cudnn.is_available():
        v = torch.backends.cudnn.version()
        cudnn = f"{v // 10000}.{(v // 100) % 100}.{v % 100}" if v and v >= 10000 else str(v)
    info = MachineInfo(platform.python_version(), platform.platform(), torch.__version__, cuda, cudnn,
                       triton=package_version("triton"), diffusers=package_version("diffusers"),
                       pyav=package_version("av"),
                       torch_arch_list=torch.cuda.get_arch_list() if torch.cuda.is_available() else [],
                       sdpa_backends=sdpa_backends(), triton_interpret=os.environ.get("TRITON_INTERPRET") == "1")
    if gpus and torch.cuda.is_available():
        info.gpus = [gpu_info(i) for i in range(torch.cuda.device_count())]
    return info


def resolve_device(device: str | None) -> torch.device:
    if device in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise VaeoptError(f"--device {device}: expected cpu, cuda or cuda:N")
    if dev.type == "cpu" and dev.index not in (None, 0):
        raise VaeoptError(f"--device {device}: the CPU is one device (cpu); an index picks a GPU (cuda:N)")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise VaeoptError(f"--device {device}: no CUDA GPU is visible to torch {torch.__version__}")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise VaeoptError(f"--device {device}: only {torch.cuda.device_count()} GPU(s) visible")
    return dev


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):  # (float8 storage is the fp8 stage's job)
            raise VaeoptError(f"dtype {dtype}: vaeopt decodes in torch.float32, torch.bfloat16 or torch.float16")
        return dtype
    d = (dtype or "auto").lower()
    if d == "auto":
        if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 8:
            return torch.bfloat16
        if device.type == "cuda":
            return torch.float16
        return torch.float32
    check_dtype_name(dtype)
    table = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
             "fp16": torch.float16, "float16": torch.float16, "half": torch.float16}
    return table[d]


DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}  # as --dtype and Options name them


# nvidia-smi's clocks_throttle_reasons.active bits (nvml.h: nvmlClocksEventReasons): the ones that slow a busy GPU
THROTTLE_BITS = {0x4: "power cap", 0x8: "hardware slowdown", 0x20: "thermal (software)", 0x40: "thermal (hardware)",
                 0x80: "power brake"}
_SMI_FIELDS = "clocks.sm,clocks.max.sm,power.draw,power.limit,clocks_throttle_reasons.active"


def _num(v: str) -> float | None:
    try:
        return float(v)
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None


def parse_smi_samples(text: str) -> list[dict]:
    """The lines of `nvidia-smi --query-gpu=<_SMI_FIELDS> --format=csv,noheader,nounits` as dicts. A field the GPU
    does not report ("[N/A]": power on many consumer parts) is None; lines without a readable SM clock (an error
    message, a line cut short) are dropped."""
    out = []
    for line in text.splitlines():
        p = [s.strip() for s in line.split(",")]
        if len(p) != 5 or _num(p[0]) is None:
            continue
        try:
            throttle = int(p[4], 16)
        except ValueError:
            throttle = 0
        out.append({"sm_mhz": _num(p[0]), "max_sm_mhz": _num(p[1]), "power_w": _num(p[2]),
                    "power_limit_w": _num(p[3]), "throttle": throttle})
    return out


def summarize_clocks(samples: list[dict]) -> dict | None:
    """What the GPU's clock did over `samples`: SM clock median / min against its maximum, the highest power draw
    against the limit (None where not reported), and the fraction of samples in which each slowdown reason was
    active with the clock below its maximum. nvidia-smi refreshes its readings about every 100 ms, and its power
    draw is an average over a longer window: a row of a few short decodes gets one or two readings."""
    if not samples:
        return None
    sm = sorted(s["sm_mhz"] for s in samples)
    # a reason counts where the clock is below its maximum (or the maximum is not reported): an H200 reports the
    # power-cap bit at full clock and 208 W of 700 (sdxl-1024, E31)
    slow = [s for s in samples if s["max_sm_mhz"] is None or s["sm_mhz"] < s["max_sm_mhz"]]
    reasons = {name: sum(bool(s["throttle"] & bit) for s in slow) / len(samples) for bit, name in THROTTLE_BITS.items()}
    power = [s["power_w"] for s in samples if s["power_w"] is not None]
    return {"samples": len(samples), "sm_mhz_median": sm[len(sm) // 2], "sm_mhz_min": sm[0],
            "sm_mhz_max_rated": samples[0]["max_sm_mhz"], "power_w_max": max(power) if power else None,
            "power_limit_w": samples[0]["power_limit_w"], "slowdown": {k: v for k, v in reasons.items() if v}}


class ClockSampler:
    """Samples the GPU's SM clock, power and slowdown reasons with `nvidia-smi -lms` while a block runs:

        with ClockSampler(device) as cs:
            ...timed work...
        cs.summary  # summarize_clocks(...) or None

    Decodes back to back at the GPU's power limit are clocked down (experiments.md E31): benchmark rows carry this to
    tell apart what the code and what the power budget did. nvidia-smi writes to a temporary file (no pipe to fill on
    long rows). Does nothing (summary None) off CUDA, on ROCm, on a MIG slice, without nvidia-smi, with
    VAEOPT_GPU_CLOCKS=0, or when anything about it fails: it never raises into the timed work."""

    def __init__(self, device: torch.device, interval_ms: int = 100):
        self.device, self.interval_ms = device, interval_ms
        self.proc = None
        self.out = None
        self.summary: dict | None = None

    def _select(self) -> list[str]:
        """nvidia-smi's -i selection for this device, or [] where it cannot be named reliably: a MIG slice (torch's
        uuid is not the GPU's), or no uuid with CUDA_VISIBLE_DEVICES renumbering the GPUs."""
        idx = self.device.index if self.device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(idx)
        if "MIG" in str(getattr(props, "name", "")) or "MIG" in os.environ.get("CUDA_VISIBLE_DEVICES", ""):
            return []
        uuid = str(getattr(props, "uuid", "") or "")
        if not uuid:  # nvidia-smi counts GPUs without CUDA_VISIBLE_DEVICES' renumbering: only right when unset
            return ["-i", str(idx)] if not os.environ.get("CUDA_VISIBLE_DEVICES") else []
        return ["-i", uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"]

    def __enter__(self) -> ClockSampler:
        off = os.environ.get("VAEOPT_GPU_CLOCKS", "1").strip().lower() in ("0", "off", "false", "no")
        if self.device.type != "cuda" or torch.version.hip is not None or off or shutil.which("nvidia-smi") is None:
            return self
        try:
            sel = self._select()
            if not sel:
                return self
            self.out = tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace")
            self.proc = subprocess.Popen(["nvidia-smi", *sel, f"--query-gpu={_SMI_FIELDS}",
                                          "--format=csv,noheader,nounits", "-lms", str(self.interval_ms)],
                                         stdout=self.out, stderr=subprocess.DEVNULL)
        except Exception:  # noqa: BLE001 - a clock reading must never fail a benchmark
            self._close()
        return self

    def _close(self) -> str:
        """Stop nvidia-smi (terminate, then kill) and reap it; return what it wrote."""
        text = ""
        try:
            if self.proc is not None:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=2)
                except BaseException as e:  # a TERM-deaf process, or Ctrl-C while waiting: kill it all the same
                    self.proc.kill()
                    self.proc.wait(timeout=2)
                    if not isinstance(e, Exception):
                        raise
            if self.out is not None:
                self.out.seek(0)
                text = self.out.read()
        except Exception:  # noqa: BLE001
            pass
        finally:
            if self.out is not None:
                self.out.close()
            self.proc = self.out = None
        return text

    def __exit__(self, *exc) -> None:
        if self.proc is None:
            return
        try:
            self.summary = summarize_clocks(parse_smi_samples(self._close()))
        except Exception:  # noqa: BLE001
            self.summary = None
