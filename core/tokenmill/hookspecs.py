"""The hook specifications every tokenmill plugin implements a subset of.

A plugin is a module (or object) exposed through the ``tokenmill.plugins``
entry-point group. Its *kind* is simply the set of hooks it implements:
a platform plugin implements :func:`tokenmill_detect_platform`, a model plugin
:func:`tokenmill_register_models`, and so on. The built-in CPU platform and SDPA
backend register through these same hooks.

Rules for implementations:

* An entry-point module imports no torch and touches no device at import time.
  Registration hooks return spec records (:mod:`tokenmill.plugins.specs`) whose
  classes are named by lazy ``"module:Class"`` strings.
* A spec only ever gains keyword arguments; pluggy lets an implementation accept
  a subset of them, so plugins written today keep working.
* A plugin module may declare ``TOKENMILL_PLUGIN_API = 1``; the core refuses a
  plugin whose declared major version it does not speak.

Hooks marked *collect* return one result per implementation (``None`` results
are dropped); hooks marked *firstresult* stop at the first non-``None`` answer,
and the core's own default is registered ``trylast``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from tokenmill.plugins.specs import (
        AttentionBackendSpec,
        KVConnectorSpec,
        ModelSpec,
        OptionSpec,
        PlatformSpec,
        QuantMethodSpec,
        SpecDecodeSpec,
    )

PROJECT_NAME = "tokenmill"
PLUGIN_API_VERSION = 1

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def tokenmill_detect_platform() -> PlatformSpec | None:
    """Report a platform this machine has, or ``None``.

    Called once per process when the engine starts, before any model is
    built. The core picks the available platform of highest priority and falls
    back to the CPU platform. Collect hook.
    """


@hookspec
def tokenmill_register_attention_backends(platform: Any) -> list[AttentionBackendSpec] | None:
    """Return the attention backends this plugin offers on ``platform``.

    ``platform`` is the chosen platform object (its ``device_type`` tells which
    devices the backend must support). Called in every process that builds a
    model. Collect hook; names must be unique across plugins.
    """


@hookspec(firstresult=True)
def tokenmill_select_attention_backend(
    request: Any, candidates: list[AttentionBackendSpec], platform: Any
) -> str | None:
    """Choose the attention backend name for ``request``.

    ``request`` is an :class:`tokenmill.attention.AttentionRequirements`
    (dtype, head size, sliding window, the user's explicit choice). The
    ``candidates`` are the registered backends that support it. Firstresult;
    the core's default (``trylast``) honours an explicit choice, then priority.
    """


@hookspec
def tokenmill_register_models() -> dict[str, ModelSpec] | None:
    """Map architecture names (``config.json`` ``architectures``) to model specs.

    Called once per process when a model is resolved. Collect hook; two plugins
    registering one architecture is an error naming both distributions.
    """


@hookspec(firstresult=True)
def tokenmill_resolve_model_class(architecture: str, hf_config: Any, platform: Any) -> str | None:
    """Return the qualname of the model class to build for ``architecture``.

    Lets a platform swap in its own implementation. Firstresult; the core's
    default (``trylast``) looks the architecture up in the registered models.
    """


@hookspec
def tokenmill_register_quantization_methods(platform: Any) -> list[QuantMethodSpec] | None:
    """Return the quantization methods and quantized file formats offered.

    Called when a model is loaded, in every process that loads weights.
    Collect hook; names must be unique across plugins.
    """


@hookspec
def tokenmill_register_spec_decode_methods() -> list[SpecDecodeSpec] | None:
    """Return speculative-decoding proposers. Collect hook."""


@hookspec
def tokenmill_register_kv_connectors() -> list[KVConnectorSpec] | None:
    """Return KV connectors (scheduler side and worker side). Collect hook."""


@hookspec
def tokenmill_register_tool_parsers() -> dict[str, str] | None:
    """Map tool-call parser names to ``"module:Class"`` qualnames. Collect hook.

    Called in the server process when it starts (``--tool-call-parser NAME``) and by
    ``tokenmill plugins``. The class implements :class:`tokenmill.tool_parsers.ToolParser`
    and is imported only when chosen; names must be unique across plugins.
    """


@hookspec
def tokenmill_register_reasoning_parsers() -> dict[str, str] | None:
    """Map reasoning parser names to ``"module:Class"`` qualnames. Collect hook."""


@hookspec
def tokenmill_register_structured_output_backends() -> dict[str, str] | None:
    """Map structured-output backend names to ``"module:Class"`` qualnames.

    Called in the engine process when the engine starts; only the backend named
    by ``EngineConfig.structured_outputs_backend`` (default ``"xgrammar"``,
    registered by the core) is imported, and only on the first constrained
    request. The class implements
    :class:`tokenmill.structured_output.backend.StructuredOutputBackend`: built
    with ``(tokenizer, vocab_size, stop_token_ids)``, it validates constraints
    (``InvalidRequestError`` naming the field for a bad one), compiles them (in
    a worker thread) and makes one matcher per request, which fills int32
    bit-packed token bitmasks. Collect hook; two plugins registering one name
    is an error naming both distributions.
    """


@hookspec
def tokenmill_process_start(role: str, rank: int, config: Any) -> None:
    """Initialise per-process state.

    Called once in each process the engine starts (``role`` is ``"engine"`` or
    ``"worker"``; ``rank`` the tensor-parallel rank) after plugins load and
    before a model is built. Collect hook; the return value is ignored.
    """


@hookspec(firstresult=True)
def tokenmill_default_model() -> str | None:
    """Return the model (path or hub id) to use when the user names none.

    Called in the engine process when ``model`` is unset. Firstresult.
    """


@hookspec
def tokenmill_add_options() -> list[OptionSpec] | None:
    """Return the options this plugin adds to the engine, as :class:`OptionSpec` records.

    Each ``OptionSpec(name, type, default, help)`` becomes the key ``"<plugin>.<name>"`` of
    ``EngineConfig.plugin_options``, where ``<plugin>`` is the plugin's entry-point name:
    ``LLM(..., plugin_options={"toy.greeting": "hi"})`` sets it from Python, and the
    command-line option ``--<plugin>.<name>`` (underscores written as dashes in both parts,
    e.g. ``--toy.greeting``; a ``bool`` is an on/off pair ``--x/--no-x``) or the same key in a
    ``--config`` YAML file sets it from ``generate``, ``serve`` and ``bench throughput|latency``.

    Called by the CLI when it builds those commands, and by the engine process at start-up,
    after plugins load and before :func:`tokenmill_process_start`: the engine rejects a key no
    plugin added or a value ``type`` rejects (``ConfigError``), fills in the defaults, and passes
    the completed dict to every hook through ``config.plugin_options``. Collect hook; two
    options of one plugin with the same name are an error.
    """
