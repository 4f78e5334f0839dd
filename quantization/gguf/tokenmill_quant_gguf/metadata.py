"""GGUF metadata, decoded once into plain Python values.

``gguf.GGUFReader`` keeps every key as raw numpy parts, including the 50k-entry
vocabulary arrays. We decode the scalars, strings and short arrays we need into
a small immutable record and keep only the *length* of the long arrays, so the
reader (and its hundreds of MB of parsed parts) can be dropped after loading.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gguf import GGUFReader, GGUFValueType, ReaderField

# Arrays longer than this (vocabularies, merges, scores) are counted, not decoded.
SHORT_ARRAY_LIMIT = 64


@dataclass(frozen=True)
class GGUFMetadata:
    """A GGUF file's key/value metadata and tensor shapes.

    ``values`` maps keys to scalars, strings and short lists; ``array_lengths``
    gives the length of every array key; ``tensor_shapes`` uses torch order
    (outermost dimension first), the reverse of ggml's ``ne``.
    """

    values: Mapping[str, Any]
    array_lengths: Mapping[str, int]
    tensor_shapes: Mapping[str, tuple[int, ...]]

    @property
    def architecture(self) -> str:
        return str(self.values["general.architecture"])

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    def arch_value(self, suffix: str, default: Any = None) -> Any:
        """``<architecture>.<suffix>``: llama.cpp prefixes model hyperparameters with the arch name."""
        return self.values.get(f"{self.architecture}.{suffix}", default)

    def require_arch_value(self, suffix: str) -> Any:
        key = f"{self.architecture}.{suffix}"
        if key not in self.values:
            raise ValueError(f"GGUF metadata lacks {key!r}, which a {self.architecture} model needs")
        return self.values[key]


def read_metadata(reader: GGUFReader) -> GGUFMetadata:
    """Decode ``reader``'s fields and tensor table."""
    values: dict[str, Any] = {}
    lengths: dict[str, int] = {}
    for key, field in reader.fields.items():
        if field.types and field.types[0] == GGUFValueType.ARRAY:
            lengths[key] = len(field.data)
            if len(field.data) <= SHORT_ARRAY_LIMIT:
                values[key] = [_part_value(field, index, field.types[-1]) for index in field.data]
        elif field.data:
            values[key] = _part_value(field, field.data[0], field.types[0])
    shapes = {tensor.name: tuple(int(d) for d in reversed(tensor.shape.tolist())) for tensor in reader.tensors}
    return GGUFMetadata(values=values, array_lengths=lengths, tensor_shapes=shapes)


def _part_value(field: ReaderField, index: int, value_type: GGUFValueType) -> Any:
    part = field.parts[index]
    if value_type == GGUFValueType.STRING:
        return bytes(part).decode("utf-8")
    # .item() turns numpy scalars into Python ints/floats/bools that configs serialise cleanly.
    return part[0].item()
