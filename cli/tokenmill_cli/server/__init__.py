"""The OpenAI-compatible HTTP server over ``AsyncLLM`` (``tokenmill serve``).

One module per concept: ``protocol`` (request schemas), ``responses``
(response schemas), ``errors``, ``auth``, ``sampling`` (request ->
SamplingParams), ``streaming`` (SSE, deltas, disconnects), one module per
endpoint family, and ``app`` which puts them together.
"""

from tokenmill_cli.server.app import build_app
from tokenmill_cli.server.settings import ServerSettings

__all__ = ["ServerSettings", "build_app"]
