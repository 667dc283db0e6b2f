#!/usr/bin/env python3
"""cpu-host51/items.py where an item may be on one side only (a function this branch removed from a miss layer's path
or added to it): per configuration, the median over an A/B's runs of each side's split_us figure (us a call) and calls
a step, "-" where a side never called it.

    python3 docs/benchmarks/cpu-host54/items.py ab.jsonl moe._bank_group moe.flex.keep ..."""

import json
import statistics
import sys

rows = [json.loads(x) for x in open(sys.argv[1])]
items = sys.argv[2:]
a, b = list(dict.fromkeys(r["side"] for r in rows))
print(f"| configuration | item | {a} / {b} us a call | calls a step {a} / {b} |")
print("|---|---|---|---|")


def med(args, side, k, i):
    v = [r["run"]["split_us"][k][i] for r in rows if r["args"] == args and r["side"] == side
         and k in r["run"]["split_us"]]
    return statistics.median(v) if v else None


def f(x, fmt):
    return "-" if x is None else format(x, fmt)


for args in dict.fromkeys(r["args"] for r in rows):
    for k in items:
        us = [med(args, s, k, 0) for s in (a, b)]
        n = [med(args, s, k, 1) for s in (a, b)]
        print(f"| `{args}` | {k} | {f(us[0], '.1f')} / {f(us[1], '.1f')} | {f(n[0], '.3g')} / {f(n[1], '.3g')} |")
