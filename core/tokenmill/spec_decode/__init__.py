"""Speculative decoding: proposers (plugins behind ``tokenmill_register_spec_decode_methods``)
guess the next tokens, the target model verifies them in one forward pass, and a rejection
sampler keeps the target's output distribution exact (``tokenmill.sample.rejection_sampler``).

This package imports no torch: the config and the proposer protocol are read by the
engine's configuration and by entry-point modules."""

from tokenmill.spec_decode.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
