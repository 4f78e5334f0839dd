"""The ``draft_model`` speculative-decoding method: a second model (``speculative_config``'s
``model``, sharing the target's tokenizer; any family tokenmill can run) proposes the drafts.

Importing this module imports no torch: the hook names the proposer by qualname.
"""

from tokenmill.plugin_api import SpecDecodeSpec, hookimpl

TOKENMILL_PLUGIN_API = 1


@hookimpl
def tokenmill_register_spec_decode_methods() -> list[SpecDecodeSpec]:
    return [SpecDecodeSpec("draft_model", "tokenmill_spec_draft.proposer:DraftModelProposer",
                           needs_draft_model=True)]
