"""Tool-call parsers plugin: ``hermes`` and ``llama3_json``.

Importing this module imports no parser: the hook names them by qualname and
the server imports the one ``--tool-call-parser`` chooses.
"""

from tokenmill.plugin_api import hookimpl

TOKENMILL_PLUGIN_API = 1


@hookimpl
def tokenmill_register_tool_parsers() -> dict[str, str]:
    return {
        "hermes": "tokenmill_tool_parsers.hermes:HermesToolParser",
        "llama3_json": "tokenmill_tool_parsers.llama3_json:Llama3JsonToolParser",
    }
