"""Configuration from every source, and `betelgeuse config show`: defaults < the TOML file <
BETELGEUSE_<SECTION>_<KEY> environment variables < flags, every value validated by the same converters
and labelled with its source; the printed TOML loads back to the same settings; a real store process
honours the environment and lets a flag win over it; bad values name the variable."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

try:
    from tests import service_helpers as h
except ImportError:
    import service_helpers as h

from betelgeuse.errors import BetelgeuseError
from betelgeuse.settings import KEYS, Settings, env_name, load_settings, resolve_settings

ROOT = Path(__file__).resolve().parents[2]
service_model = h.service_model


def _show(*argv, env=None) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if not k.startswith("BETELGEUSE_")}
    e.update(env or {}, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "services.cli", "config", "show", *map(str, argv)],
                          capture_output=True, text=True, env=e, timeout=60, cwd=ROOT)


def _sources(text: str) -> dict[str, str]:
    out, section = {}, None
    for line in text.splitlines():
        if line.startswith("["):
            section = line.strip("[]")
        elif " = " in line and "#" in line:
            out[f"{section}.{line.split(' = ')[0]}"] = line.rsplit("# ", 1)[1]
    return out


def test_every_source_and_the_round_trip(tmp_path):
    cfg = h.write_toml(tmp_path / "b.toml", {"slots": {"host_per_layer": 7}, "engine": {"sub_batch": 4},
                                            "budget": {"vram": "8GiB"}})
    env = {"BETELGEUSE_ENGINE_SUB_BATCH": "8", "BETELGEUSE_ENGINE_PREFETCH": "false",
           "BETELGEUSE_BUDGET_MEMORY_MAX": "6GiB", "BETELGEUSE_WORKER_LISTEN": "127.0.0.1:6000,unix:/tmp/b.sock",
           "BETELGEUSE_ENGINE_SUBBATCH": "2", "BETELGEUSE_HEALTH_TARGET": "127.0.0.1:1"}
    r = _show("--config", cfg, "--vram-slots", "auto", "--routing", "resident", env=env)
    assert r.returncode == 0, r.stderr
    src = _sources(r.stdout)
    assert src["slots.host_per_layer"] == str(cfg)
    assert src["engine.sub_batch"] == "env BETELGEUSE_ENGINE_SUB_BATCH"           # env over the file
    assert src["slots.vram_per_layer"] == "flag --vram-slots" and src["engine.routing"] == "flag --routing"
    assert src["engine.max_queue"] == "default" and src["budget.vram"] == str(cfg)
    assert len(src) == len(KEYS)
    assert "# ignored (no such key): BETELGEUSE_ENGINE_SUBBATCH" in r.stdout
    assert "HEALTH_TARGET" not in r.stdout                                        # not a settings section
    # the output is a config file: it loads back to exactly these settings
    out = tmp_path / "shown.toml"
    out.write_text(r.stdout)
    s = load_settings(out, env={})
    assert s.slots.host_per_layer == 7 and s.slots.vram_per_layer == "auto" and s.engine.routing == "resident"
    assert s.engine.sub_batch == 8 and s.engine.prefetch is False and s.budget.vram == 8 << 30
    assert s.budget.memory_max == 6 << 30 and s.worker.listen == ["127.0.0.1:6000", "unix:/tmp/b.sock"]
    again = _show("--config", out)
    assert again.returncode == 0 and _sources(again.stdout)["engine.sub_batch"] == str(out)
    values = lambda text: [l.split("#")[0].rstrip() for l in text.splitlines() if l and not l.startswith("#")]  # noqa: E731
    assert values(again.stdout) == values(r.stdout)


def test_defaults_alone_match_the_dataclasses():
    r = resolve_settings(None, env={})
    assert r.settings == Settings() and set(r.sources.values()) == {"default"}


def test_every_key_has_a_variable():
    from betelgeuse.settings import KEYS_INFO
    for k in KEYS_INFO:
        name = env_name(k.section, k.key)
        assert name == k.env == f"BETELGEUSE_{k.section.upper()}_{k.key.upper()}"
        r = resolve_settings(None, env={name: _env_text(k.example)})
        assert r.sources[(k.section, k.key)] == f"env {name}", name


@pytest.mark.parametrize("name, value, needle", [
    ("BETELGEUSE_ENGINE_SUB_BATCH", "many", "expected an integer"),
    ("BETELGEUSE_BUDGET_VRAM", "lots", "cannot parse size"),
    ("BETELGEUSE_ENGINE_ROUTING", "nearest", "expected one of exact, resident"),
    ("BETELGEUSE_ENGINE_PREFETCH", "maybe", "expected true or false"),
    ("BETELGEUSE_SLOTS_VRAM_BACKING", "maybe", 'expected true, false or "auto"'),
])
def test_bad_environment_values_name_the_variable(name, value, needle):
    with pytest.raises(BetelgeuseError, match=needle) as e:
        resolve_settings(None, env={name: value})
    assert name in str(e.value)
    r = _show(env={name: value})
    assert r.returncode == 2 and name in r.stderr and needle in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_a_real_store_reads_the_environment_and_a_flag_wins(service_model, tmp_path, monkeypatch):
    from betelgeuse.logs import parse_text_line
    from services.launcher import Cluster
    monkeypatch.setenv("BETELGEUSE_SLOTS_HOST_PER_LAYER", "3")
    monkeypatch.setenv("BETELGEUSE_SLOTS_VRAM_PER_LAYER", "1")
    c = Cluster(str(service_model), str(tmp_path / "run"), settings={"slots.vram_per_layer": 2}, store_metrics="",
                worker_metrics="")
    try:
        c.start_store()
    finally:
        c.stop()
    plan = next(parse_text_line(l) for l in Path(c.store.log_path).read_text().splitlines() if " plan " in l)
    assert plan["n_host"] == "3"          # from the environment
    assert plan["n_vram"] == "2"          # --vram-slots 2 (the launcher's flag) over BETELGEUSE_SLOTS_VRAM_PER_LAYER=1


def test_shipped_file_lists_every_key():
    import tomllib
    data = tomllib.loads((ROOT / "deploy" / "betelgeuse.toml").read_text())
    assert {(s, k) for s, vals in data.items() for k in vals} == set(KEYS)
    assert list(Settings.model_fields) == list(data)                  # the file's sections, in the model's order
    # and the file's values are the model's defaults (bar the model path a deployment must set, and the prefix tier's
    # save file: off in the code, on in the shipped file, under the units' StateDirectory)
    from betelgeuse.settings import BY_KEY
    assert data["store"]["prefix_save_path"] == "/var/lib/betelgeuse/prefix-cache.bin"
    for s, vals in data.items():
        for k, v in vals.items():
            if (s, k) not in (("model", "path"), ("store", "prefix_save_path")):
                assert getattr(getattr(load_settings(ROOT / "deploy" / "betelgeuse.toml", env={}), s), k) == \
                    BY_KEY[(s, k)].default, (s, k)


def test_secrets_are_redacted():
    from betelgeuse.settings import shown_value
    assert shown_value("api_keys", ["k1", "k2"]) == '["<redacted>", "<redacted>"]'
    assert shown_value("api_keys", []) == "[]"
    assert shown_value("auth_token", "abc") == '"<redacted>"'
    assert shown_value("tls_key", "/etc/betelgeuse/key.pem") == '"/etc/betelgeuse/key.pem"'   # a path, not a secret


# ------------------------------------------------------------------ one model, every source, the child args

def _env_text(v) -> str:
    """A value as an operator writes it in the environment."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list):
        return ",".join(v)
    return str(v)


def _process_parser(metrics="worker"):
    import argparse
    from services.common import common_args
    p = argparse.ArgumentParser()
    common_args(p, metrics=metrics)
    return p


@pytest.mark.parametrize("key", [k for k in __import__("betelgeuse.settings").settings.KEYS_INFO], ids=lambda k: k.name)
def test_every_key_round_trips_from_every_source(key, tmp_path):
    """A key's (non-default) example set in the file, in its BETELGEUSE_* variable, or as its flag (written
    by to_flags, as the launcher does, and read by the processes' own parser) gives the same value, labelled
    with that source; `config show` of it loads back to it."""
    from betelgeuse.settings import render_toml, to_flags
    from services.common import resolve_from_args
    want = key.example
    assert want != key.default, f"{key.name}: the example must differ from the default"
    got = {}
    path = h.write_toml(tmp_path / "b.toml", {key.section: {key.key: want}})
    got["file"] = resolve_settings(path, env={})
    got["env"] = resolve_settings(None, env={key.env: _env_text(want)})
    if key.flag:
        a = _process_parser().parse_args(to_flags({(key.section, key.key): want}))
        os_env = {k: v for k, v in os.environ.items() if not k.startswith("BETELGEUSE_")}
        with pytest.MonkeyPatch.context() as mp:
            for k in [k for k in os.environ if k.startswith("BETELGEUSE_")]:
                mp.delenv(k)
            got["flag"] = resolve_from_args(a, require_model=False)
        assert os_env is not None
    for source, r in got.items():
        assert getattr(getattr(r.settings, key.section), key.key) == want, (source, key.name)
        label = r.sources[(key.section, key.key)]
        assert label == {"file": str(path), "env": f"env {key.env}"}.get(source, label) and label != "default"
        if "api_key" not in key.key:                                   # redacted: not a round trip
            shown = tmp_path / f"shown-{source}.toml"
            shown.write_text(render_toml(r))
            assert load_settings(shown, env={}) == r.settings, source


def test_the_launchers_child_args_give_the_parents_settings(tmp_path, monkeypatch):
    """serve resolves file < environment < its flags once; the children get --config and flags derived from the
    model, read the same environment, and resolve exactly the parent's object (worker and store alike)."""
    from services.cli import build_parser, serve_cluster
    from services.common import resolve_from_args
    for k in [k for k in os.environ if k.startswith("BETELGEUSE_")]:
        monkeypatch.delenv(k)
    cfg = h.write_toml(tmp_path / "b.toml", {"engine": {"max_running": 3, "prefill_chunk": 32},
                                            "budget": {"memory_max": "9GiB"}, "worker": {"drain_grace": 5}})
    monkeypatch.setenv("BETELGEUSE_ENGINE_SUB_BATCH", "4")
    monkeypatch.setenv("BETELGEUSE_SLOTS_VRAM_BACKING", "false")
    monkeypatch.setenv("BETELGEUSE_WORKER_API_KEYS", "k1,k2")
    args = build_parser().parse_args([
        "serve", "m.gguf", "--config", str(cfg), "--port", "5555", "--runtime-dir", str(tmp_path / "run"),
        "--max-running", "2", "--vram-slots", "auto", "--no-prefetch", "--vram-budget", "8GiB", "--http", "",
        "--prefix-cache-bytes", "64MiB", "--device", "cpu"])
    cluster, parent = serve_cluster(args, "m.gguf", str(tmp_path / "run"))
    s = parent.settings
    assert (s.engine.max_running, s.engine.prefill_chunk, s.engine.sub_batch) == (2, 32, 4)   # flag, file, env
    assert s.slots.vram_backing is False and s.engine.prefetch is False and s.slots.vram_per_layer == "auto"
    assert s.budget.memory_max == 9 << 30 and s.budget.vram == 8 << 30 and s.worker.api_keys == ["k1", "k2"]
    assert s.store.socket == str(tmp_path / "run" / "store.sock") and s.worker.listen == ["127.0.0.1:5555"]
    assert s.worker.http == "" and s.worker.metrics == "127.0.0.1:9464" and s.engine.prefix_cache_bytes == 64 << 20
    for role in ("worker", "store"):
        child = resolve_from_args(_process_parser(role).parse_args(cluster.child_args()))
        assert child.settings == s, role
        assert child.sources[("engine", "prefill_chunk")] == str(cfg)                # the child read the file
        assert child.sources[("engine", "sub_batch")] == "env BETELGEUSE_ENGINE_SUB_BATCH"


def test_a_bad_serve_flag_is_one_line_and_starts_nothing(tmp_path):
    e = {k: v for k, v in os.environ.items() if not k.startswith("BETELGEUSE_")}
    e["PYTHONPATH"] = str(ROOT)
    for argv, needle in [(["--max-running", "-1"], "max_running"), (["--vram-budget", "lots"], "budget.vram"),
                         (["--max-batched-tokens", "8", "--prefill-chunk", "64"], "max_batched_tokens"),
                         (["--listen", "x"], "unrecognized")]:
        r = subprocess.run([sys.executable, "-m", "services.cli", "serve", str(tmp_path / "m.gguf"),
                            "--runtime-dir", str(tmp_path / "run"), *argv], capture_output=True, text=True,
                           env=e, timeout=60, cwd=ROOT)
        assert r.returncode == 2 and needle in r.stderr and r.stderr.count("\n") == 1, (argv, r.stderr)
        assert "Traceback" not in r.stderr and "validation error" not in r.stderr
        assert not (tmp_path / "run" / "store.log").exists()                         # nothing was started


def test_process_flags_are_the_models():
    """The worker's and store's --help list one flag per key (bar the secret api_keys), with its description."""
    from betelgeuse.settings import KEYS_INFO
    text = _process_parser().format_help()
    for k in KEYS_INFO:
        if k.key == "api_keys":
            assert "--api-keys" not in text
            continue
        assert k.flag in text and k.env in text, k.name
