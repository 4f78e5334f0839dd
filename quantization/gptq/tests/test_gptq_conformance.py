"""The gptq method through the conformance kit: ``qweight``/``qzeros``/``scales``/``g_idx``
(tests/gptq_models.py's packer, checked bit for bit against AutoGPTQ's in
test_gptq_checkpoints.py) against the dequantised weight, for the v1 and v2 formats,
symmetric and not, with and without act order. A weight-only method: the only error is
the float accumulation order (the default 1e-5)."""

from __future__ import annotations

from gptq_models import GptqRecipe, gptq_tensors, quantize

from tokenmill.testing.quantization import QuantizationConformance, QuantizedWeights, random_weight


class _GptqConformance(QuantizationConformance):
    method = "gptq"
    recipe = GptqRecipe()
    activation_dtypes = ("float32", "bfloat16")

    def make_weights(self, out_features: int, in_features: int, seed: int) -> QuantizedWeights:
        import torch

        # the shards of a merged layer share their input, so its act order (seeded by the input size)
        order = torch.randperm(in_features, generator=torch.Generator().manual_seed(in_features)) \
            if self.recipe.desc_act else None
        layer = quantize(random_weight(out_features, in_features, seed), self.recipe, order)
        return QuantizedWeights(gptq_tensors(layer, self.recipe), layer.dequantized())


def _conformance(recipe: GptqRecipe) -> type[_GptqConformance]:
    return type("Conformance", (_GptqConformance,), {"recipe": recipe, "quantization_config": recipe.config()})


TestGptq4BitConformance = _conformance(GptqRecipe())
TestGptqSymmetricV2Conformance = _conformance(GptqRecipe(sym=True, checkpoint_format="gptq_v2"))
TestGptq8BitActOrderConformance = _conformance(GptqRecipe(bits=8, desc_act=True))
