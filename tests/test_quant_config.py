"""Choosing a model's quantization config from the installed plugins (the GGUF plugin
and the example int8 plugin): an explicit option, the checkpoint's quant_method, or
the single-file format that produced the checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_models import COMMON
from tokenmill_example_int8.method import Int8WeightOnlyConfig

from tokenmill import EngineConfig
from tokenmill.errors import UnsupportedModelError, UnsupportedQuantizationError
from tokenmill.layers import Linear
from tokenmill.model_loader.checkpoint import Checkpoint
from tokenmill.model_loader.quant_config import resolve_quant_config
from tokenmill.plugins.manager import get_plugin_manager
from tokenmill_quant_gguf.linear_method import GGUFLinearMethod
from tokenmill_quant_gguf.method import GGUFConfig


def _checkpoint(quantization_config=None, format="safetensors") -> Checkpoint:
    from transformers import LlamaConfig

    hf_config = LlamaConfig(**COMMON)
    if quantization_config is not None:
        hf_config.quantization_config = quantization_config
    return Checkpoint(path=Path("unused"), hf_config=hf_config, weights=lambda: iter(()), tokenizer=None,
                      format=format)


def _resolve(checkpoint: Checkpoint, requested: str | None = None):
    return resolve_quant_config(checkpoint, get_plugin_manager(), platform=None, requested=requested)


def test_a_float_checkpoint_has_no_quant_config():
    assert _resolve(_checkpoint()) is None


def test_the_checkpoints_quant_method_is_matched_against_checkpoint_aliases():
    config = _resolve(_checkpoint({"quant_method": "example_int8", "ignored_layers": ["lm_head"]}))
    assert isinstance(config, Int8WeightOnlyConfig) and config.ignored_layers == ("lm_head",)
    layer = Linear(4, 4)
    assert config.get_linear_method(layer, "lm_head") is None
    assert config.get_linear_method(layer, "model.layers.0.mlp.down_proj") is not None


def test_an_explicit_option_picks_a_method_by_name():
    assert isinstance(_resolve(_checkpoint(), requested="example-int8"), Int8WeightOnlyConfig)
    assert EngineConfig().quantization is None


def test_a_single_file_format_picks_its_method_and_gguf_gives_every_layer_its_blocks():
    config = _resolve(_checkpoint(format="gguf"))
    assert isinstance(config, GGUFConfig)
    assert isinstance(config.get_linear_method(Linear(4, 4), "model.layers.0.self_attn.qkv_proj"), GGUFLinearMethod)


def test_an_unknown_method_is_a_typed_error_listing_the_installed_ones():
    with pytest.raises(UnsupportedQuantizationError, match=r"'hqq'.*installed: .*example-int8 \(example_int8\)") as err:
        _resolve(_checkpoint({"quant_method": "hqq"}))
    assert isinstance(err.value, UnsupportedModelError)
    assert "gguf (gguf)" in err.value.installed
    with pytest.raises(UnsupportedQuantizationError, match=r"option asks for.*'nf4'"):
        _resolve(_checkpoint(), requested="nf4")


def test_an_option_that_contradicts_the_checkpoint_is_refused():
    with pytest.raises(UnsupportedQuantizationError, match="does not match"):
        _resolve(_checkpoint({"quant_method": "example_int8"}), requested="gguf")
