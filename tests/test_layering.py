"""The house's layering, read from the source: every import points down, and nothing goes round in a circle.

Every .py under betelgeuse/ and services/ is parsed (the generated services/pb/ aside), and every import
counts, the lazy ones inside functions included: a lazy import is still a dependency, only a late one.

- betelgeuse/ is the library: it never imports the application (services/) or the wire stacks
  (grpc, protobuf, FastAPI, Starlette, uvicorn).
- No two modules import each other, directly or round a longer circle.
- The rooms of betelgeuse (its subpackages and top-level modules) stand on floors (FLOORS below): a module
  imports only rooms on its own floor or beneath it, and no two rooms import each other. services/ stands
  above the whole library.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("betelgeuse", "services")
GENERATED = ("services/pb/betelgeuse",)          # protoc output (services/codegen.py), not ours to lay out

# The floors of the library, bottom to top: a room may import rooms on its own floor or below. A room is a
# top-level module or a subpackage of betelgeuse.
FLOORS: tuple[tuple[str, ...], ...] = (
    # the shared vocabulary and leaf utilities: requests and events, sampling, errors, configuration, logs
    ("__init__", "errors", "api", "sampling", "config", "settings", "logs", "metrics", "sdnotify", "gc_pauses", "chat",
     "routing_stats", "routing_approx"),      # routing_approx: the approximate modes' selection (model uses it)
    ("gguf",),                                   # the file format: reader, header, quant types, synthetic writers
    # text: the tokenizer (built from a GGUF's vocabulary), stop strings, tool calls, reasoning, grammars
    ("tokenizer", "textstream", "toolcalls", "reasoning", "grammar"),
    ("kernels",),                                # expert math over slots: the torch reference and Triton
    ("model", "routing"),                        # the architectures' forward passes; routing traces through them
    ("store",),                                  # the expert store: arena, directory, reads, residency
    ("worker",),                                 # engine, runner, caches
    ("assembly",),                               # the composition root: store + client + runner / engine from a config
)
# the same room twice would make the order ambiguous
assert len({r for f in FLOORS for r in f}) == sum(len(f) for f in FLOORS)

FORBIDDEN_IN_LIBRARY = ("services", "grpc", "google.protobuf", "fastapi", "starlette", "uvicorn")


@dataclass(frozen=True, slots=True)
class Import:
    src: str          # importing module, dotted
    dst: str          # imported module (or package), dotted
    where: str        # "path:line" of the import statement

    def __str__(self) -> str:
        return f"{self.where}: {self.src} imports {self.dst}"


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _sources() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if any(rel.startswith(g) for g in GENERATED):
                continue
            out[_module_name(path)] = path
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str:
    """A dotted name as the module it lands in: `betelgeuse.worker.api.X` -> `betelgeuse.worker.api`."""
    while name and name not in modules and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def _imports(modules: dict[str, Path]) -> list[Import]:
    """Every import statement of every module, lazy ones included, as (importer, imported module, place)."""
    out = []
    for mod, path in modules.items():
        is_pkg = path.name == "__init__.py"
        where = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:                    # relative: from the importer's package
                    pkg = mod if is_pkg else mod.rsplit(".", 1)[0]
                    for _ in range(node.level - 1):
                        pkg = pkg.rsplit(".", 1)[0]
                    base = f"{pkg}.{base}" if base else pkg
                # `from pkg import mod` names a module; `from mod import obj` names the module itself
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for name in names:
                dst = _resolve(name, modules) if name.split(".")[0] in PACKAGES else name
                if dst != mod:
                    out.append(Import(mod, dst, f"{where}:{node.lineno}"))
    return out


def _room(mod: str) -> str | None:
    """The room of a library module: `betelgeuse.worker.engine` -> `worker`, `betelgeuse.api` -> `api`."""
    parts = mod.split(".")
    if parts[0] != "betelgeuse":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def _floor(room: str) -> int:
    for i, rooms in enumerate(FLOORS):
        if room in rooms:
            return i
    raise AssertionError(f"betelgeuse/{room} stands on no floor: add it to FLOORS in tests/test_layering.py")


def _cycles(edges: dict[str, dict[str, Import]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each as a sorted list of nodes."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def _graph(imports: list[Import], key) -> dict[str, dict[str, Import]]:
    """{a: {b: first import making a -> b}} with nodes mapped through key (None drops the import)."""
    g: dict[str, dict[str, Import]] = {}
    for imp in imports:
        a, b = key(imp.src), key(imp.dst)
        if a is None or b is None or a == b:
            continue
        g.setdefault(a, {}).setdefault(b, imp)
    return g


def _explain(comp: list[str], g: dict[str, dict[str, Import]]) -> str:
    inside = set(comp)
    lines = [str(imp) for a in comp for b, imp in sorted(g.get(a, {}).items()) if b in inside]
    return f"circle through {', '.join(comp)}:\n    " + "\n    ".join(lines)


MODULES = _sources()
IMPORTS = _imports(MODULES)


def test_sources_found():
    assert "betelgeuse.worker.engine" in MODULES and "services.worker_main" in MODULES
    assert len(IMPORTS) > 100


def test_library_never_imports_the_application():
    bad = [imp for imp in IMPORTS if imp.src.split(".")[0] == "betelgeuse"
           and any(imp.dst == f or imp.dst.startswith(f + ".") for f in FORBIDDEN_IN_LIBRARY)]
    assert not bad, "betelgeuse/ imports the application or a wire stack:\n  " + "\n  ".join(map(str, bad))


def test_no_module_cycles():
    g = _graph(IMPORTS, lambda m: m if m in MODULES else None)
    comps = _cycles(g)
    assert not comps, "modules import each other:\n  " + "\n  ".join(_explain(c, g) for c in comps)


def test_no_subpackage_cycles():
    g = _graph(IMPORTS, _room)
    comps = _cycles(g)
    assert not comps, "rooms of betelgeuse import each other:\n  " + "\n  ".join(_explain(c, g) for c in comps)


def test_imports_point_down_the_floors():
    up = []
    for imp in IMPORTS:
        a, b = _room(imp.src), _room(imp.dst)
        if a is None or b is None or a == b:
            continue
        if _floor(b) > _floor(a):
            up.append(f"{imp} (floor {_floor(a)} -> floor {_floor(b)})")
    assert not up, "imports that climb a floor:\n  " + "\n  ".join(up)


# Levels inside a room, bottom to top, for the modules listed (others are not placed): the runner drives objects
# passed in below it, none of which imports it back; the model's ground (its interface, the registry, the pass
# chunks) imports no architecture.
LEVELS: dict[str, tuple[tuple[str, ...], ...]] = {
    "worker": (
        ("engram_feed",),
        ("stats", "graphs", "expert_cache"),
        ("store_session", "group_graphs"),
        ("moe_step", "lanes"),
        ("decode_graphs",),
        ("runner",),
        ("scheduler", "inputs", "kv_manager", "outputs"),
        ("engine",),
    ),
    "model": (
        ("interface", "registry", "chunks", "layers", "kv_cache", "weights", "engram"),
        ("reference",),
        ("qwen3moe", "deepseek4"),
        ("deepseek41",),                         # V4's model with V4.1's deltas
    ),
}


def test_imports_point_down_inside_the_rooms():
    up = []
    for room, levels in LEVELS.items():
        level = {f"betelgeuse.{room}.{m}": i for i, names in enumerate(levels) for m in names}
        assert all(m in MODULES for m in level), sorted(set(level) - set(MODULES))
        for imp in IMPORTS:
            a, b = level.get(imp.src), level.get(imp.dst)
            if a is not None and b is not None and b > a:
                up.append(f"{imp} (level {a} -> level {b} of {room}/)")
    assert not up, "imports that climb inside a room:\n  " + "\n  ".join(up)


# the engine's scheduling policy stands alone: unit-tested on fake sequences without torch (tests/worker/test_scheduler.py)
POLICY_ONLY = {"betelgeuse.worker.scheduler": ("__future__", "time", "collections", "dataclasses", "typing")}


def test_policy_modules_import_only_the_standard_library():
    bad = [str(imp) for imp in IMPORTS if imp.src in POLICY_ONLY
           and imp.dst.split(".")[0] not in POLICY_ONLY[imp.src]]
    assert not bad, "a policy-only module imports more than its allowed standard modules:\n  " + "\n  ".join(bad)
