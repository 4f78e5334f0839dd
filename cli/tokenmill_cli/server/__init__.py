"""The OpenAI-compatible HTTP server over ``AsyncLLM`` (``tokenmill serve``).

One module per concept: ``protocol`` (request schemas), ``responses``
(response schemas), ``errors``, ``auth``, ``sampling`` (request ->
SamplingParams), ``streaming`` (SSE, deltas, disconnects), one module per
endpoint family, and ``app`` which puts them together. OpenAI's Responses API
(``/v1/responses``) is ``responses_api`` with its own ``responses_protocol``,
``responses_objects``, ``responses_input``, ``responses_events`` and ``response_store``;
Anthropic's Messages API (``/v1/messages``) is ``messages_api`` with ``messages_protocol``,
``messages_objects``, ``messages_input`` and ``messages_events``.
"""

from tokenmill_cli.server.app import build_app
from tokenmill_cli.server.settings import ServerSettings

__all__ = ["ServerSettings", "build_app"]
