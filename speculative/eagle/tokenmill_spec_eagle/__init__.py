"""The ``eagle`` speculative-decoding method (EAGLE-1): a head of one Llama decoder layer,
fed the target's final hidden state and the next token's embedding, proposes the drafts; and
``eagle3`` (EAGLE-3): a head over three of the target's layers' hidden states, with a draft
vocabulary of its own.

Importing this module imports no torch: the hook names the proposers by qualname.
"""

from tokenmill.plugin_api import SpecDecodeSpec, hookimpl

TOKENMILL_PLUGIN_API = 1


@hookimpl
def tokenmill_register_spec_decode_methods() -> list[SpecDecodeSpec]:
    # needs_draft_model: the head's folder is speculative_config's "model", checked at start
    # (vocabulary, positions) like a draft model's.
    return [SpecDecodeSpec("eagle", "tokenmill_spec_eagle.proposer:EagleProposer", needs_draft_model=True),
            SpecDecodeSpec("eagle3", "tokenmill_spec_eagle.eagle3_proposer:Eagle3Proposer", needs_draft_model=True)]
