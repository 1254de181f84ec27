"""Pipeline stages. Each stage is one module with one job and exposes:

    available(device: torch.device) -> tuple[bool, str]     # can it run here; if not, why
    apply(model, **options) -> StageResult                   # do the work in place, report what was done
    revert(model) -> None                                    # undo (where the stage patches modules)

A stage never reports success for work it did not do: `detail` carries measured facts (layers converted, ms, ...).
"""

from __future__ import annotations

import re
import weakref
from dataclasses import dataclass, field
from typing import Callable, Literal

Status = Literal["applied", "skipped", "fallback"]


@dataclass(frozen=True)
class Hint:
    """An option setting that a message suggests, by its Options field: Hint("fp8", "on"). Each entry point spells
    it its own way (the CLI `--fp8 on`, the Python API `Options(fp8='on')`); the stages never write a spelling."""
    option: str
    value: object = None


def plain(group: tuple[Hint, ...]) -> str:
    """The spelling of a hint group where no entry point gave its own: Options fields, `fp8=on`."""
    return ", ".join(h.option if h.value is None else f"{h.option}={h.value}" for h in group)


class Said(str):
    """A message with slots {0}, {1}, ... where it suggests option settings, and the Hint groups for them (a group
    is one suggestion of one or more settings: "--triton on --conv-kernel on"). As a str it is the template; `spell`
    fills the slots. Joining two with + keeps both's hints."""

    hints: tuple[tuple[Hint, ...], ...]

    def __new__(cls, template: str, *groups) -> "Said":
        self = super().__new__(cls, template)
        self.hints = tuple(tuple(g) if isinstance(g, (tuple, list)) else (g,) for g in groups)
        return self

    def spell(self, spell: Callable[[tuple[Hint, ...]], str] | None = None) -> str:
        words = [str((spell or plain)(g)) for g in self.hints]  # (a caller's spell that fails: its own error)
        try:  # (a template without hints may still hold escaped braces from join: format unescapes them)
            return str.format(self, *words)
        except (IndexError, KeyError, ValueError):  # plain text with braces of its own, never escaped
            return str(self)

    def __add__(self, other: str) -> "Said":
        return join(self, other)

    def __radd__(self, other: str) -> "Said":
        return join(other, self)

    def __reduce__(self):  # (pickles and deep-copies with its hints)
        return (type(self), (str(self), *self.hints))


def _template(text: str) -> str:
    return str(text) if isinstance(text, Said) else str(text).replace("{", "{{").replace("}", "}}")


_SLOT = re.compile(r"(?<!\{)\{(\d+)\}(?!\})")  # a slot; not an escaped {{0}}


def join(*parts: str) -> "Said":
    """parts (Said or plain text) as one Said, their slots renumbered in order."""
    out, hints = [], []
    for t in parts:
        n = len(hints)
        out.append(_SLOT.sub(lambda m: f"{{{int(m.group(1)) + n}}}", _template(t)))
        hints.extend(getattr(t, "hints", ()))
    return Said("".join(out), *hints)


def spelled(text: str, spell: Callable[[tuple[Hint, ...]], str] | None = None) -> str:
    """text with its hints spelled by `spell` (plain text as it is)."""
    return text.spell(spell) if isinstance(text, Said) else text


@dataclass
class StageResult:
    name: str
    status: Status
    detail: str  # a Said where it suggests settings
    data: dict = field(default_factory=dict)

    @classmethod
    def skipped(cls, name: str, why: str, **data) -> "StageResult":
        return cls(name, "skipped", why, dict(data))

    @property
    def hints(self) -> tuple[tuple[Hint, ...], ...]:
        return getattr(self.detail, "hints", ())

    def text(self, spell: Callable[[tuple[Hint, ...]], str] | None = None) -> str:
        """The detail with its hints spelled by `spell` (default: Options fields, `plain`)."""
        return spelled(self.detail, spell)

    def line(self, spell: Callable[[tuple[Hint, ...]], str] | None = None) -> str:
        mark = {"applied": "✓", "skipped": "–", "fallback": "↩"}[self.status]
        how = "" if self.status == "applied" else f"{self.status} — "
        return f"{mark} {self.name}: {how}{self.text(spell)}"


def unmeasured_gpu(device, measured_sm: tuple, kept: str, option: str) -> Said | None:
    """None on a CUDA GPU of a measured compute capability (or off CUDA); else the skip reason for a stage whose
    policy was measured only there: `kept` is what stays instead, `option` the Options field that forces the stage.
    device: a torch.device, or anything with `type` and `capability` (the stage table's DeviceInfo)."""
    import torch

    if getattr(device, "type", None) != "cuda":
        return None
    cap = getattr(device, "capability", None) or torch.cuda.get_device_capability(device)
    if cap in measured_sm:
        return None
    where = ", ".join(f"sm_{a}{b}" for a, b in measured_sm)
    return join(f"tuned for {where} only; {kept} kept on sm_{cap[0]}{cap[1]} (", Said("{0} to force)",
                                                                                       Hint(option, "on")))


class BoundForward:
    """`module.forward = BoundForward(fn, module)`: what types.MethodType(fn, module) does, but it pickles, so that
    torch.save of a whole optimized model works (a bound method pickles as a lookup of fn's name on the module,
    which fails). fn must be a module-level function; `__func__` / `__self__` as on a bound method."""

    def __init__(self, func: Callable, module) -> None:
        self.__func__ = func
        self.__self__ = module

    def __call__(self, *args, **kwargs):
        return self.__func__(self.__self__, *args, **kwargs)

    def __repr__(self) -> str:
        return f"<vaeopt forward {self.__func__.__qualname__} of {type(self.__self__).__name__}>"


def unhooked(m) -> bool:
    """m runs as its class's forward with nothing around it: no forward (pre-)hooks, and no per-instance `forward`
    other than vaeopt's own BoundForward patches. accelerate's offload hooks and diffusers' HookRegistry (group
    offloading, layerwise casting) replace `module.forward` per instance. Code that runs a module's weights
    directly (fused kernels, derived weights) instead of calling the module takes only such modules; a hooked one is
    called, or left as it is, so its hooks still fire and see what they expect."""
    if m._forward_hooks or m._forward_pre_hooks:
        return False
    return _own_forward(m)


def _own_forward(m) -> bool:
    """m.forward is its class's, or one of vaeopt's BoundForward patches (not accelerate's / diffusers' wrappers)."""
    return class_forward(m) or isinstance(m.__dict__.get("forward"), BoundForward)


def _foreign(hooks) -> bool:
    """Any hook in this dict other than vaeopt's own that leave activations' values as they are (marked
    `vaeopt_keeps_activations`: fp8 weight storage, the decoder's layout hooks)."""
    return any(not getattr(h, "vaeopt_keeps_activations", False) for h in hooks.values())


def foreign_global_hooks() -> bool:
    """torch's global module (pre-)hooks hold one that may see or change activations."""
    from torch.nn.modules import module as M

    return _foreign(M._global_forward_hooks) or _foreign(M._global_forward_pre_hooks)


def foreign_hooks(m) -> bool:
    """m carries a forward (pre-)hook that may see or change activations."""
    return _foreign(m._forward_hooks) or _foreign(m._forward_pre_hooks)


def foreign_hooked(root) -> str | None:
    """The name of the first module under `root` (root included; "" is root) that carries a hook or a per-instance
    forward that is not vaeopt's own, or "<global>" for torch's global module hooks; None when there is none. For
    code that runs a whole module tree without calling its modules (Wan's chunk decoder): with such a hook present
    it must take the stock path, or the hook would silently not fire."""
    if foreign_global_hooks():
        return "<global>"
    return next((name for name, m in root.named_modules() if foreign_hooks(m) or not _own_forward(m)), None)


def class_forward(m) -> bool:
    """m.forward is its class's own: no per-instance forward, or the bound class forward that removing a hook puts
    back (accelerate's remove_hook_from_module, diffusers' HookRegistry.remove_hook)."""
    fwd = m.__dict__.get("forward")
    return fwd is None or (getattr(fwd, "__self__", None) is m and getattr(fwd, "__func__", None) is type(m).forward)


def needs_autograd(x, *params) -> bool:
    """Grad mode is on and x or one of the weights needs a gradient. Our kernels (and weights derived once, e.g. phase
    or tap matrices) have no backward: such calls take the torch ops, or autograd would silently drop gradients.
    params: tensors (None allowed) or modules, whose parameters are looked at only when grad mode is on."""
    import torch

    if not torch.is_grad_enabled():
        return False
    for t in (x, *params):
        ts = t.parameters() if isinstance(t, torch.nn.Module) else (t,)
        if any(isinstance(p, torch.Tensor) and p.requires_grad for p in ts):
            return True
    return False


_EPOCH = 0  # bumped by refresh_weights(): every derived-weight cache key holds it


def weight_version(w) -> tuple:
    """Identifies a weight version for derived-weight caches (tap matrices, phase and stacked weights, packed conv
    weights): storage, version counter and the refresh epoch. An in-place edit bumps the version counter, except
    through `param.data` and on inference tensors (a model built or loaded under torch.inference_mode, as ComfyUI
    does), which have none: load_state_dict bumps the epoch by itself (watch_loads), other such edits need
    vaeopt.refresh()."""
    return (w.data_ptr(), -1 if w.is_inference() else w._version, _EPOCH)


def refresh_weights(*_) -> None:
    """Every derived weight is rebuilt from its source on its next use, and captured CUDA graphs are dropped
    (Pipeline checks weights_epoch). Also a load_state_dict post-hook (hence the ignored arguments)."""
    global _EPOCH
    _EPOCH += 1


_TRACKED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> (epoch, its version-counted params)


def weights_epoch(model) -> tuple:
    """The refresh epoch and the sum of the model's parameters' version counters: any counted in-place edit raises
    the sum (counters only grow). What captured CUDA graphs, which hold derived weights, are checked against before
    every replay. The parameter list is gathered once per model and epoch: walking the modules took ~0.5 ms of host
    time per SDXL decode, with the GPU idle (docs/experiments.md E44); summing a list takes ~0.01 ms. So a parameter
    replaced by a new object, like the edits torch counts no version for, needs vaeopt.refresh()."""
    entry = _TRACKED.get(model)
    if entry is None or entry[0] != _EPOCH:
        entry = (_EPOCH, [p for p in model.parameters() if not p.is_inference()])
        _TRACKED[model] = entry
    return (_EPOCH, sum(p._version for p in entry[1]))


def watch_loads(model) -> None:
    """load_state_dict on the model or its decoder parts refreshes the derived weights (once per module)."""
    for m in (model, getattr(model, "post_quant_conv", None), getattr(model, "decoder", None)):
        if m is not None and getattr(m, "_vaeopt_load_hook", None) is None:
            m._vaeopt_load_hook = m.register_load_state_dict_post_hook(refresh_weights)


DERIVED: set[str] = set()  # module attributes that hold derived-weight caches (cached_weight, packed conv weights)


def derived(*attrs: str) -> None:
    """Register module attributes that cache weights derived on the device (for free_derived)."""
    DERIVED.update(attrs)


def free_derived(model) -> None:
    """Drop every derived-weight cache under model. They are rebuilt on their next use. Used after each decode of a
    VAE under model CPU offload: its weights come back at a new address every time (so the caches would be rebuilt
    anyway), and the old ones would otherwise stay on the GPU while the VAE is offloaded."""
    drop_attrs(model, *DERIVED)


def cached_weight(module, attr: str, dtype, make: Callable):
    """make() -- a tensor derived from module.weight in `dtype` -- cached on the module under `attr`, recomputed
    when the weight changes (version, storage, device) or another dtype is asked for."""
    DERIVED.add(attr)
    w = module.weight
    key = (*weight_version(w), dtype, w.device)
    cached = getattr(module, attr, None)
    if cached is None or cached[0] != key:
        cached = (key, make())
        setattr(module, attr, cached)
    return cached[1]


def drop_attrs(model, *attrs: str) -> None:
    """Remove the given attributes (a stage's marks and caches) from every submodule."""
    for m in model.modules():
        for a in attrs:
            if hasattr(m, a):
                delattr(m, a)
