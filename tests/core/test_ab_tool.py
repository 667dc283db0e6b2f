"""deploy/device/ab.py, the A/B tool every docs/benchmarks A/B runs: the two checkouts take turns (rep by rep,
configuration by configuration), each run imports its own side's code (PYTHONPATH) with B's script, and the table
gives each side's median and the ratio B / A. (A measured script must leave sys.path to PYTHONPATH, as
decode_host.py does: one that puts its own checkout first would run B's code on both sides.) Real subprocesses on two throwaway checkouts."""

import json
import subprocess
import sys
from pathlib import Path

AB = Path(__file__).resolve().parents[2] / "deploy/device/ab.py"
SCRIPT = """
import json, sys
import betelgeuse.which as w
n = int(sys.argv[sys.argv.index("--n") + 1])
if n < 0:
    sys.exit("negative n")
import subprocess
child = float(subprocess.run([sys.executable, "-c", "import betelgeuse.which as w; print(w.US)"],
                             capture_output=True, text=True, check=True).stdout)   # as a `python -m` store child
print(json.dumps({"per_token_median": {"us": w.US * n, "child": child, "args": sys.argv[1:]}}))
"""


def _checkout(root: Path, us: float) -> Path:
    (root / "betelgeuse").mkdir(parents=True)
    (root / "betelgeuse/__init__.py").write_text("")
    (root / "betelgeuse/which.py").write_text(f"US = {us}\n")
    (root / "tools").mkdir()
    (root / "tools/m.py").write_text(SCRIPT)    # in a folder, as deploy/device/: its folder (sys.path[0]) has no code
    return root


def test_ab_alternates_sides_and_tables_the_ratio(tmp_path):
    a, b = _checkout(tmp_path / "a", 100.0), _checkout(tmp_path / "b", 50.0)
    cfg = tmp_path / "configs.txt"
    cfg.write_text("# a comment\n--n 1\n\n--n 3\n")
    p = subprocess.run([sys.executable, str(AB), "run", str(a), str(b), "--configs", str(cfg), "--reps", "2",
                        "--script", "tools/m.py", "--extra=--tag x"], capture_output=True, text=True, check=True,
                       cwd=b)      # from B's checkout, as on the device: a child started by A's run still runs A's code
    rows = [json.loads(x) for x in p.stdout.splitlines()]
    assert [(r["args"], r["rep"], r["side"]) for r in rows] == [
        (c, rep, s) for c in ("--n 1", "--n 3") for rep in (1, 2) for s in ("main", "branch")]
    assert [r["run"]["per_token_median"]["us"] for r in rows[:2]] == [100.0, 50.0]     # each side's own code
    assert [r["run"]["per_token_median"]["child"] for r in rows[:2]] == [100.0, 50.0]  # its children's too
    assert rows[0]["run"]["per_token_median"]["args"] == ["--n", "1", "--tag", "x"]
    res = tmp_path / "results.jsonl"
    res.write_text(p.stdout)
    t = subprocess.run([sys.executable, str(AB), "table", str(res), "--keys", "us"], capture_output=True, text=True,
                       check=True).stdout.splitlines()
    assert t[2] == "| `--n 1` | 100 / 50 (0.50) |" and t[3] == "| `--n 3` | 300 / 150 (0.50) |", t


def test_ab_names_the_failing_run_and_bad_inputs(tmp_path):
    a, b = _checkout(tmp_path / "a", 1.0), _checkout(tmp_path / "b", 1.0)
    p = subprocess.run([sys.executable, str(AB), "run", str(a), str(b), "--config=--n -1", "--script", "tools/m.py"],
                       capture_output=True, text=True)
    assert p.returncode == 1 and "main run of" in p.stderr and "negative n" in p.stderr and p.stdout == ""
    for args, msg in ((["run", str(a), str(tmp_path), "--config=--n 1"], "is not a checkout"),
                      (["run", str(a), str(b), "--script", "tools/m.py"], "no configuration"),
                      (["run", str(a), str(b), "--configs", str(tmp_path / "none.txt")], "cannot read --configs"),
                      (["table", str(tmp_path / "none.jsonl"), "--keys", "us"], "cannot read")):
        if args[0] == "run" and "--script" not in args:
            args += ["--script", "tools/m.py"]
        p = subprocess.run([sys.executable, str(AB), *args], capture_output=True, text=True)
        assert p.returncode == 2 and msg in p.stderr and "Traceback" not in p.stderr, (args, p.stderr)
