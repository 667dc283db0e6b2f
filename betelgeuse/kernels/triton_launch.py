"""Triton launches, counted per kernel name; the variants launched (on request) and the compiles (in-memory cache
misses) with their seconds.

`launcher(kernel)` wraps a @triton.jit kernel (or the interpreter's, under TRITON_INTERPRET=1): `wrapped[grid](*args,
**kw)` adds one to COUNTS[kernel name] and calls `kernel[grid](*args, **kw)`, Triton's own JIT dispatch, unchanged.
COUNTS is what the tests and profiles bound launches per layer with (tests/scripts/triton_engine_check.py,
deploy/device/profile_pass.py).

Variants (issue 21): Triton compiles one kernel per distinct key of a launch: its constexpr keywords, num_warps /
num_stages, and each runtime argument's specialization (a tensor's dtype and whether its address is a multiple of 16
bytes; an int == 1 (a constant then), a multiple of 16, or neither; unless the kernel says do_not_specialize). A key
first seen inside a timed decode step is a compile there (~0.3-1.5 s on the device's host). `record_variants()`
makes every launch add its key to VARIANTS (a set of (kernel name, keywords, argument specializations)): off by
default (one global test a launch), the tests compare the keys a decode launched with those a warm-up launched.
The specializations are Triton's own (`native_specialize_impl`, the JIT's binder's rule, with the base backend's
view of tensors).

Compiles: `watch_compiles()` chains triton.knobs.runtime.jit_cache_hook (called before each in-memory cache miss's
compile, Triton 3.6 and 3.9 alike; a truthy return would skip the compile: ours returns the chained hook's) and
jit_post_compile_hook (after it); each miss is one COMPILES entry (kernel name, its constexprs, seconds between the
two: a full compile, or a load from Triton's disk cache, ~ms; the module's load onto the GPU at its first launch is
not in it). `compiles_since(mark)` gives a timed region's {"count", "seconds", "names"}; where the hooks cannot be set
(no Triton, the interpreter: nothing compiles there, a release without the knobs) it says {"count": None, "na": why}.
Each compile's resources (registers and local bytes per thread, shared bytes: `resources`) are read from the JIT's
cache when compiles_since is asked, not in the hook: neither release's post-compile hook is handed the
CompiledKernel, and its registers and local bytes exist only once its module is loaded, at its first launch. A
variant with local bytes (spills) sizes the driver's local-memory reservation (its bytes x every resident thread of
the GPU, kept for the context's life: VRAM outside torch's allocator, issue 21), so it is named in "spilling".

`cdiv` / `pow2`: triton.cdiv / triton.next_power_of_2 for the host's grid and constexpr arithmetic. Triton's are
constexpr functions (for kernels too): called from the host, each unwraps its arguments first, ~9 us a call on the
CPU here (a launch took four: 36 us of Python per expert group's two launches); these are the same integer formulas.

Triton's dispatch (argument binding, per-argument specialization, the cache key) costs ~36 us of host a launch on the
H200 machine (Triton 3.6). Launching the CompiledKernel directly, keyed by our own copy of the JIT's specialization
rules, was measured there and saved nothing (one gate_up launch 35.9 us through the JIT, 35.5 us direct; decode steps
8.5 ms either way), so the launches go through the JIT: no copy of its rules to fall out of step with a release.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections import Counter

COUNTS: Counter = Counter()               # launches per kernel name (tests, profiles)
VARIANTS: set | None = None               # record_variants(): (name, keywords, argument specializations) launched
COMPILES: list = []                       # watch_compiles(): (kernel name, constexprs "K=v,..", seconds, where) per
#                                           miss; where: (JITFunction, device, key) to find its CompiledKernel later
_WATCH: dict = {"na": "not watched"}      # "na": why compiles are not counted (absent once the hooks are set)
_LOCK = threading.Lock()


class Launcher:
    """`launcher(kernel)[grid](*args, **kw)`: counted, then `kernel[grid](*args, **kw)` (module doc)."""

    __slots__ = ("kernel", "name", "_params")

    def __init__(self, kernel):
        self.kernel = kernel
        self.name = getattr(kernel, "__name__", None) or getattr(getattr(kernel, "fn", None), "__name__", "kernel")
        self._params = None               # per positional parameter (constexpr, no value spec., no alignment spec.)

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def counted(*args, **kw):
            COUNTS[self.name] += 1
            if VARIANTS is not None:
                VARIANTS.add(self.variant(args, kw))
            return launch(*args, **kw)
        return counted

    def variant(self, args: tuple, kw: dict) -> tuple:
        """The compile key of a launch with these arguments, as Triton specializes them (module doc)."""
        if self._params is None:
            self._params = _param_flags(self.kernel)
        spec = []
        for i, a in enumerate(args):
            const, dns, dna = self._params[i] if i < len(self._params) else (False, False, False)
            spec.append(("constexpr", a) if const else _specialize(a, not dns, not dna))
        return self.name, tuple(sorted(kw.items())), tuple(spec)


def _param_flags(kernel) -> list[tuple[bool, bool, bool]]:
    """(constexpr, do_not_specialize, do_not_specialize_on_alignment) per parameter of a @triton.jit kernel (the JIT's
    KernelParam) or of the interpreter's (its decorator keywords, the annotations)."""
    params = getattr(kernel, "params", None)
    if params is not None:
        return [(bool(p.is_constexpr), bool(p.do_not_specialize), bool(p.do_not_specialize_on_alignment))
                for p in params]
    import inspect
    kw = getattr(kernel, "kwargs", {}) or {}
    dns, dna = set(kw.get("do_not_specialize") or ()), set(kw.get("do_not_specialize_on_alignment") or ())
    out = []
    for i, p in enumerate(inspect.signature(kernel.fn).parameters.values()):
        const = "constexpr" in str(p.annotation)
        out.append((const, i in dns or p.name in dns, i in dna or p.name in dna))
    return out


def _specialize(a, value: bool, align: bool):
    """Triton's specialization of one runtime argument (its binder's native rule), hashable."""
    try:
        from triton.backends.compiler import BaseBackend
        from triton.runtime.jit import native_specialize_impl
        return native_specialize_impl(BaseBackend, a, False, value, align)
    except (ImportError, AttributeError, TypeError):        # another release: the documented rule
        if isinstance(a, bool) or a is None or isinstance(a, float):
            return type(a).__name__, a if a is None else None
        if isinstance(a, int):
            if value and a == 1:
                return "constexpr", 1
            return "int", ("D" if value and a % 16 == 0 else "")
        if hasattr(a, "data_ptr"):
            return str(a.dtype), ("D" if align and a.data_ptr() % 16 == 0 else "")
        return type(a).__name__, None


def record_variants(on: bool = True) -> set | None:
    """Start (a new, empty VARIANTS) or stop recording the launches' compile keys; returns the set recorded."""
    global VARIANTS
    got = VARIANTS
    VARIANTS = set() if on else None
    return VARIANTS if on else got


def watch_compiles() -> bool:
    """Count Triton's compiles from now on (module doc; idempotent). False, with the reason in compiles_since's "na",
    where the hooks cannot be set."""
    with _LOCK:
        if "na" not in _WATCH:
            return True
        if os.environ.get("TRITON_INTERPRET") == "1":
            _WATCH["na"] = "interpreter (nothing compiles)"
            return False
        try:
            from triton import knobs
            rt = knobs.runtime
            rt.jit_cache_hook, rt.jit_post_compile_hook     # noqa: B018  (both present: Triton >= 3.4)
        except Exception as e:                              # no Triton, or a release without the knobs
            _WATCH["na"] = f"no compile hooks ({type(e).__name__})"
            return False
        pre, post = rt.jit_cache_hook, rt.jit_post_compile_hook
        started: dict = {}

        def before(**kw):
            started[_hook_key(kw)] = time.perf_counter()
            return pre(**kw) if pre is not None else None   # truthy: Triton skips the compile (the chained hook's)

        def after(**kw):
            t1 = time.perf_counter()
            t0 = started.pop(_hook_key(kw), t1)
            COMPILES.append((_hook_name(kw), _constexprs(kw), t1 - t0, _where(kw)))
            return post(**kw) if post is not None else None
        rt.jit_cache_hook, rt.jit_post_compile_hook = before, after
        del _WATCH["na"]
        return True


def _hook_key(kw: dict):
    return id(getattr(kw.get("fn"), "jit_function", None)), str(kw.get("key"))


def _hook_name(kw: dict) -> str:
    fn = kw.get("fn")
    return str(getattr(fn, "name", None) or "kernel").rsplit(".", 1)[-1]


def _constexprs(kw: dict) -> str:
    """"NAME=value,..." of a compile's constexprs (the specialized ints == 1 among them), by parameter name."""
    try:
        names = kw["fn"].jit_function.arg_names
        consts = kw["compile"]["constants"]
        return ",".join(f"{names[p[0]] if len(p) == 1 else p}={v}" for p, v in consts.items())
    except Exception:                                       # a hook payload of another shape: the name is enough
        return ""


def _where(kw: dict) -> tuple | None:
    """(JITFunction, device, key) of a compile: where its CompiledKernel lies in the JIT's cache (resources)."""
    try:
        return kw["fn"].jit_function, kw["compile"]["device"], kw["key"]
    except (KeyError, AttributeError, TypeError):
        return None


def resources(where: tuple | None) -> dict | None:
    """A compiled variant's resources, where Triton knows them: {"regs": registers per thread, "local": local bytes
    per thread (cuFuncGetAttribute LOCAL_SIZE_BYTES: spills and stack; Triton's n_spills is it / 4), "shared": its
    shared memory bytes}; regs and local only once the module is loaded (its first launch: the post-compile hook
    runs before, so they are read here, when asked). The JIT's cache is device_caches[device][0][key] in Triton 3.6
    and 3.9 alike (its first element: the kernel cache). None where it is not found (another release, a fake)."""
    if where is None:
        return None
    try:
        jf, device, key = where
        caches = getattr(jf, "device_caches", None)
        entry = caches.get(device) if isinstance(caches, dict) else None       # .get: a defaultdict makes no entry
        kernel = entry[0].get(key) if entry else None
    except Exception:                                       # a cache of another shape: nothing known
        return None
    if kernel is None or not hasattr(kernel, "metadata"):   # not compiled yet (async), or a placeholder
        return None
    out = {"shared": getattr(kernel.metadata, "shared", None)}
    regs, spills = getattr(kernel, "n_regs", None), getattr(kernel, "n_spills", None)
    if regs is not None:
        out["regs"] = int(regs)
    if spills is not None:
        out["local"] = 4 * int(spills)
    return out


def _res_label(r: dict | None) -> str:
    """" regs 96, local 0 B, smem 32768 B" (a spilling variant: "SPILLS local 1024 B"), "" where unknown."""
    if not r:
        return ""
    parts = [f"regs {r['regs']}"] if "regs" in r else []
    if "local" in r:
        parts.append(("SPILLS local" if r["local"] else "local") + f" {r['local']} B")
    if r.get("shared") is not None:
        parts.append(f"smem {r['shared']} B")
    return (" " + ", ".join(parts)) if parts else ""


def compile_mark() -> int:
    """A point to count compiles from (compiles_since)."""
    return len(COMPILES)


def compiles_since(mark: int) -> dict:
    """The compiles since `mark`: {"count", "seconds", "names": {kernel: n}, "variants": ["kernel[K=v,..] 0.41 s
    regs 96, local 0 B, smem 32768 B"] (resources: where known), "max_local": the most local bytes per thread of
    any (a spilling variant's: the driver's local-memory reservation is that x every resident thread of the GPU, and
    is kept), "spilling": the variants with local bytes, "lmem_mib": the reservation max_local sets on this GPU},
    or {"count": None, "na": why} where they are not counted (watch_compiles)."""
    if "na" in _WATCH:
        return {"count": None, "seconds": None, "na": _WATCH["na"]}
    new = COMPILES[mark:]
    res = [resources(e[3]) for e in new]
    labels = [f"{e[0]}[{e[1]}] {e[2]:.3f} s{_res_label(r)}" for e, r in zip(new, res)]
    local = [(r["local"], lab) for r, lab in zip(res, labels) if r and r.get("local")]
    out = {"count": len(new), "seconds": sum(e[2] for e in new), "names": dict(Counter(e[0] for e in new)),
           "variants": labels[:32]}
    if any(r and "local" in r for r in res):
        out["max_local"] = max((b for b, _ in local), default=0)
        out["spilling"] = [lab for _, lab in sorted(local, key=lambda x: -x[0])[:8]]
        threads = _resident_threads()
        if threads and out["max_local"]:        # the local-memory reservation the worst variant sets, MiB
            out["lmem_mib"] = round(out["max_local"] * threads / (1 << 20), 1)
    return out


def _resident_threads() -> int | None:
    """Threads the GPU holds at once (SMs x max threads per SM: 270,336 on an H100 SXM), the multiplier of a kernel's
    local bytes per thread in the driver's local-memory reservation; None without CUDA."""
    try:
        import torch
        if not torch.cuda.is_available():
            return None
        p = torch.cuda.get_device_properties(torch.cuda.current_device())
        return int(p.multi_processor_count) * int(p.max_threads_per_multi_processor)
    except Exception:                                       # no torch, a device without these properties
        return None


def cdiv(x: int, y: int) -> int:
    """triton.cdiv on host ints: ceil(x / y)."""
    return (x + (y - 1)) // y


def pow2(n: int) -> int:
    """triton.next_power_of_2 on a host int n >= 1: the smallest power of two >= n."""
    assert n >= 1, n
    return 1 << (n - 1).bit_length()


def launcher(kernel) -> Launcher:
    """A counted launcher for a @triton.jit kernel (module doc)."""
    if type(kernel).__name__ == "InterpretedFunction":
        interpreter_shortcuts()
    return Launcher(kernel)


# interpreter_shortcuts: launches under way, ids of the lang modules patched in them; "triton": Triton's two calls
# and the interpreter's options
_INTERP_STATE: dict = {"depth": 0, "langs": frozenset()}


def interpreter_shortcuts() -> bool:
    """Two costs of Triton's interpreter (TRITON_INTERPRET=1, the CPU tests) that check nothing, off; the same
    functions on the same numpy values, so the same bits (test_triton_launch_math):
    1. A device-function call (a @triton.jit function called from a kernel: ~18,000 a launch of the MMQ kernels at
       K = 512) patches triton.language into its interpreted form again (interpreter._patch_lang: inspect.getmembers
       over tl, tl.core, tl.math, tl.tensor, ~0.7 ms a call, 40% of an interpreted launch), though the launch's
       GridExecutor patched it already and restores it only at its end (a device call's own patch is never
       restored). Here a device call patches only the first time within a launch that its module sees a lang module
       the launch has not patched yet (tl.core: tl.zeros / tl.sum's module), then runs the rewritten function as
       Triton's call does.
    2. sanitize_overflow: every int32 add / sub / mul is redone in int64 and compared with the int32 range, for a
       device_assert that the interpreter drops (its options' debug is False: semantic.device_assert returns first);
       ~25% of an interpreted launch of the mmvq kernels. Off only while debug is off (nothing was asserted).
    False (nothing changed) where the interpreter's internals are not the ones this was written against (Triton
    3.9); idempotent."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter as it
    except ImportError:
        return False
    if getattr(it, "_betelgeuse_shortcuts", False):
        return True
    need = ("GridExecutor", "InterpretedFunction", "InterpreterError", "_patch_lang", "interpreter_builder")
    if not all(hasattr(it, n) for n in need) or not hasattr(it.InterpretedFunction, "rewrite"):
        return False
    import inspect
    body = inspect.getsource(it.InterpretedFunction.__call__)       # Triton's device call: patch, rewrite, call
    if "_patch_lang(self.fn)" not in body or "self.rewrite()" not in body or body.count("\n") > 12:
        return False
    grid_call, st, seen = it.GridExecutor.__call__, _INTERP_STATE, {}
    st["triton"] = grid_call, it.InterpretedFunction.__call__, it.interpreter_builder.options   # Triton's (the test's)

    def langs(fn) -> frozenset:         # keyed by the globals' size too: a first rewrite adds the interpreter's names
        key = fn, len(fn.__globals__)
        got = seen.get(key)
        if got is None:
            got = seen[key] = frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)
        return got

    def launch(self, *args, **kw):
        prev = st["depth"], st["langs"]
        st["depth"], st["langs"] = prev[0] + 1, prev[1] | langs(self.fn)     # GridExecutor patches self.fn's langs
        try:
            return grid_call(self, *args, **kw)
        finally:
            st["depth"], st["langs"] = prev

    def device_call(self, *args, **kw):
        mine = langs(self.fn)
        if not (st["depth"] and mine <= st["langs"]):
            it._patch_lang(self.fn)
            if st["depth"]:
                st["langs"] = st["langs"] | mine
        fn = self.rewrite()
        try:
            return fn(*args, **kw)
        except Exception as e:
            raise it.InterpreterError(repr(e)) from e
    it.GridExecutor.__call__ = launch
    it.InterpretedFunction.__call__ = device_call
    opts = it.interpreter_builder.options
    if not opts.debug and opts.sanitize_overflow:
        it.interpreter_builder.options = dataclasses.replace(opts, sanitize_overflow=False)
    it._betelgeuse_shortcuts = True
    return True
