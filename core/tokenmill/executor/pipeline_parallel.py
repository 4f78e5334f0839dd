"""Whether a model splits into ``pipeline_parallel_size`` stages: checked before any worker starts."""

from __future__ import annotations

from typing import Any


def check_pipeline_parallel(hf_config: Any, model_cls: type, pipeline_parallel_size: int) -> None:
    """Raise ``ValueError`` when the stages cannot each hold a decoder layer, or when the model
    class does not build by stage (``supports_pipeline_parallel``: it builds its layers through
    :mod:`tokenmill.layers.pipeline`; one that does not would run every layer on every stage)."""
    pp = pipeline_parallel_size
    if pp == 1:
        return
    if not getattr(model_cls, "supports_pipeline_parallel", False):
        raise ValueError(f"pipeline_parallel_size={pp}: {model_cls.__name__} does not split into pipeline stages "
                         "(it sets no supports_pipeline_parallel)")
    layers = getattr(hf_config, "num_hidden_layers", None)
    if layers is None:
        raise ValueError(f"pipeline_parallel_size={pp}: the model's config has no num_hidden_layers to split")
    if pp > layers:
        raise ValueError(f"pipeline_parallel_size={pp} is larger than the model's {layers} layers")
