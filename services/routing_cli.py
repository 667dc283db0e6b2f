"""`betelgeuse routing`: statistics of routing traces and profiles, conversion of public trace formats to ours, and
the routing a GGUF file produces through the reference model.

    betelgeuse routing stats trace.bgrt                      # our trace format (routing/trace.py)
    betelgeuse routing stats Layer_dirs/ --format flame --k 6 --experts 64
    betelgeuse routing stats heatmap.json --format krasis --experts 128
    betelgeuse routing convert routes.jsonl out.bgrt --format jsonl --experts 60
    betelgeuse routing measure model.gguf --tokens 512 [--decode 64]

`add_parser(subparsers)` registers the subcommand (services/cli.py).
"""

from __future__ import annotations

import argparse
import json
import sys

from betelgeuse.errors import InvalidRequestError

FORMATS = ("trace", "flame", "jsonl", "strata", "krasis", "fiddler")
PROFILES = ("krasis", "fiddler")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("routing", help="routing statistics, trace conversion, a model's routing",
                              description=" ".join(__doc__.split("\n\n")[0].split()))
    sub = p.add_subparsers(dest="routing_cmd", required=True)
    s = sub.add_parser("stats", help="statistics of a trace or profile (betelgeuse/routing_stats.py)")
    s.add_argument("path")
    _source_args(s)
    s.add_argument("--json", action="store_true", help="print everything as JSON (per layer too)")
    c = sub.add_parser("convert", help="a public trace format -> our trace file")
    c.add_argument("path")
    c.add_argument("out")
    _source_args(c)
    m = sub.add_parser("measure", help="the routing of a GGUF file through the reference model, on a random prompt")
    m.add_argument("model")
    m.add_argument("--tokens", type=int, default=512)
    m.add_argument("--decode", type=int, default=0, help="greedy tokens after the prompt")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--record", help="also write the trace here (our format)")
    m.add_argument("--json", action="store_true")
    p.set_defaults(run=run)
    return p


def _source_args(p):
    p.add_argument("--format", choices=FORMATS, default="trace")
    p.add_argument("--experts", type=int, help="experts per layer (needed by every format but ours)")
    p.add_argument("--k", type=int, help="experts per token (flame)")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (flame)")


def load(path: str, fmt: str, n_expert: int | None, k: int | None, seq_len: int = 64):
    """-> ("trace", ids, weights, starts, n_expert) or ("profile", counts, n_expert)."""
    from betelgeuse.routing import public as P
    from betelgeuse.routing.trace import read_trace
    if fmt != "trace" and not n_expert:
        raise InvalidRequestError(f"--experts is needed for --format {fmt}")
    try:
        if fmt == "trace":
            t = read_trace(path)
            return "trace", t.ids, t.weights, None, t.n_expert
        if fmt == "flame":
            if not k:
                raise InvalidRequestError("--k (experts per token) is needed for --format flame")
            ids, w, starts, _ = P.read_flame_csvs(path, k, seq_len)
            return "trace", ids, w, starts, n_expert
        if fmt == "jsonl":
            ids, w, starts = P.read_route_jsonl(path)
            return "trace", ids, w, starts, n_expert
        if fmt == "strata":
            ids, w = P.read_strata_dump(path)
            return "trace", ids, w, None, n_expert
        if fmt == "krasis":
            return "profile", P.read_krasis_heatmap(path, n_expert), n_expert
        return "profile", P.read_fiddler_popularity(path), n_expert
    except OSError as e:
        raise InvalidRequestError(f"cannot read {path}: {e.strerror or e}") from None
    except (ValueError, KeyError, json.JSONDecodeError) as e:
        raise InvalidRequestError(f"{path}: not a {fmt} routing file ({e})") from None


def table(st: dict) -> str:
    """The overall statistics of trace_stats / profile_stats as text lines."""
    o = st["overall"]
    f = lambda x: "-" if x is None else f"{x:.3f}" if isinstance(x, float) else str(x)     # noqa: E731
    lines = []
    if "n_tokens" in st:
        lines.append(f"tokens {st['n_tokens']} in {st['n_sequences']} sequence(s), {st['n_layer']} layers, "
                     f"{st['n_expert']} experts, top-{st['k']}")
        lines.append(f"repeat_next {f(o['repeat_next'])}  within_8 {f(o['within_8'])}  reuse median "
                     f"{f(o['reuse_median'])}  p80 {f(o['reuse_p80'])}")
        lines.append("LRU hit  " + "  ".join(f"{int(k * 100)}%: {f(v)}" for k, v in o["lru_hit"].items()))
        lines.append("distinct " + "  ".join(f"{n} tok: {f(v)}" for n, v in o["distinct"].items()))
    else:
        lines.append(f"profile: {st['n_layer']} layers, {st['n_expert']} experts, "
                     f"{st['selections_per_layer']:.0f} selections per layer")
    shares = "  ".join(f"{k * 100:g}%: {f(v)}" for k, v in o["top_share"].items())
    lines.append(f"gini {f(o['gini'])}  top share {shares}")
    if "rank_weight" in o:
        lines.append("rank weight " + " ".join(f"{x:.3f}" for x in o["rank_weight"]))
    return "\n".join(lines)


def run(args) -> int:
    from betelgeuse.routing_stats import profile_stats, trace_stats
    if args.routing_cmd == "measure":
        return _measure(args)
    src = load(args.path, args.format, args.experts, args.k, args.seq_len)
    if args.routing_cmd == "convert":
        if src[0] != "trace":
            raise InvalidRequestError(f"--format {args.format} is a profile (counts, no token order): nothing to "
                                      "convert")
        from betelgeuse.routing.trace import write_trace
        _, ids, w, starts, E = src
        try:
            write_trace(args.out, ids, E, w, source=args.path, source_format=args.format,
                        sequence_starts=list(starts or [0]))
        except ValueError as e:
            raise InvalidRequestError(str(e)) from None
        print(f"wrote {args.out}: {ids.shape[0]} tokens x {ids.shape[1]} layers x top-{ids.shape[2]}", file=sys.stderr)
        return 0
    try:
        st = trace_stats(src[1], src[4], weights=src[2], starts=src[3]) if src[0] == "trace" else profile_stats(src[1])
    except ValueError as e:
        raise InvalidRequestError(f"{args.path}: {e}") from None
    print(json.dumps(st, indent=1) if args.json else table(st))
    return 0


def _measure(args) -> int:
    from betelgeuse.gguf.header import read_header
    from betelgeuse.gguf.synth_router import read_router_metadata
    from betelgeuse.routing.measure import random_prompt, reference_trace
    from betelgeuse.routing_stats import trace_stats
    from betelgeuse.routing.trace import write_trace
    md = read_header(args.model).metadata
    arch = md.get("general.architecture")
    E = int(md[f"{arch}.expert_count"])
    ids, w, _ = reference_trace(args.model, random_prompt(len(md["tokenizer.ggml.tokens"]), args.tokens, args.seed),
                                args.decode)
    if args.record:
        write_trace(args.record, ids, E, w, model=args.model, prompt="random", tokens=args.tokens, decode=args.decode)
    st = trace_stats(ids, E, weights=w)
    st["router"] = read_router_metadata(md)
    print(json.dumps(st, indent=1) if args.json else table(st))
    return 0
