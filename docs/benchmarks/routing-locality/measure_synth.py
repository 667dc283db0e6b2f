"""Our synthetic routers, measured: bench-shaped proxies (the bench presets' routers and geometry, a small vocabulary
and small experts so the CPU reference model runs them) through the reference model; a random 512-token prompt
(the bench's prompts are random tokens) and greedy decode after a 64-token prompt. Writes synth.json here.

    .venv/bin/python docs/benchmarks/routing-locality/measure_synth.py WORK_DIR [ROW]    (~40 min on 1 core)

ROW: only the rows whose label contains it (the others stay as synth.json has them).

The routing of layer l depends only on layers <= l, so the first 8 layers of a proxy route as the first 8 layers
of the full 48-layer bench file with the same router would (its vocabulary and expert width only change tensors
the router does not read through: the statistics of the inputs stay the same).
"""

import json
import sys
import time
from pathlib import Path

import torch

from betelgeuse.gguf.synth import spec_from_preset, write_model
from betelgeuse.gguf.synth_router import read_router_metadata
from betelgeuse.gguf.header import read_header
from betelgeuse.routing.measure import random_prompt, reference_trace
from betelgeuse.routing_stats import trace_stats

torch.set_num_threads(1)
work = Path(sys.argv[1])
work.mkdir(parents=True, exist_ok=True)
PROXY = {"bench": dict(n_layer=8, n_vocab=4096, n_ff_exp=64, context_length=4096),
         "ds4-flash": dict(n_vocab=4096, n_ff_exp=64, context_length=4096)}
ROWS = [("qwen3moe bench router (skew 1.0)", "bench", "preset"),
        ("qwen3moe uniform (skew 0, worst case)", "bench", "uniform"),
        ("qwen3moe calibrated", "bench", "calibrated"),
        ("deepseek4 bench router (random)", "ds4-flash", "preset"),
        ("deepseek4 calibrated", "ds4-flash", "calibrated")]
only = sys.argv[2] if len(sys.argv) > 2 else ""
json_path = Path(__file__).parent / "synth.json"
out = json.loads(json_path.read_text()) if only and json_path.exists() else {}
for label, preset, router in ROWS:
    if only not in label:
        continue
    spec = spec_from_preset(preset, router=router, **PROXY[preset])
    path = work / f"{preset}-{router}.gguf"
    if not path.exists():
        write_model(path, spec, progress=False)
    md = read_header(path).metadata
    arch = md["general.architecture"]
    E = int(md[f"{arch}.expert_count"])
    hash_layers = int(md.get(f"{arch}.hash_layer_count", 0))
    row = {"preset": preset, "router": router, "proxy": PROXY[preset], "knobs": read_router_metadata(md)["knobs"],
           "router_skew": md.get("betelgeuse.synth.router_skew"), "hash_layers": hash_layers}
    t = time.time()
    ids, w, _ = reference_trace(path, random_prompt(len(md["tokenizer.ggml.tokens"]), 512))
    row["prompt512"] = trace_stats(ids, E, weights=w)
    if hash_layers:
        row["prompt512_routed_layers"] = trace_stats(ids[:, hash_layers:], E, weights=w[:, hash_layers:])
    ids, w, gen = reference_trace(path, random_prompt(len(md["tokenizer.ggml.tokens"]), 64, seed=1), decode=256)
    row["decode256"] = trace_stats(ids[64:], E, weights=w[64:])
    row["decode_distinct_tokens"] = len(set(gen))
    if hash_layers:
        row["decode256_routed_layers"] = trace_stats(ids[64:, hash_layers:], E, weights=w[64:, hash_layers:])
    row["seconds"] = time.time() - t
    out[label] = row
    print(label, f"{row['seconds']:.0f}s", {k: row["prompt512"]["overall"][k] for k in ("repeat_next", "within_8")},
          flush=True)
    json_path.write_text(json.dumps(out, indent=1))
