"""The hook specifications: the whole contract between tokenmill and its plugins.

A plugin is a module (or object) exposed through the ``tokenmill.plugins``
entry-point group. Its *kind* is simply the set of hooks it implements: a
platform plugin implements :func:`tokenmill_detect_platform`, a model plugin
:func:`tokenmill_register_models`, and so on. The built-in CPU platform, the SDPA
backend and the core's own defaults (:mod:`tokenmill.plugins.defaults`) register
through these same hooks.

Rules for implementations:

* An entry-point module imports no torch and touches no device at import time.
  Registration hooks return spec records (:mod:`tokenmill.plugins.specs`) whose
  classes are named by lazy ``"module:Class"`` strings.
* Import only the public surface, :mod:`tokenmill.plugin_api` (see there).
* A spec only ever gains keyword arguments; pluggy lets an implementation accept
  a subset of them, so plugins written today keep working.
* A plugin module may declare ``TOKENMILL_PLUGIN_API = 1``; the core refuses a
  plugin whose declared major version it does not speak.

Two calling conventions:

* *collect* hooks are called on every implementation and keep each non-``None``
  answer together with the plugin that gave it
  (:meth:`tokenmill.plugins.manager.PluginManager.collect`); hooks that register
  names refuse a name claimed by two plugins, naming both distributions.
* *firstresult* hooks stop at the first non-``None`` result; the core's own
  default implementation is registered ``trylast``, so any plugin answers first.

Start-up order. Building an engine (``LLM``, ``AsyncLLM``, ``tokenmill serve``)
calls the hooks in this order, each in the process named:

1. the CLI, building the options of a command that starts an engine:
   :func:`tokenmill_add_options`;
2. engine process: :func:`tokenmill_add_options` (checking ``plugin_options``),
   then :func:`tokenmill_detect_platform`, then the platform's
   ``configure_process``, then :func:`tokenmill_process_start` (``role="engine"``);
3. engine process, when no model is named: :func:`tokenmill_default_model`;
4. reading the checkpoint: :func:`tokenmill_register_quantization_methods`
   (single-file formats and their loaders, quantization configs);
5. engine process: :func:`tokenmill_register_executors`, to build the executor
   that ``EngineConfig.distributed_executor_backend`` names;
6. each worker process (the engine process itself for the ``"uni"`` executor):
   :func:`tokenmill_process_start` (``role="worker"``), then model resolution —
   :func:`tokenmill_register_models` and :func:`tokenmill_resolve_model_class` —
   then, once the model is built, :func:`tokenmill_register_attention_backends`
   and :func:`tokenmill_select_attention_backend`;
7. engine process, once the KV cache is allocated:
   :func:`tokenmill_register_structured_output_backends`;
8. with a ``speculative_config`` only: :func:`tokenmill_register_spec_decode_methods`,
   in the engine process (checking the method before any worker starts) and in the
   worker that samples (building the proposer once its runner exists);
9. with a ``kv_transfer_config`` only: :func:`tokenmill_register_kv_connectors`, in the
   engine process (checking the connector before any worker starts, building its scheduler
   half) and in each worker (building its worker half once the runner exists).

The server calls :func:`tokenmill_register_tool_parsers` and
:func:`tokenmill_register_reasoning_parsers` when it starts.
``tokenmill plugins`` calls every registration hook (those taking no argument
but ``platform``) to list what each plugin registers.

Hooks declared *experimental* (none in this version) are reserved names that this
version of tokenmill never calls: implementing one warns
(:class:`ExperimentalHookWarning`) and ``tokenmill plugins`` marks it "not called
by this version".
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from tokenmill.attention import AttentionRequirements
    from tokenmill.config import EngineConfig
    from tokenmill.platform import Platform
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


class ExperimentalHookWarning(UserWarning):
    """A plugin implements a hook this version of tokenmill declares but never calls."""


NOT_CALLED = "not called by this version"


def _experimental(what: str) -> ExperimentalHookWarning:
    return ExperimentalHookWarning(f"{what}: a reserved hook, {NOT_CALLED} of tokenmill; the implementation is ignored")


# ---------------------------------------------------------------------------
# Start-up: the platform, per-process set-up, options, the executor
# ---------------------------------------------------------------------------


@hookspec
def tokenmill_detect_platform() -> PlatformSpec | None:
    """Report a platform this machine has, or ``None`` when its device is absent.

    The hook should import its device library (torch, a driver binding) inside
    the function, never at module import time.

    :returns: a :class:`~tokenmill.plugins.specs.PlatformSpec` naming the
        platform class by ``"module:Class"`` and its priority.

    Called: once in the engine process when an engine starts (and in each worker
    process an executor starts), before anything else touches a device, and by
    ``tokenmill plugins``. The core instantiates
    the class of the available platform with the highest ``priority`` and calls
    its ``configure_process(config)``.

    Default: none in the core; the CPU platform plugin answers with priority 0.
    Collect hook.
    """


@hookspec
def tokenmill_process_start(role: str, rank: int, config: EngineConfig) -> None:
    """Set up per-process state (logging, environment, a device context).

    :param role: ``"engine"`` in the engine process, ``"worker"`` in each worker.
    :param rank: the worker's rank (0 for the engine process and a single worker).
    :param config: the engine's configuration.

    Called: once in each process the engine starts, after the platform's
    ``configure_process`` and before any model is built; in the engine process
    with ``role="engine"``, then in each worker with ``role="worker"`` (for the
    in-process ``"uni"`` executor, that is the engine process again).

    Default: none. Collect hook; the return value is ignored.
    """


@hookspec
def tokenmill_add_options() -> list[OptionSpec] | None:
    """Declare namespaced options (``<plugin>.<name>``) for the CLI and ``LLM(...)``.

    :returns: :class:`~tokenmill.plugins.specs.OptionSpec` records (name, type,
        default, help). Each is the key ``"<plugin>.<name>"`` of
        ``EngineConfig.plugin_options`` (``<plugin>``: the plugin's entry-point name),
        set from Python as ``LLM(..., plugin_options={"toy.greeting": "hi"})`` and on
        the command line as ``--<plugin>.<name>`` — underscores written as dashes in
        both parts (``--toy.greeting hi``), a ``bool`` as an on/off pair
        ``--x/--no-x`` — or as that key in a ``--config`` YAML file.

    Called: by the CLI when a command that starts an engine (``generate``,
    ``serve``, ``bench throughput|latency``) builds its options, so they appear in
    its ``--help``; and in the engine process once plugins load, before
    :func:`tokenmill_detect_platform`, which checks ``plugin_options`` against the
    specs — a key no plugin declares, or a value its ``type`` rejects, is a
    ``ConfigError`` naming the key — and fills in the defaults, so every later hook
    reads ``config.plugin_options["<plugin>.<name>"]`` (for example
    :func:`tokenmill_process_start`).

    Default: none. Collect hook; one plugin declaring a name twice is an error.
    """


@hookspec
def tokenmill_register_executors() -> dict[str, str] | None:
    """Map executor names to the ``"module:Class"`` of their executor.

    :returns: ``{name: "module:Class"}``; each class is a
        :class:`tokenmill.plugin_api.Executor` subclass, imported only when chosen.

    Called: in the engine process when an engine starts, after the checkpoint is
    read and before the model is built; ``EngineConfig.distributed_executor_backend``
    names the executor to build.

    Default: the core registers ``"uni"`` (one worker in the engine process),
    the default backend. Collect hook; two plugins registering one name is an
    error naming both distributions.
    """


@hookspec(firstresult=True)
def tokenmill_default_model() -> str | None:
    """Name the model to serve when the user names none.

    :returns: a local path or a Hugging Face hub id.

    Called: in the engine process when an engine starts with ``model`` unset,
    before the checkpoint is read; ``tokenmill plugins`` lists the answers.

    Default: none; with no answer the engine refuses to start, saying so.
    Stops at first non-``None`` result.
    """


# ---------------------------------------------------------------------------
# Model resolution: checkpoint formats, architectures, attention backends
# ---------------------------------------------------------------------------


@hookspec
def tokenmill_register_quantization_methods(platform: Platform) -> list[QuantMethodSpec] | None:
    """Return the quantization methods and quantized file formats this plugin offers.

    :param platform: the chosen platform, to offer only what runs on its device.
    :returns: :class:`~tokenmill.plugins.specs.QuantMethodSpec` records; a
        single-file format sets ``file_suffixes`` and ``loader_qualname``.

    Called: in every process that reads a checkpoint, before its weights are
    loaded, to find a loader for a single file (``.gguf``) and the method a
    checkpoint's ``quantization_config`` (or ``quantization=``) names.

    Default: none; a checkpoint folder without a quantization config loads as
    float safetensors. Collect hook; names must be unique across plugins.
    """


@hookspec
def tokenmill_register_models() -> dict[str, ModelSpec] | None:
    """Map architecture names (``config.json`` ``architectures``) to model specs.

    :returns: ``{architecture: ModelSpec("module:Class")}``; the class is
        imported only when a checkpoint names the architecture.

    Called: in each process that builds a model (every worker), once per model,
    and by ``tokenmill plugins``.

    Default: none; the Llama family ships as a plugin. Collect hook; two plugins
    registering one architecture is an error naming both distributions.
    """


@hookspec(firstresult=True)
def tokenmill_resolve_model_class(architecture: str, hf_config: PretrainedConfig, platform: Platform) -> str | None:
    """Choose the class that implements ``architecture`` for this checkpoint.

    Lets a platform swap in its own implementation of an architecture (a fused
    variant, say) without registering the name a second time.

    :param architecture: one entry of the checkpoint's ``architectures``, tried in order.
    :param hf_config: the checkpoint's transformers config.
    :param platform: the chosen platform.
    :returns: the ``"module:Class"`` to build.

    Called: in each process that builds a model, after
    :func:`tokenmill_register_models`, once per architecture until one resolves.

    Default: none answers; the core then uses the class registered for the
    architecture. Stops at first non-``None`` result.
    """


@hookspec
def tokenmill_register_attention_backends(platform: Platform) -> list[AttentionBackendSpec] | None:
    """Return the attention backends this plugin offers on ``platform``.

    :param platform: the chosen platform (its ``device_type`` tells which devices
        the backend must support).
    :returns: :class:`~tokenmill.plugins.specs.AttentionBackendSpec` records
        (name, qualname, device types, dtypes, head sizes, sliding window, priority,
        attention soft-capping).

    Called: in each process that builds a model, once the model is built (its
    head size and dtype are known), and by ``tokenmill plugins``.
    The head size and the other needs come from the layers whose ``kv_cache_spec``
    (tokenmill.attention.kv_spec) is of kind ``"kv"``: a ``"latent"`` layer (DeepSeek's
    latent attention, ``tokenmill.layers.LatentAttention``) writes and reads its own cache, so
    a backend never sees one (a model of latent layers alone asks for head size 0, as an
    encoder does).

    Default: none in the core; SDPA and the CPU platform's paged backend ship as
    plugins. Collect hook; names must be unique across plugins.
    """


@hookspec(firstresult=True)
def tokenmill_select_attention_backend(
    request: AttentionRequirements, candidates: list[AttentionBackendSpec], platform: Platform
) -> str | None:
    """Choose the attention backend for the model about to run.

    :param request: what the model needs (device type, dtype, head size, sliding
        window, attention soft-capping) and the user's explicit choice
        (``preferred``), if any.
    :param candidates: the registered backends that can run ``request`` on this platform,
        best ranked first (by the platform's ``attention_priorities``, else each spec's
        ``priority``; tokenmill.attention.selection).
    :param platform: the chosen platform.
    :returns: the name of one backend (normally one of ``candidates``).

    Called: in each process that builds a model, right after
    :func:`tokenmill_register_attention_backends`; again, without the backend
    that failed, when the chosen one cannot be built (unless the user named it).

    Default (``trylast``): the user's choice, else the first candidate. Stops at
    first non-``None`` result.
    """


# ---------------------------------------------------------------------------
# Requests: what individual requests may ask for
# ---------------------------------------------------------------------------


@hookspec
def tokenmill_register_structured_output_backends() -> dict[str, str] | None:
    """Map structured-output backend names to ``"module:Class"`` qualnames.

    :returns: ``{name: "module:Class"}``. The class implements
        :class:`tokenmill.plugin_api.StructuredOutputBackend`: built
        with ``(tokenizer, vocab_size, stop_token_ids)``, it validates constraints
        (``InvalidRequestError`` naming the field for a bad one), compiles them (in
        a worker thread) and makes one matcher per request, which fills int32
        bit-packed token bitmasks.

    Called: in the engine process when the engine starts, after the KV cache is
    allocated. Only the backend named by ``EngineConfig.structured_outputs_backend``
    is imported, and only on the first constrained request.

    Default: the core registers ``"xgrammar"``, the default backend. Collect
    hook; two plugins registering one name is an error naming both distributions.
    """


# ---------------------------------------------------------------------------
# Server: the OpenAI-compatible front end
# ---------------------------------------------------------------------------


@hookspec
def tokenmill_register_tool_parsers() -> dict[str, str] | None:
    """Map tool-call parser names to ``"module:Class"`` qualnames.

    :returns: ``{name: "module:Class"}``; the class implements
        :class:`tokenmill.plugin_api.ToolParser` and is imported only when chosen.

    Called: in the server process when it starts with ``--tool-call-parser
    NAME``, and by ``tokenmill plugins``.

    Default: none in the core; hermes and llama3_json ship in
    ``tokenmill-tool-parsers``. Collect hook; names must be unique across plugins.
    """


@hookspec
def tokenmill_register_reasoning_parsers() -> dict[str, str] | None:
    """Map reasoning parser names to ``"module:Class"`` qualnames.

    :returns: ``{name: "module:Class"}``; the class implements
        :class:`tokenmill.plugin_api.ReasoningParser` (split a reply into its reasoning and
        its content, whole or streamed, and move a structured-output constraint past the
        reasoning section) and is imported only when chosen.

    Called: in the server process when it starts with ``--reasoning-parser NAME``, and by
    ``tokenmill plugins``.

    Default: none in the core; deepseek_r1 and qwen3 ship in
    ``tokenmill-reasoning-parsers``. Collect hook; names must be unique across plugins.
    """


@hookspec
def tokenmill_register_spec_decode_methods() -> list[SpecDecodeSpec] | None:
    """Return speculative-decoding proposers.

    :returns: :class:`~tokenmill.plugins.specs.SpecDecodeSpec` records: ``name`` (what
        ``speculative_config={"method": NAME}`` selects), ``proposer_qualname`` (a
        ``"module:Class"`` implementing :class:`tokenmill.plugin_api.Proposer`, imported only
        when chosen) and ``needs_draft_model`` (the config must then name a ``model``, whose
        vocabulary and context length the engine checks against the target's at start; the
        context length only with ``checks_draft_positions``, the default).

    Called: in the engine process when it starts with a ``speculative_config`` (to check the
    method exists), in the worker that samples (to build the proposer:
    ``cls(config: SpeculativeConfig, context: ProposerContext)``), and by ``tokenmill plugins``.

    After every step the runner calls ``proposer.propose(requests)`` with each request that
    sampled (its tokens so far) and gets up to ``num_speculative_tokens`` drafts per request;
    the next step verifies them in the target's forward pass, and the rejection sampler keeps
    the output distribution the target's own. ``proposer.forget(req_ids)`` is called for
    requests that finished or were preempted.

    A proposer that drafts from the target's hidden states sets ``uses_target_hidden_states``
    and gets them through ``observe`` first: the final ones, or those of the target layers it
    names in ``target_layer_ids`` (EAGLE-3), which the runner asks the model for through the
    optional model methods ``set_aux_hidden_state_layers`` / ``take_aux_hidden_states``
    (:class:`tokenmill.worker.model_interface.AuxHiddenStatesCausalLM`; a model without them
    fails the start of such a proposer).

    Default: none in the core; ``ngram`` ships in ``tokenmill-spec-ngram``. Collect hook;
    names must be unique across plugins.
    """


@hookspec
def tokenmill_register_kv_connectors() -> list[KVConnectorSpec] | None:
    """Return KV connectors: what moves a request's KV cache between engines (disaggregated
    prefill and decode) or to and from an external tier (offload).

    :returns: :class:`~tokenmill.plugins.specs.KVConnectorSpec` records: ``name`` (what
        ``kv_transfer_config={"kv_connector": NAME}`` selects), ``scheduler_qualname`` and
        ``worker_qualname`` (``"module:Class"`` of its two halves, implementing
        :class:`tokenmill.plugin_api.KVConnectorScheduler` and
        :class:`tokenmill.plugin_api.KVConnectorWorker`, imported only when chosen; each is
        built as ``cls(context: KVConnectorContext)``).

    Called: in the engine process when it starts with a ``kv_transfer_config`` (to check the
    connector exists, then to build its scheduler half next to the scheduler), in each worker
    (to build its worker half once the model runner exists; it is handed the KV tensors when
    they are allocated), and by ``tokenmill plugins``.

    The two halves talk only through the metadata the scheduler half builds each step (carried
    to the workers in ``SchedulerOutput.kv_connector_metadata``) and the
    :class:`~tokenmill.plugin_api.KVConnectorOutput` the worker half reports with each step's
    output. The scheduler half is asked, once per waiting request and after the local
    prefix-cache lookup, how many more prompt tokens it can load (whole blocks, never the last
    prompt token); such a request gets blocks and waits in ``WAITING_FOR_REMOTE_KVS`` without
    holding up the queue, until the worker half reports its load finished (it then runs with
    those tokens computed) or failed (it computes them itself: a failed, corrupt or late load
    is never used). The worker half starts loads before each forward, may wait for and save
    each attention layer's KV inside the forward, and finishes its saves after it. When a
    request ends, the scheduler half may keep its blocks until the worker half reports them
    sent. The step-by-step contract is in :mod:`tokenmill.kv_transfer.connector` and
    docs/plugins.md.

    Default: none in the core; ``kv_shared_storage`` ships in ``tokenmill-kv-shared-storage``.
    Collect hook; names must be unique across plugins.
    """


# ---------------------------------------------------------------------------
# Reserved names this version never calls go here, each as
# ``@hookspec(warn_on_impl=_experimental(NAME))``: an implementation is accepted (with an
# ExperimentalHookWarning) and ignored; the issue that needs one gives it a caller and moves
# it up to its phase. None is reserved today.
# ---------------------------------------------------------------------------


# ---------------------------------------------------------------------------
# Reading the specs (the plugin manager and ``tokenmill plugins``)
# ---------------------------------------------------------------------------


def hook_names() -> list[str]:
    """Every hook this module declares, in declaration order (phase by phase)."""
    return [name for name, obj in globals().items()
            if name.startswith(f"{PROJECT_NAME}_") and getattr(obj, f"{PROJECT_NAME}_spec", None) is not None]


def is_experimental(hook_name: str) -> bool:
    """Whether ``hook_name`` is one of the reserved hooks this version never calls."""
    opts = getattr(globals().get(hook_name), f"{PROJECT_NAME}_spec", None) or {}
    return isinstance(opts.get("warn_on_impl"), ExperimentalHookWarning)
