"""The kernels layer and the quantization package import one way (read from the source, nothing is run).

Kernels import nothing of vaeopt outside vaeopt/kernels, no kernel file takes another's underscore names, and the
kernel files form no import cycle (function-level imports counted); vaeopt/quant imports no stage.
"""

import ast
from pathlib import Path

import vaeopt

PKG = Path(vaeopt.__file__).resolve().parent


def _imports(path: Path) -> list[tuple[str, str | None]]:
    """(module, imported name or None) of every vaeopt import in the file, wherever it sits."""
    out = []
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.Import):
            out += [(a.name, None) for a in n.names if a.name.split(".")[0] == "vaeopt"]
        elif isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "vaeopt":
            out += [(n.module, a.name) for a in n.names]
    return out


def _kernel_edges() -> dict[str, set[str]]:
    files = {p.stem: p for p in (PKG / "kernels").glob("*.py")}
    edges = {}
    for stem, p in files.items():
        deps = set()
        for mod, name in _imports(p):
            target = mod.split(".")[2] if mod.count(".") >= 2 else (name if name in files else "__init__")
            deps.add(target)
        edges[stem] = deps - {stem}
    return edges


def test_kernels_import_only_kernels():
    for p in (PKG / "kernels").glob("*.py"):
        outside = [m for m, _ in _imports(p) if not (m == "vaeopt.kernels" or m.startswith("vaeopt.kernels."))]
        assert not outside, f"{p.name} imports {outside}"


def test_no_private_names_across_kernel_files():
    for p in (PKG / "kernels").glob("*.py"):
        private = [(m, n) for m, n in _imports(p) if n and n.startswith("_") and not n.startswith("__")]
        assert not private, f"{p.name} imports {private}"


def test_kernel_files_form_no_cycle():
    edges = _kernel_edges()
    edges["__init__"] = edges.get("__init__", set())
    state = {}

    def visit(v, path):
        state[v] = "open"
        for w in edges.get(v, ()):
            if w == "__init__" and v != "__init__":
                raise AssertionError(f"{v}.py imports the package itself: take the name from common.py")
            if state.get(w) == "open":
                raise AssertionError("cycle: " + " -> ".join(path + [w]))
            if w not in state:
                visit(w, path + [w])
        state[v] = "done"

    for v in edges:
        if v not in state:
            visit(v, [v])


def test_quant_imports_no_stage():
    for p in (PKG / "quant").glob("*.py"):
        stages = [m for m, _ in _imports(p) if m.startswith("vaeopt.stages") or m == "vaeopt.pipeline"]
        assert not stages, f"quant/{p.name} imports {stages}"
