"""The engine: core step loop, input/output processing, sync and async front ends."""
