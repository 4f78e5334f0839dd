"""The GPTQ torch path: the packed-int building blocks of :mod:`tokenmill.layers` (shared with
the AWQ and compressed-tensors plugins), under the names this plugin's modules use."""

from tokenmill.layers import (
    SUPPORTED_BITS,
    dequantize_grouped,
    dequantized_linear,
    gptq_dequantize,
    pack_columns,
    pack_rows,
    unpack_columns,
    unpack_rows,
    values_per_word,
)

__all__ = ["SUPPORTED_BITS", "dequantize_grouped", "dequantized_linear", "gptq_dequantize", "pack_columns",
           "pack_rows", "unpack_columns", "unpack_rows", "values_per_word"]
