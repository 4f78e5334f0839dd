"""Multimodal inputs: images and videos merged into a language model's token embeddings.

The engine side (:mod:`.processor`) runs the model folder's own Hugging Face processor, which
expands each placeholder into the image's tokens; every item becomes a :class:`MultiModalItem`
that records where its tokens sit and a content hash. The worker side (:mod:`.encoder_runner`)
encodes the items a step's tokens overlap, through the model's ``embed_multimodal``, keeps
the outputs in an :class:`EncoderCache` by content hash, and gives the model the slices the
step needs (``embed_input_ids``). See docs/architecture.md, "Multimodal inputs".
"""

from tokenmill.multimodal.encoder_cache import EncoderCache
from tokenmill.multimodal.inputs import MultiModalItem, content_hash

__all__ = ["EncoderCache", "MultiModalItem", "content_hash"]
