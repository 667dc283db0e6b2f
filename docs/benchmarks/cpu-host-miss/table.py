"""results.jsonl (ab.sh) -> a markdown table: per configuration, the median over the runs of each side's per-token
medians (miss_layer_us: the median miss layer of each run), and the ratio branch / main (deploy/device/ab.py table)."""
import subprocess
import sys
from pathlib import Path

KEYS = ("miss_layer_us", "store_messages_ms", "moe_host_ms", "host_us_per_application", "host_ms", "wall_ms")
sys.exit(subprocess.call([sys.executable, str(Path(__file__).resolve().parents[3] / "deploy/device/ab.py"), "table",
                          sys.argv[1] if len(sys.argv) > 1 else "results.jsonl", "--keys", ",".join(KEYS)]))
