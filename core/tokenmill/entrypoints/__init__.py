"""User-facing entry points: the offline ``LLM`` and the streaming ``AsyncLLM``."""
