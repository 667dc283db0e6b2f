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

ROOT = Path(__file__).resolve().parent.parent
service_model = h.service_model


def _show(*argv, env=None) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if not k.startswith("BETELGEUSE_")}
    e.update(env or {}, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "betelgeuse.cli", "config", "show", *map(str, argv)],
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
    for section, key in KEYS:
        name = env_name(section, key)
        assert name == f"BETELGEUSE_{section.upper()}_{key.upper()}"
        default = getattr(getattr(Settings(), section), key)
        value = {bool: "true", int: "3", list: "127.0.0.1:1"}.get(type(default))
        if value is None:
            continue
        r = resolve_settings(None, env={name: value})
        assert r.sources[(section, key)] == f"env {name}", name


@pytest.mark.parametrize("name, value, needle", [
    ("BETELGEUSE_ENGINE_SUB_BATCH", "many", "expected an integer"),
    ("BETELGEUSE_BUDGET_VRAM", "lots", "cannot parse size"),
    ("BETELGEUSE_ENGINE_ROUTING", "nearest", "expected one of exact, resident"),
    ("BETELGEUSE_SLOTS_VRAM_BACKING", "maybe", "expected true or false"),
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
    c = Cluster(str(service_model), str(tmp_path / "run"), vram_slots=2, store_metrics="", worker_metrics="")
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
    assert dataclasses.fields(Settings)[-1].name == "log"


def test_secrets_are_redacted():
    from betelgeuse.settings import shown_value
    assert shown_value("api_keys", ["k1", "k2"]) == '["<redacted>", "<redacted>"]'
    assert shown_value("api_keys", []) == "[]"
    assert shown_value("auth_token", "abc") == '"<redacted>"'
    assert shown_value("tls_key", "/etc/betelgeuse/key.pem") == '"/etc/betelgeuse/key.pem"'   # a path, not a secret
