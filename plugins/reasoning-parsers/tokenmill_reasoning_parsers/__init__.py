"""Reasoning parsers plugin: ``deepseek_r1`` and ``qwen3``.

Importing this module imports no parser: the hook names them by qualname and
the server imports the one ``--reasoning-parser`` chooses.
"""

from tokenmill.plugin_api import hookimpl

TOKENMILL_PLUGIN_API = 1


@hookimpl
def tokenmill_register_reasoning_parsers() -> dict[str, str]:
    return {
        "deepseek_r1": "tokenmill_reasoning_parsers.deepseek_r1:DeepSeekR1ReasoningParser",
        "qwen3": "tokenmill_reasoning_parsers.qwen3:Qwen3ReasoningParser",
    }
