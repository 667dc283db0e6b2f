"""betelgeuse/settings.py: the shipped file loads to the defaults, sizes parse like systemd's, and
every mistake is a one-line BetelgeuseError naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from betelgeuse.errors import BetelgeuseError
from betelgeuse.settings import AUTO, Settings, load_settings, parse_size, settings_from_dict, split_hostport

ROOT = Path(__file__).resolve().parents[2]


def test_shipped_file_equals_defaults():
    s = load_settings(ROOT / "deploy" / "betelgeuse.toml")
    d = Settings()
    d.model.path = s.model.path  # the one value a deployment must set
    # the one default the shipped file changes: the prefix cache's save file, off in the code (a development run or a
    # test must not write under /var/lib), on for the units, in their StateDirectory
    assert s.store.prefix_save_path == "/var/lib/betelgeuse/prefix-cache.bin" and d.store.prefix_save_path == ""
    d.store.prefix_save_path = s.store.prefix_save_path
    assert s == d
    assert (s.slots.vram_per_layer, s.slots.host_per_layer) == (AUTO, AUTO)      # sized from the budgets
    assert s.budget.vram == 12 * 2**30 and s.budget.memory_max is None
    assert s.worker.listen == ["127.0.0.1:50051", "unix:/run/betelgeuse/api.sock"]
    assert s.store.metrics == "127.0.0.1:9465"


@pytest.mark.parametrize("text,value", [
    ("12GiB", 12 * 2**30), ("12G", 12 * 2**30), ("12GB", 12 * 10**9), ("1.5 GiB", 3 * 2**29),
    ("512MiB", 512 * 2**20), ("4096", 4096), (4096, 4096), ("0", 0),
])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("bad", ["12 parsecs", "", "-1G", "G", True, -5])
def test_parse_size_rejects(bad):
    with pytest.raises(BetelgeuseError):
        parse_size(bad)


def test_split_hostport():
    assert split_hostport("127.0.0.1:9464") == ("127.0.0.1", 9464)
    assert split_hostport("[::1]:50051") == ("::1", 50051)
    with pytest.raises(BetelgeuseError):
        split_hostport("localhost")


def _load(tmp_path, text):
    p = tmp_path / "b.toml"
    p.write_text(text)
    return load_settings(p)


def test_auto_and_overrides(tmp_path):
    s = _load(tmp_path, '[slots]\nvram_per_layer = 7\nhost_per_layer = 40\n[budget]\nvram = "8G"\n'
                        'memory_max = "10GiB"\n[worker]\nlisten = "unix:/tmp/x.sock"\nmetrics = ""\n')
    assert s.slots.vram_per_layer == 7 and s.slots.host_per_layer == 40            # fixed counts stay possible
    assert s.budget.vram == 8 * 2**30 and s.budget.memory_max == 10 * 2**30
    assert s.worker.listen == ["unix:/tmp/x.sock"] and s.worker.metrics == ""


@pytest.mark.parametrize("text,needle", [
    ("[modle]\npath = 'x'\n", "[modle]"),
    ("[slots]\nvram = 5\n", "slots.vram"),
    ("[slots]\nvram_per_layer = -1\n", "slots.vram_per_layer"),
    ("[slots]\nhost_per_layer = 'many'\n", "slots.host_per_layer"),
    ("[budget]\nvram = '12 bananas'\n", "budget.vram"),
    ("[worker]\nmetrics = 'localhost'\n", "worker.metrics"),
    ("[worker]\nlisten = []\n", "worker.listen"),
    ("[model]\npath = 3\n", "model.path"),
    ("[store]\nsession_transport = 'udp'\n", "store.session_transport"),
    ("model = 3\n", "[model]"),
    ("[slots\n", "invalid TOML"),
])
def test_mistakes_name_the_key(tmp_path, text, needle):
    with pytest.raises(BetelgeuseError) as e:
        _load(tmp_path, text)
    msg = str(e.value)
    assert needle in msg and "\n" not in msg


def test_missing_file(tmp_path):
    with pytest.raises(BetelgeuseError, match="does not exist"):
        load_settings(tmp_path / "nope.toml")


def test_engine_defaults_match_engine_config():
    """Every EngineConfig field is fed by exactly one key of the model (no hand-kept list between them), with
    the same default; the two exceptions are the model (required) and the device (the file's "auto" is
    resolved by each process)."""
    import dataclasses

    from betelgeuse.config import EngineConfig
    from betelgeuse.settings import KEYS_INFO

    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    feeds = [k for k in KEYS_INFO if k.engine]
    assert sorted(k.engine for k in feeds) == sorted(fields), "keys feeding the engine != EngineConfig fields"
    for k in feeds:
        if k.engine in ("model_path", "device"):
            continue
        assert k.default == fields[k.engine].default, (k.name, k.default, fields[k.engine].default)


def test_engine_config_derives_every_key(tmp_path):
    """Each engine key's example, set in a file, arrives in the EngineConfig under its engine name."""
    from betelgeuse.config import engine_config
    from betelgeuse.settings import KEYS_INFO
    feeds = [k for k in KEYS_INFO if k.engine and k.engine not in ("model_path", "device")]
    data = {}
    for k in feeds:
        data.setdefault(k.section, {})[k.key] = k.example
    data["engine"]["max_batched_tokens"] = 256            # cross-key checks of EngineConfig hold for the examples
    cfg = engine_config(settings_from_dict(data), use_torch=False)
    for k in feeds:
        assert getattr(cfg, k.engine) == data[k.section][k.key], k.name


def _examples() -> dict:
    """Every engine key's example, as EngineConfig keyword arguments (the cross-key checks hold for them)."""
    from betelgeuse.config import ENGINE_KEYS
    kw = {name: k.example for name, k in ENGINE_KEYS.items()}
    kw["max_batched_tokens"] = 256
    return kw


def test_hand_built_engine_config_is_held_to_the_keys_checks():
    """EngineConfig(...) by hand runs each settings key's own check (no second table of rules): a bad value of any
    field is one BetelgeuseError naming the field; a value written as in the file is converted."""
    from betelgeuse.config import ENGINE_KEYS, EngineConfig
    for name in ENGINE_KEYS:
        with pytest.raises(BetelgeuseError, match=f"^{name}: ") as e:
            EngineConfig(**{**_examples(), name: object()})
        assert "\n" not in str(e.value)
    assert EngineConfig(model_path="m", vram_budget="8GiB", memory_max="auto").vram_budget == 8 << 30
    with pytest.raises(BetelgeuseError, match="max_batched_tokens .* prefill_chunk"):
        EngineConfig(model_path="m", prefill_chunk=64, max_batched_tokens=32)


def test_engine_config_round_trips_through_a_childs_flags():
    """engine_settings(cfg) -> to_flags -> add_flags/flag_values -> engine_config gives cfg back: what a store child
    started for a worker's EngineConfig plans with (services/assembly.py)."""
    import argparse

    from betelgeuse.config import EngineConfig, engine_config, engine_settings
    from betelgeuse.settings import add_flags, flag_values, resolve_settings, to_flags
    for cfg in (EngineConfig(**_examples()), EngineConfig(model_path="/m.gguf")):
        p = argparse.ArgumentParser()
        add_flags(p)
        r = resolve_settings(None, env={}, flags=flag_values(p.parse_args(to_flags(engine_settings(cfg)))))
        assert engine_config(r.settings, use_torch=False) == cfg


def test_bad_values_are_one_line_naming_the_key(tmp_path):
    """pydantic's ValidationError never reaches the user: one line, the source and the key."""
    for text, needles in [("[engine]\nmax_running = 0\n", ["engine.max_running", ">= 1"]),
                          ("[engine]\nprefix_cache_bytes = 'lots'\n", ["engine.prefix_cache_bytes", "cannot parse size"]),
                          ("[worker]\ndrain_grace = -1\n", ["worker.drain_grace", "seconds >= 0"]),
                          ("[worker]\nlisten = ['localhost']\n", ["worker.listen", "HOST:PORT"]),
                          ("[log]\nlevel = 'loud'\n", ["log.level", "expected one of"])]:
        with pytest.raises(BetelgeuseError) as e:
            _load(tmp_path, text)
        msg = str(e.value)
        assert all(n in msg for n in needles) and "\n" not in msg and "validation error" not in msg, msg


def test_engine_section(tmp_path):
    s = _load(tmp_path, '[engine]\nschedule = "standard"\nsub_batch = 8\nprefetch = false\nworker_reserve = "2GiB"\n')
    assert (s.engine.schedule, s.engine.sub_batch, s.engine.prefetch) == ("standard", 8, False)
    assert s.engine.worker_reserve == 2 * 2**30
    with pytest.raises(BetelgeuseError, match="engine.schedule"):
        _load(tmp_path, '[engine]\nschedule = "fast"\n')
    with pytest.raises(BetelgeuseError, match="engine.prefetch"):
        _load(tmp_path, '[engine]\nprefetch = 1\n')


def test_vram_backing_takes_auto_true_and_false_as_flags():
    """`--vram-backing [auto|true|false]` (bare: true) and `--no-vram-backing`; a child's flags give the value back."""
    import argparse
    from betelgeuse.settings import add_flags, flag_values, resolve_settings, to_flags
    p = argparse.ArgumentParser()
    add_flags(p, sections=["slots"])

    def value(argv):
        return resolve_settings(None, env={}, flags=flag_values(p.parse_args(argv))).settings.slots.vram_backing
    assert value([]) == "auto"
    for argv, want in ((["--vram-backing"], True), (["--no-vram-backing"], False), (["--vram-backing", "auto"], "auto"),
                       (["--vram-backing", "false"], False), (["--vram-backing", "true"], True)):
        assert value(argv) == want, argv
        assert value(to_flags({("slots", "vram_backing"): want})) == want, argv
    with pytest.raises(BetelgeuseError, match=r'flag --vram-backing \(slots.vram_backing\): expected true, false or "auto"'):
        value(["--vram-backing", "maybe"])


def test_decode_at_hand_flag_and_bad_values(tmp_path):
    """`--decode-at-hand [auto|true|false]` (worker/at_hand.py): the values reach the engine config; a bad one is a
    one-line error naming the flag or the key."""
    import argparse
    from betelgeuse.config import engine_config
    from betelgeuse.settings import add_flags, flag_values, resolve_settings
    p = argparse.ArgumentParser()
    add_flags(p)

    def value(argv):
        return resolve_settings(None, env={}, flags=flag_values(p.parse_args(argv))).settings.engine.decode_at_hand
    assert value([]) == "auto"
    assert (value(["--decode-at-hand", "false"]), value(["--no-decode-at-hand"]), value(["--decode-at-hand"])) == (
        False, False, True)
    r = resolve_settings(None, env={}, flags=flag_values(p.parse_args(["--model", "/m.gguf", "--no-decode-at-hand"])))
    assert engine_config(r.settings, use_torch=False).decode_at_hand is False
    with pytest.raises(BetelgeuseError, match=r'flag --decode-at-hand \(engine.decode_at_hand\): expected true, false'):
        value(["--decode-at-hand", "sometimes"])
    with pytest.raises(BetelgeuseError, match="engine.decode_at_hand"):
        _load(tmp_path, '[engine]\ndecode_at_hand = "sometimes"\n')


def test_decode_gate_choices_and_its_needs(tmp_path):
    """`--decode-gate off|on|auto` (worker/gate.py); a bad value names the flag; on without the at-hand group is a
    config error naming both."""
    import argparse
    from betelgeuse.config import EngineConfig
    from betelgeuse.settings import add_flags, flag_values, resolve_settings
    p = argparse.ArgumentParser()
    add_flags(p)

    def value(argv):
        return resolve_settings(None, env={}, flags=flag_values(p.parse_args(argv))).settings.engine.decode_gate
    assert (value([]), value(["--decode-gate", "on"]), value(["--decode-gate", "auto"])) == ("off", "on", "auto")
    with pytest.raises(BetelgeuseError, match=r"--decode-gate.*expected one of"):
        value(["--decode-gate", "fast"])
    with pytest.raises(BetelgeuseError, match="decode_gate = 'on' needs decode_at_hand"):
        EngineConfig(model_path="/m.gguf", decode_gate="on", decode_at_hand=False)
    assert EngineConfig(model_path="/m.gguf", decode_gate="auto", decode_at_hand=False).decode_gate == "auto"
