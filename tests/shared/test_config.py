"""Stage configs: flag > MMCACHE_* variable > default; validation; to_flags/from_args round trip."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os

import pytest

from mmcache.shared.config import (
    EncoderConfig,
    LLMConfig,
    ProcessorConfig,
    add_arguments,
    env_name,
    flag_name,
    from_args,
    to_flags,
)

CONFIGS = (EncoderConfig, LLMConfig, ProcessorConfig)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("MMCACHE_"):
            monkeypatch.delenv(name)


def _parse(cls: type, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser, cls)
    return parser.parse_args(argv)


def test_names():
    assert env_name("kv_cache_gb") == "MMCACHE_KV_CACHE_GB"
    assert flag_name("kv_cache_gb") == "--kv-cache-gb"


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_defaults_without_flags_or_env(cls):
    assert from_args(cls, _parse(cls, [])) == cls()
    assert from_args(cls) == cls()


def test_flag_beats_env_beats_default(monkeypatch):
    assert LLMConfig().block_size == 16 and LLMConfig().max_num_seqs == 64
    monkeypatch.setenv("MMCACHE_BLOCK_SIZE", "32")
    monkeypatch.setenv("MMCACHE_MAX_NUM_SEQS", "8")
    cfg = from_args(LLMConfig, _parse(LLMConfig, ["--block-size", "64"]))
    assert cfg.block_size == 64  # flag
    assert cfg.max_num_seqs == 8  # env
    assert cfg.max_num_batched_tokens == 2048  # default
    assert cfg.kv_cache_gb == 0.0  # auto: sized from the device (llm_stage.kv_cache)


def test_env_values_are_parsed_to_the_field_type(monkeypatch):
    monkeypatch.setenv("MMCACHE_KV_CACHE_GB", "1.75")
    monkeypatch.setenv("MMCACHE_MAX_QUEUE", "12")
    monkeypatch.setenv("MMCACHE_MODEL", "/models/x")
    cfg = from_args(LLMConfig, _parse(LLMConfig, []))
    assert cfg.kv_cache_gb == 1.75 and isinstance(cfg.kv_cache_gb, float)
    assert cfg.max_queue == 12 and isinstance(cfg.max_queue, int)
    assert cfg.model == "/models/x"


def test_overrides_beat_flags_and_env(monkeypatch):
    monkeypatch.setenv("MMCACHE_PORT", "9000")
    cfg = from_args(ProcessorConfig, _parse(ProcessorConfig, ["--port", "9100"]), port=9200)
    assert cfg.port == 9200


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("1", True),
        ("true", True),
        ("TRUE", True),
        ("Yes", True),
        (" on ", True),
        ("0", False),
        ("false", False),
        ("No", False),
        ("off", False),
        ("", False),
    ],
)
def test_bool_env_parsing(monkeypatch, raw, expected):
    monkeypatch.setenv("MMCACHE_NO_CACHE", raw)
    assert from_args(LLMConfig, _parse(LLMConfig, [])).no_cache is expected


@pytest.mark.parametrize("raw", ["maybe", "2", "yess", "tru"])
def test_bool_env_rejects_other_words(monkeypatch, raw):
    monkeypatch.setenv("MMCACHE_NO_CACHE", raw)
    with pytest.raises(ValueError, match="MMCACHE_NO_CACHE"):
        from_args(LLMConfig, _parse(LLMConfig, []))


def test_bool_flag_beats_env(monkeypatch):
    monkeypatch.setenv("MMCACHE_NO_PREFIX_CACHE", "false")
    cfg = from_args(LLMConfig, _parse(LLMConfig, ["--no-prefix-cache"]))
    assert cfg.no_prefix_cache is True and cfg.prefix_cache is False
    monkeypatch.setenv("MMCACHE_NO_PREFIX_CACHE", "true")
    assert from_args(LLMConfig, _parse(LLMConfig, [])).prefix_cache is False
    assert from_args(LLMConfig, _parse(LLMConfig, [])).no_cache is False


def test_prefix_cache_switches():
    assert LLMConfig().prefix_cache
    assert not LLMConfig(no_cache=True).prefix_cache
    assert not LLMConfig(no_prefix_cache=True).prefix_cache


def test_bad_env_number_is_an_error(monkeypatch):
    monkeypatch.setenv("MMCACHE_PORT", "eighty")
    with pytest.raises(ValueError):
        from_args(ProcessorConfig, _parse(ProcessorConfig, []))


def test_bad_flag_number_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit):
        _parse(LLMConfig, ["--block-size", "sixteen"])
    assert "--block-size" in capsys.readouterr().err


@pytest.mark.parametrize(
    "cls, field, value",
    [
        (LLMConfig, "block_size", 0),
        (LLMConfig, "block_size", -16),
        (LLMConfig, "max_num_seqs", 0),
        (LLMConfig, "max_num_batched_tokens", -1),
        (LLMConfig, "kv_cache_gb", -0.5),
        (LLMConfig, "max_repairs", -1),
        (LLMConfig, "repair_timeout", 0.0),
        (LLMConfig, "max_queue", 0),
        (LLMConfig, "max_model_len", -1),
        (LLMConfig, "num_kv_blocks", -1),
        (EncoderConfig, "max_batch_tokens", -5),
        (ProcessorConfig, "port", 0),
        (ProcessorConfig, "port", -80),
        (ProcessorConfig, "video_fps", 0.0),
        (ProcessorConfig, "max_video_frames", 0),
        (ProcessorConfig, "max_image_pixels", -1),
        (ProcessorConfig, "max_media_bytes", 0),
        (ProcessorConfig, "stage_timeout", -1.0),
        (ProcessorConfig, "max_media_redirects", -1),
        (ProcessorConfig, "encoder", ""),
        (ProcessorConfig, "llm", " , "),
    ],
)
def test_validation_rejects_bad_values(cls, field, value):
    with pytest.raises(ValueError):
        cls(**{field: value})


def test_bad_env_value_is_validated_like_a_flag(monkeypatch):
    monkeypatch.setenv("MMCACHE_BLOCK_SIZE", "-4")
    with pytest.raises(ValueError, match="block-size"):
        from_args(LLMConfig, _parse(LLMConfig, []))


def test_zero_is_allowed_where_it_means_auto():
    assert LLMConfig(max_model_len=0, num_kv_blocks=0).num_kv_blocks == 0
    assert ProcessorConfig(max_media_redirects=0).max_media_redirects == 0


@pytest.mark.parametrize("port", [65536, 70000])
def test_port_above_65535_is_rejected(port):
    with pytest.raises(ValueError):
        ProcessorConfig(port=port)


@pytest.mark.parametrize("field", ["kv_cache_gb"])
def test_nan_size_is_rejected(field):
    with pytest.raises(ValueError):
        LLMConfig(**{field: math.nan})


def test_configs_are_frozen():
    cfg = LLMConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.block_size = 8  # type: ignore[misc]


def _non_default(cls: type) -> object:
    """An instance with every field changed from its default (to a valid value)."""
    values = {}
    for f in dataclasses.fields(cls):
        d = f.default
        if isinstance(d, bool):
            values[f.name] = not d
        elif isinstance(d, int):
            values[f.name] = d + 3 if d >= 0 else 0
        elif isinstance(d, float):
            values[f.name] = d + 0.125 if d >= 0 else 0.5
        elif f.name in ("encoder", "llm"):
            values[f.name] = "tcp://10.0.0.1:1, tcp://10.0.0.2:2"
        elif f.name in ("device",):
            values[f.name] = "cpu"
        elif f.name in ("dtype",):
            values[f.name] = "bfloat16"
        elif f.name == "log_format":
            values[f.name] = "json"
        elif f.name == "attention_backend":
            values[f.name] = "sdpa"
        elif f.name == "kv_store":
            values[f.name] = "redis://kv store.example:6379/0"
        else:
            values[f.name] = f"/some/{f.name} with spaces"
    return cls(**values)


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_to_flags_from_args_round_trip(cls):
    cfg = _non_default(cls)
    flags = to_flags(cfg)
    assert from_args(cls, _parse(cls, flags)) == cfg
    # Defaults are not spelled out, so a child inherits them (and env) unchanged.
    assert to_flags(cls()) == []


def test_to_flags_spells_bools_as_bare_flags():
    flags = to_flags(LLMConfig(no_cache=True, block_size=32))
    assert "--no-cache" in flags
    assert "True" not in flags
    assert flags[flags.index("--block-size") + 1] == "32"


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_every_field_has_help_and_a_flag(cls):
    parser = argparse.ArgumentParser()
    add_arguments(parser, cls)
    dests = {a.dest: a for a in parser._actions}
    for f in dataclasses.fields(cls):
        assert f.name in dests
        assert f.metadata.get("help")
        assert env_name(f.name) in dests[f.name].help


def test_add_arguments_skips_fields_and_existing_flags():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", dest="model", default="given")
    add_arguments(parser, LLMConfig, skip={"bind"})
    ns = parser.parse_args([])
    assert ns.model == "given"
    assert not hasattr(ns, "bind")
    assert ns.block_size is None  # unset flags stay None so env and defaults apply


def test_kv_store_must_be_a_redis_url():
    assert LLMConfig(kv_store="redis://kvstore:6379/0").kv_tier
    assert LLMConfig(kv_store="unix:///run/kv.sock").kv_tier
    assert not LLMConfig(kv_store="redis://kvstore:6379/0", no_prefix_cache=True).kv_tier
    with pytest.raises(ValueError, match="--kv-store must be a redis://"):
        LLMConfig(kv_store="kvstore:6379")
