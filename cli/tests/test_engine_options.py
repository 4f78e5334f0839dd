"""Engine options are generated from EngineConfig's fields: a new field shows up in every command
that starts an engine, values reach the built config, --config reads a YAML file, JSON fields
parse with pydantic, and plugins add namespaced options (tokenmill_add_options)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import pytest
import typer
from pydantic import BaseModel, Field
from typer.testing import CliRunner

from tokenmill.config import EngineConfig, cli
from tokenmill_cli.engine_options import engine_command
from tokenmill_cli.main import build_app

runner = CliRunner()
WIDE = {"COLUMNS": "200"}
ENGINE_COMMANDS = [["generate"], ["serve"], ["bench", "throughput"], ["bench", "latency"]]


class SpeculativeConfig(BaseModel):
    method: Literal["ngram", "draft"]
    num_speculative_tokens: int = Field(ge=1)


class FutureConfig(EngineConfig):
    """EngineConfig as a later issue extends it: a scalar field and two JSON-valued ones."""

    draft_window: int = Field(4, ge=1, description="Tokens the drafter looks back", json_schema_extra=cli("Drafting"))
    speculative_config: SpeculativeConfig | None = Field(None, description="How to speculate, as JSON")
    limit_mm_per_prompt: dict[str, int] = Field(default_factory=dict, description="Most items per modality")


def probe(config_cls: type[EngineConfig] = FutureConfig) -> tuple[typer.Typer, list[Any]]:
    """An app with one engine command that keeps what it receives."""
    received: list[Any] = []

    def record(engine: EngineConfig, label: str = "plain") -> None:
        received.append((engine, label))

    app = typer.Typer()
    app.command()(engine_command(record, config_cls))
    return app, received


def run(app: typer.Typer, args: list[str], exit_code: int = 0) -> str:
    result = runner.invoke(app, args, env=WIDE)
    assert result.exit_code == exit_code, result.output
    return result.output


@pytest.mark.parametrize("command", ENGINE_COMMANDS, ids=" ".join)
def test_a_new_config_field_shows_in_every_engine_command(command):
    out = run(build_app(FutureConfig), [*command, "--help"])
    for expected in ("--draft-window", "Tokens the drafter looks back", "Drafting", "--speculative-config", "JSON",
                     "--limit-mm-per-prompt", "--max-num-seqs", "--config"):
        assert expected in out, f"{expected!r} missing from {' '.join(command)} --help:\n{out}"


@pytest.mark.parametrize("command", ENGINE_COMMANDS, ids=" ".join)
def test_every_engine_command_validates_the_new_field(command):
    """The real command builds its config before any engine starts: a bad value stops it there."""
    out = run(build_app(FutureConfig), [*command, "--draft-window", "0"], exit_code=2)
    assert "--draft-window" in out and "greater than or equal to 1" in out


def test_the_built_config_holds_the_given_values_and_only_those_are_set():
    app, received = probe()
    run(app, ["--draft-window", "7", "--max-num-seqs", "3", "--label", "x"])
    engine, label = received[0]
    assert isinstance(engine, FutureConfig) and label == "x"
    assert (engine.draft_window, engine.max_num_seqs, engine.block_size) == (7, 3, 16)
    assert engine.model_fields_set == {"draft_window", "max_num_seqs"}
    assert engine.model_dump(exclude_unset=True) == {"draft_window": 7, "max_num_seqs": 3}


def test_defaults_come_from_the_model():
    app, received = probe()
    run(app, [])
    engine, _ = received[0]
    assert engine == FutureConfig() and engine.model_fields_set == set()


def test_todays_flags_keep_their_spelling_and_meaning():
    app, received = probe(EngineConfig)
    run(app, ["--no-enable-prefix-caching", "--kv-cache-memory", "2GiB", "--enforce-eager",
              "--max-graph-batch-size", "0", "--scheduling-policy", "priority", "--dtype", "bf16",
              "--no-enable-chunked-prefill", "--request-timeout", "2.5", "--model", "some/model"])
    engine, _ = received[0]
    assert engine.enable_prefix_caching is False and engine.enable_chunked_prefill is False
    assert engine.kv_cache_memory == 2 << 30 and engine.enforce_eager is True and engine.max_graph_batch_size == 0
    assert (engine.scheduling_policy, engine.dtype, engine.request_timeout) == ("priority", "bfloat16", 2.5)
    assert engine.model == "some/model"


def test_expert_parallelism_is_a_flag_beside_the_tensor_parallel_size():
    app, received = probe(EngineConfig)
    run(app, ["--tensor-parallel-size", "2", "--enable-expert-parallel"])
    engine, _ = received[0]
    assert engine.tensor_parallel_size == 2 and engine.enable_expert_parallel is True


def test_load_balancing_is_a_flag_and_its_options_json():
    app, received = probe(EngineConfig)
    run(app, ["--tensor-parallel-size", "2", "--enable-expert-parallel", "--enable-eplb", "--eplb-config",
              '{"num_redundant_experts": 2, "step_interval": 50}'])
    engine, _ = received[0]
    assert engine.enable_eplb is True
    assert (engine.eplb_config.num_redundant_experts, engine.eplb_config.step_interval) == (2, 50)
    assert "needs enable_expert_parallel" in run(app, ["--enable-eplb"], exit_code=2)


@pytest.mark.parametrize(("args", "flag", "reason"), [
    (["--max-num-seqs", "0"], "--max-num-seqs", "greater than or equal to 1"),
    (["--kv-cache-memory", "lots"], "--kv-cache-memory", "not a memory size"),
    (["--scheduling-policy", "random"], "--scheduling-policy", "fcfs"),
    (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization", "greater than 0"),
])
def test_a_bad_value_is_a_usage_error_naming_its_option(args, flag, reason):
    app, received = probe(EngineConfig)
    out = run(app, args, exit_code=2)
    assert flag in out and reason in out and not received


def test_json_options_parse_into_the_field_type():
    app, received = probe()
    run(app, ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
              "--limit-mm-per-prompt", '{"image": 2}'])
    engine, _ = received[0]
    assert engine.speculative_config == SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    assert engine.limit_mm_per_prompt == {"image": 2}


@pytest.mark.parametrize(("value", "reason"), [
    ('{"method": "magic", "num_speculative_tokens": 3}', "method"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"method": "ngram"', "Invalid JSON"),
])
def test_a_bad_json_option_is_a_usage_error_naming_it(value, reason):
    app, received = probe()
    out = run(app, ["--speculative-config", value], exit_code=2)
    assert "--speculative-config" in out and reason in out and not received


def test_a_yaml_config_file_sets_options_and_flags_override_it(tmp_path: Path):
    config = tmp_path / "engine.yaml"
    config.write_text("max-num-seqs: 5\nblock_size: 32\nenable-prefix-caching: false\nkv-cache-memory: 64MiB\n"
                      "speculative-config: {method: draft, num_speculative_tokens: 2}\nlabel: from-file\n"
                      "toy.greeting: hi\n")
    app, received = probe()
    run(app, ["--config", str(config), "--max-num-seqs", "7"])
    engine, label = received[0]
    assert (engine.max_num_seqs, engine.block_size, engine.enable_prefix_caching) == (7, 32, False)
    assert engine.kv_cache_memory == 64 << 20 and label == "from-file"
    assert engine.speculative_config == SpeculativeConfig(method="draft", num_speculative_tokens=2)
    assert engine.plugin_options == {"toy.greeting": "hi"}


@pytest.mark.parametrize(("text", "named"), [
    ("max-num-seqz: 5\n", "max-num-seqz"),
    ("max-num-seqs: many\n", "--max-num-seqs"),
    ("max-num-seqs: 0\n", "--max-num-seqs"),
    ("speculative_config: {method: magic, num_speculative_tokens: 1}\n", "--speculative-config"),
    ("- max-num-seqs\n", "must map option names to values"),
])
def test_a_bad_config_file_is_a_usage_error_naming_the_key(tmp_path: Path, text, named):
    config = tmp_path / "engine.yaml"
    config.write_text(text)
    app, received = probe()
    out = run(app, ["--config", str(config)], exit_code=2)
    assert named in out and not received


def test_a_plugin_option_shows_in_help_and_reaches_the_config():
    for command in ENGINE_COMMANDS:
        out = run(build_app(), [*command, "--help"])
        assert "--toy.greeting" in out and "A word the toy plugin logs" in out, out
    app, received = probe(EngineConfig)
    run(app, ["--toy.greeting", "bonjour"])
    run(app, [])
    (given, _), (unset, _) = received
    assert given.plugin_options == {"toy.greeting": "bonjour"}
    assert unset.plugin_options == {} and "plugin_options" not in unset.model_fields_set
