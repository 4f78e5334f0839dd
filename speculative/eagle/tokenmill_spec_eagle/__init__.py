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
    # needs_draft_model: the head's folder is speculative_config's "model", its vocabulary checked
    # at start like a draft model's. Not its positions: the head's rotary table is built for the
    # engine's max_model_len, and published heads declare fewer positions than their targets
    # (2048 for yuhuili/EAGLE3-LLaMA3.1-Instruct-8B).
    return [SpecDecodeSpec("eagle", "tokenmill_spec_eagle.proposer:EagleProposer", needs_draft_model=True,
                           checks_draft_positions=False),
            SpecDecodeSpec("eagle3", "tokenmill_spec_eagle.eagle3_proposer:Eagle3Proposer", needs_draft_model=True,
                           checks_draft_positions=False)]
