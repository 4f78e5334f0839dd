"""Registers the ``ToyLMForCausalLM`` architecture (no torch at import time), and one option,
``toy.greeting``, to show how a plugin adds one (``--toy.greeting`` on the command line)."""

import logging
from typing import Any

from tokenmill.plugin_api import ModelSpec, OptionSpec, hookimpl

TOKENMILL_PLUGIN_API = 1

logger = logging.getLogger(__name__)


@hookimpl
def tokenmill_register_models() -> dict[str, ModelSpec]:
    return {"ToyLMForCausalLM": ModelSpec("tokenmill_example_toy.model:ToyLMForCausalLM")}


@hookimpl
def tokenmill_add_options() -> list[OptionSpec]:
    return [OptionSpec("greeting", str, "hello", "A word the toy plugin logs when an engine process starts")]


@hookimpl
def tokenmill_process_start(role: str, config: Any) -> None:
    logger.info("toy plugin: %s from the %s process", config.plugin_options["toy.greeting"], role)
