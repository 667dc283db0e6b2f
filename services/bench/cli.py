"""`betelgeuse bench`: create or reuse the benchmark model, run the harness, write JSON/markdown/PNG.

    betelgeuse bench --model /var/tmp/bench.gguf --memory-max 12G --vram-budget 12GiB --time-budget 480
    betelgeuse bench --quick            # a small model on the CPU: checks the whole path in ~1 minute
    betelgeuse bench --suite agents     # serving: agent-loop TTFT with/without the prefix cache, concurrent clients
    betelgeuse bench --routing exact,pool   # each case in exact routing, then in the APPROXIMATE pool mode beside it
    betelgeuse bench --suite serve      # the live service (`betelgeuse serve`, both processes, cgroup) over HTTP

`add_parser(subparsers)` registers the subcommand; `run(args) -> int` runs it (exit code). Also
runnable as `python -m services.bench.cli ...`.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

from betelgeuse.errors import BetelgeuseError, InvalidRequestError
from services.bench.args import (add_engine_flags, bench_argv, engine_from_args, ensure_model, opt_reader, options_record,
                                 parse_ints, parse_slots, target, variant_specs)

QUICK = {"preset": "small", "layers": 4, "prompts": "8,16", "standard_prompts": "8", "decode": 4, "slots": "2+6,auto",
         "device": "cpu", "budget.memory_max": "4G", "budget.vram": "2GiB", "time_budget": 150.0, "variant_layers": 2,
         "standard_cap": 10.0, "decode_cap": 10.0, "disk_sample": "32MiB"}


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench", help="benchmark prefill/decode against measured ceilings",
                              description=__doc__.splitlines()[0])
    p.add_argument("--model", help="benchmark GGUF; written from --preset if it does not exist "
                                   "(default: WORK_DIR/<preset>-L<layers>-<router>-seed<n>.gguf)")
    p.add_argument("--work-dir", default="/var/tmp/betelgeuse-bench", help="models, sockets, store logs")
    p.add_argument("--out", help="results folder (default docs/benchmarks/RUN_NAME)")
    p.add_argument("--run-name", help="default: <date>-<device>")
    p.add_argument("--preset", help="synth preset for a model that must be written (default bench)")
    p.add_argument("--layers", type=int, help="override the preset's layer count")
    p.add_argument("--router", choices=["preset", "calibrated", "uniform"],
                   help="the model's router: preset (its router skew, default), calibrated (popularity and temporal "
                        "locality fitted to real decode statistics), uniform (the worst case for caching)")
    p.add_argument("--router-skew", type=float, help="override the preset's router skew")
    p.add_argument("--qtype", help="the preset's weight type (synth --qtype: Q8_0, Q4_K, Q2_K, IQ2_XXS, ..., Q4_K_M; "
                                   "deepseek4: the experts' type)")
    p.add_argument("--variant-skew", default=None,
                   help="routers of smaller comparison models, comma-separated: a skew, 'uniform' or 'calibrated' "
                        "('none': no variant; default 0 = uniform)")
    p.add_argument("--variant-layers", type=int, help="layers of the comparison models (default 8)")
    p.add_argument("--routing-trace", help="drive every pass's expert choices from this routing trace (betelgeuse "
                                           "routing convert; a recorded --record-routing file) instead of the router: "
                                           "measures caching and I/O on that routing; outputs are MEANINGLESS")
    p.add_argument("--device", help="auto | cpu | cuda | cuda:N (default auto)")
    p.add_argument("--no-cgroup", action="store_true", help="do not create a cgroup (the store still plans to --memory-max)")
    p.add_argument("--slots", help="slot configurations, 'V+H' or 'auto', comma-separated (default 5+15,auto)")
    p.add_argument("--prompts", help="prompt lengths, comma-separated (default 64,512)")
    p.add_argument("--standard-prompts", help="prompt lengths also run with the standard schedule (default 64)")
    p.add_argument("--decode", type=int, help="decode tokens after the warm pass (default 128)")
    p.add_argument("--time-budget", type=float, help="seconds for the whole run, model writing included (default 480)")
    p.add_argument("--standard-cap", type=float, help="seconds per standard pass before it is cut (default 20)")
    p.add_argument("--decode-cap", type=float, help="seconds per decode run before it is cut (default 20)")
    p.add_argument("--gpu-marks", action="store_true",
                   help="cut decode's idle chain 'gpu' link at the device's steps (copy / group / attn / route / sync):"
                        " timing events and a sync a token more, so the run's TG is not comparable with runs without")
    p.add_argument("--no-graphs-warm", action="store_true",
                   help="no decode graphs captured before the warm pass (ModelRunner.warm_graphs): the timed decode's "
                        "first two tokens run eagerly and capture, as a new sequence's did before graphs57")
    p.add_argument("--disk-sample", help="bytes per disk ceiling sample (default 1GiB)")
    p.add_argument("--disk-depths", help="also the disk's depth curve before the cases: the random pattern at each of "
                                         "these experts in flight, comma-separated (e.g. 1,2,4,8,19; default off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="small model on the CPU, few tokens: validates the whole path")
    p.add_argument("--suite", choices=["passes", "agents", "serve"], default="passes",
                   help="passes: prefill/decode passes against ceilings (default); agents: the scheduler under agent "
                        "loops and concurrent clients (services/bench/agents.py); serve: the live `betelgeuse serve` "
                        "over its OpenAI HTTP API (services/bench/serve.py)")
    from services.bench import agents, serve
    agents.add_arguments(p)
    serve.add_arguments(p)
    add_engine_flags(p)
    p.set_defaults(func=run)
    return p


_opt = opt_reader(QUICK)


def run(args) -> int:
    if getattr(args, "suite", "passes") == "agents":
        from services.bench.agents import run as run_agents
        return run_agents(args)
    if getattr(args, "suite", "passes") == "serve":
        from services.bench.serve import run as run_serve
        return run_serve(args)
    t0 = time.monotonic()
    from betelgeuse.settings import parse_size
    from services.bench.harness import BENCH_ENGINE, BenchOptions, Harness
    from services.bench.report import machine_info, write_results

    def log(msg):
        print(f"[bench {time.monotonic() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    device, work, preset, spec, model, run_name, out = target(args, _opt, "")
    routings = parse_routings(args)
    engine = engine_from_args(args, QUICK, str(model), device, suite=BENCH_ENGINE)
    variants = variant_specs(_opt(args, "variant_skew", "0"), preset, _opt(args, "variant_layers", 8), args.seed,
                             args.qtype)
    if args.routing_trace:
        _check_trace(args.routing_trace, None if args.model else spec)
        if variants:
            log("--routing-trace: the comparison models are skipped (the trace fits one geometry)")
            variants = []
    results = {"run": run_name, "status": "running", "command": shlex.join(["betelgeuse", "bench"] + bench_argv(args)),
               "device": device, "machine": machine_info(), "models": {}, "cases": [], "skipped": [], "errors": []}
    save = lambda final: write_results(results, out, png=final)        # noqa: E731
    vpaths = [model.with_name(f"{model.stem}-variant-L{vspec.n_layer}-{label}.gguf") for label, vspec in variants]
    for n, ((label, vspec), vpath) in enumerate(zip(variants, vpaths)):
        from betelgeuse.gguf.synth import model_nbytes
        if not vpath.exists():   # said before any work, so a user can stop before gigabytes are written
            log(f"this run also writes {'a second' if n == 0 else 'another'} model, {vpath} "
                f"({model_nbytes(vspec) / 1e9:.1f} GB, router {label}), to compare routers; --variant-skew none "
                "skips it")
    results["models"]["main"] = ensure_model(model, spec, log)
    done = []
    for n, ((label, vspec), vpath) in enumerate(zip(variants, vpaths)):
        try:
            results["models"]["variant" if n == 0 else f"variant{n + 1}"] = ensure_model(vpath, vspec, log)
            done.append((label, str(vpath)))
        except BetelgeuseError as e:
            results["skipped"].append({"case": f"variant model ({label})", "reason": str(e)})
    o = BenchOptions(model=str(model), engine=engine, variants=tuple(done), device=device,
                     slots=parse_slots(_opt(args, "slots", "5+15,auto")),
                     prompts=parse_ints(_opt(args, "prompts", "64,512"), "--prompts"),
                     standard_prompts=parse_ints(_opt(args, "standard_prompts", "64"), "--standard-prompts"),
                     decode=int(_opt(args, "decode", 128)), cgroup=not args.no_cgroup,
                     time_budget=float(_opt(args, "time_budget", 480.0)), t0=t0,
                     standard_cap=float(_opt(args, "standard_cap", 20.0)), decode_cap=float(_opt(args, "decode_cap", 20.0)),
                     disk_sample_bytes=parse_size(_opt(args, "disk_sample", "1GiB"), "--disk-sample"),
                     seed=args.seed, run_dir=str(work / f"run-{os.getpid()}"), routing_trace=args.routing_trace,
                     routings=routings or (engine.routing,), gpu_marks=bool(getattr(args, "gpu_marks", False)),
                     graphs_warm=not getattr(args, "no_graphs_warm", False),
                     disk_depths=parse_ints(args.disk_depths, "--disk-depths") if args.disk_depths else ())
    results["options"] = options_record(o)
    log(f"device {device}; results -> {out}")
    from services.bench.report import run_recorded
    return run_recorded(results, save, Harness(o, results, save).run, log)


def parse_routings(args) -> tuple[str, ...]:
    """The passes suite's --routing takes a comma-separated list (each main-model case runs in each mode, e.g.
    exact,pool); the engine key gets the first. () when the flag is not given (the settings decide)."""
    from betelgeuse.routing_approx import ROUTING_MODES
    text = getattr(args, "engine.routing", None)
    if text is None:
        return ()
    modes = tuple(x.strip() for x in str(text).split(",") if x.strip())
    bad = [m for m in modes if m not in ROUTING_MODES]
    if not modes or bad or len(set(modes)) != len(modes):
        raise InvalidRequestError(f"--routing {text!r}: expected distinct modes of {', '.join(ROUTING_MODES)}, "
                                  "comma-separated (e.g. exact,pool)")
    setattr(args, "engine.routing", modes[0])
    return modes


def _check_trace(path: str, spec) -> None:
    """A --routing-trace that cannot drive the model is refused before anything is written."""
    from betelgeuse.errors import InvalidRequestError
    from betelgeuse.routing.trace import read_trace
    try:
        h = read_trace(path).header
    except OSError as e:
        raise InvalidRequestError(f"--routing-trace {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise InvalidRequestError(f"--routing-trace {e}") from None
    if spec is not None and (h["n_layer"], h["n_expert"], h["k"]) != (spec.n_layer, spec.n_expert, spec.n_expert_used):
        raise InvalidRequestError(f"--routing-trace {path} is for {h['n_layer']} layers x {h['n_expert']} experts "
                                  f"top-{h['k']}; the model is {spec.n_layer} x {spec.n_expert} "
                                  f"top-{spec.n_expert_used}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="betelgeuse")
    sub = parser.add_subparsers(dest="cmd", required=True)
    add_parser(sub)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(["bench"] + argv)
    args.argv = argv
    try:
        return args.func(args)
    except BetelgeuseError as e:
        print(f"betelgeuse: error: {e}", file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":
    raise SystemExit(main())
