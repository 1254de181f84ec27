"""What decodes measure once per GPU and reuse (the FP8 gates' verdicts, the planner's plans, the Triton kernels a
decode loaded: prewarm.py), kept on disk between processes; docs/user-guide.md says where, how entries are keyed and
how to clear them. Triton's compiled kernels stay in Triton's own cache, which is already keyed by source, compiler
and GPU target and shared with every Triton user on the machine.

One JSON file per entry, <dir>/<kind>/<hash of the environment>/<hash of the key>.json, written to a temporary and
renamed. Each file repeats its environment and key and is checked against them on reading, so a file copied between
machines or left half-written is ignored (one line to the caller's log) and measured again: reading never raises.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Callable

FORMAT = 1  # the entry layout; a change starts new folders
ENV_DIR = "VAEOPT_CACHE_DIR"
ENV_SWITCH = "VAEOPT_CACHE"  # "off": no reading, no writing


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "").strip().lower() not in ("off", "0", "no", "false")


def cache_dir() -> Path:
    """The cache's folder (not created here)."""
    d = os.environ.get(ENV_DIR)
    if d:
        return Path(d).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg and os.path.isabs(xdg) else Path.home() / ".cache") / "vaeopt"


def package_version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def driver_version() -> str | None:
    """The NVIDIA kernel driver's version, from /proc (Linux), without NVML."""
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        return None
    for word in text.split():
        if word.count(".") >= 1 and word.replace(".", "").isdigit():
            return word
    return None


def environment(device=None) -> dict:
    """What makes a measurement stale: the device and the software that ran it."""
    import torch

    from vaeopt.version import VERSION as __version__

    dev = torch.device(device) if device is not None else torch.device("cpu")
    env = {"format": FORMAT, "vaeopt": __version__, "torch": torch.__version__, "triton": package_version("triton")}
    if dev.type == "cuda" and torch.cuda.is_available():
        cudnn = torch.backends.cudnn.version()
        env.update(gpu=torch.cuda.get_device_name(dev), capability=list(torch.cuda.get_device_capability(dev)),
                   driver=driver_version(), cuda=torch.version.cuda, cudnn=cudnn)
    else:  # (a plan for a CUDA device made where none is present: keyed as such, never mixed with a GPU's)
        env.update(gpu=dev.type)
    return env


def digest(obj) -> str:
    """A short stable hash of a JSON-able value."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:20]


def weights_fingerprint(model) -> str:
    """A hash of a model's weights that takes milliseconds on a GPU: per parameter and buffer, its name, shape, dtype,
    sum, sum of squares and 16 values spread over it (one copy to the host for all of them). Two checkpoints that
    differ in any trained layer differ here; the FP8 gate's verdicts are keyed by it (plans by the config)."""
    import torch

    names, stats = [], []
    with torch.no_grad():
        for name, t in sorted({**dict(model.named_parameters()), **dict(model.named_buffers())}.items()):
            if t is None or not t.is_floating_point() or t.numel() == 0 or t.device.type == "meta":
                continue
            f = t.detach().reshape(-1)
            idx = torch.linspace(0, f.numel() - 1, 16, device=f.device).long()
            names.append(f"{name}:{tuple(t.shape)}:{t.dtype}")
            stats.append(torch.cat([f.float().sum().reshape(1), f.float().square().sum().reshape(1),
                                    f[idx].float()]).to(stats[0].device if stats else f.device))
    h = hashlib.sha256("|".join(names).encode())
    if stats:
        h.update(torch.stack(stats).cpu().numpy().tobytes())  # one copy to the host, one sync
    return h.hexdigest()[:20]


class Entry(dict):
    """A stored value (a dict) with where and when it was written: .path, .created (ISO date, UTC)."""
    path: Path
    created: str

    @property
    def when(self) -> str:
        """'2026-11-29 01:12 UTC', for log lines."""
        return self.created.replace("T", " ")[:16] + " UTC"


def _path(kind: str, key: dict, env: dict) -> Path:
    return cache_dir() / kind / digest(env) / f"{digest(key)}.json"


def get(kind: str, key: dict, device=None, log: Callable[[str], None] | None = None) -> Entry | None:
    """The value stored for (kind, key) in this environment, or None (absent, cache off, or an entry that is corrupt,
    truncated or from another environment: ignored with one line to `log`, and overwritten by the next put)."""
    if not enabled():
        return None
    env = environment(device)
    path = _path(kind, key, env)
    try:
        raw = path.read_text()
    except OSError:
        return None
    try:
        d = json.loads(raw)
        if not isinstance(d, dict) or not isinstance(d.get("value"), dict) or not isinstance(d.get("created"), str):
            raise ValueError("fields missing")
        if d.get("env") != json.loads(json.dumps(env)):
            raise ValueError("written by another GPU, driver or version")
        if d.get("key") != json.loads(json.dumps(key, default=str)) or d.get("kind") != kind:
            raise ValueError("written for another key")
    except (ValueError, TypeError) as e:  # json.JSONDecodeError is a ValueError
        if log is not None:
            why = "unreadable" if isinstance(e, json.JSONDecodeError) else str(e)
            log(f"! vaeopt cache: ignored {path} ({why}): measuring again")
        return None
    e = Entry(d["value"])
    e.path, e.created = path, d["created"]
    return e


def put(kind: str, key: dict, value: dict, device=None, log: Callable[[str], None] | None = None) -> Path | None:
    """Store value (JSON-able) for (kind, key) in this environment, atomically. -> the file, or None (cache off, or
    the folder cannot be written: one line to `log`; the decode goes on without it)."""
    if not enabled():
        return None
    env = environment(device)
    path = _path(kind, key, env)
    doc = {"kind": kind, "env": env, "key": key, "value": value,
           "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(doc, f, indent=1, default=str)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as e:
        if log is not None:
            log(f"! vaeopt cache: could not write {path.parent} ({e.strerror or e}): not cached")
        return None
    return path


def entries(kind: str | None = None) -> list[Path]:
    """The entry files under the cache folder (of one kind), for `vaeopt warmup`'s report."""
    root = cache_dir() / kind if kind else cache_dir()
    return sorted(root.rglob("*.json")) if root.is_dir() else []
