"""``deepspeed.ops.op_builder`` names: ``from dsplug.ops.op_builder import AsyncIOBuilder``.

The builders of dsplug's native ops (``CPUAdamBuilder``, ``CPUAdagradBuilder``,
``CPULionBuilder``, ``AsyncIOBuilder``, ``SparseAttnBuilder`` -- dsplug's CPU kernels for
``deepspeed.ops.sparse_attention``) build, cache and load them (``is_compatible()``,
``load()``). DeepSpeed's other builders (CUDA kernels: ``FusedAdamBuilder``, ``TransformerBuilder``
...) are here under their names so that scripts probing them keep working: ``is_compatible()`` is
False and ``load()`` raises :class:`OpUnavailableError` naming what to use instead.
"""
from dsplug.op_builder import (  # noqa: F401
    ALL_OPS,
    AsyncIOBuilder,
    CPUAdagradBuilder,
    CPUAdamBuilder,
    CPULionBuilder,
    OpBuilder,
    OpUnavailableError,
    SparseAttnBuilder,
    all_op_status,
    op_status,
)


class UnavailableOpBuilder:
    """A DeepSpeed op builder whose op dsplug does not have."""

    NAME = ""
    BUILD_VAR = ""
    INSTEAD = "its pure-torch counterpart"

    def absolute_name(self) -> str:
        return f"dsplug.ops.{self.NAME}_op"

    def is_compatible(self, verbose: bool = False) -> bool:
        if verbose:
            print(f"[dsplug] {self.NAME}: not available in dsplug; use {self.INSTEAD}")
        return False

    def incompatibility(self) -> str:
        return f"DeepSpeed's {self.NAME} op is not available in dsplug; use {self.INSTEAD}"

    def load(self, verbose: bool = False, fallback: bool = True):
        raise OpUnavailableError(self.incompatibility())

    def jit_load(self, verbose: bool = False):
        return self.load(verbose)

    def builder(self):
        raise OpUnavailableError(self.incompatibility())

    def __repr__(self) -> str:
        return f"{type(self).__name__}(unavailable)"


def _unavailable(class_name: str, name: str, instead: str):
    return type(class_name, (UnavailableOpBuilder,), {"NAME": name, "BUILD_VAR": f"DS_BUILD_{name.upper()}",
                                                      "INSTEAD": instead, "__module__": __name__})


_ADAM = "the 'Adam' / 'AdamW' optimizers (torch's fused / foreach kernels)"
FusedAdamBuilder = _unavailable("FusedAdamBuilder", "fused_adam", _ADAM)
FusedLambBuilder = _unavailable("FusedLambBuilder", "fused_lamb", "the 'Lamb' optimizer")
FusedLionBuilder = _unavailable("FusedLionBuilder", "fused_lion", "the 'Lion' optimizer plugin")
GDSBuilder = _unavailable("GDSBuilder", "gds", "AsyncIOBuilder (the aio handle)")
TransformerBuilder = _unavailable("TransformerBuilder", "transformer", "torch's own transformer layers")
StochasticTransformerBuilder = _unavailable("StochasticTransformerBuilder", "stochastic_transformer",
                                            "torch's own transformer layers")
QuantizerBuilder = _unavailable("QuantizerBuilder", "quantizer",
                                "dsplug.ops.quantize (dsplug's own quantizer op, another API)")
FPQuantizerBuilder = _unavailable("FPQuantizerBuilder", "fp_quantizer", "torch's quantization")
InferenceBuilder = _unavailable("InferenceBuilder", "transformer_inference", "torch's own modules")
InferenceCoreBuilder = _unavailable("InferenceCoreBuilder", "inference_core_ops", "torch's own modules")
RaggedOpsBuilder = _unavailable("RaggedOpsBuilder", "ragged_device_ops", "torch's own modules")
RaggedUtilsBuilder = _unavailable("RaggedUtilsBuilder", "ragged_ops", "torch's own modules")
SpatialInferenceBuilder = _unavailable("SpatialInferenceBuilder", "spatial_inference", "torch's own modules")
RandomLTDBuilder = _unavailable("RandomLTDBuilder", "random_ltd", "torch's own modules")
EvoformerAttnBuilder = _unavailable("EvoformerAttnBuilder", "evoformer_attn",
                                    "torch.nn.functional.scaled_dot_product_attention")
UtilsBuilder = _unavailable("UtilsBuilder", "utils", "torch._utils._flatten_dense_tensors / _unflatten_dense_tensors")
CCLCommBuilder = _unavailable("CCLCommBuilder", "deepspeed_ccl_comm", "the gloo backend (dsplug.comm)")
NotImplementedBuilder = _unavailable("NotImplementedBuilder", "deepspeed_not_implemented", "another op")

__all__ = ["ALL_OPS", "AsyncIOBuilder", "CPUAdagradBuilder", "CPUAdamBuilder", "CPULionBuilder", "OpBuilder",
           "OpUnavailableError", "UnavailableOpBuilder", "all_op_status", "op_status", "CCLCommBuilder",
           "EvoformerAttnBuilder", "FPQuantizerBuilder", "FusedAdamBuilder", "FusedLambBuilder", "FusedLionBuilder",
           "GDSBuilder", "InferenceBuilder", "InferenceCoreBuilder", "NotImplementedBuilder", "QuantizerBuilder",
           "RaggedOpsBuilder", "RaggedUtilsBuilder", "RandomLTDBuilder", "SparseAttnBuilder",
           "SpatialInferenceBuilder", "StochasticTransformerBuilder", "TransformerBuilder", "UtilsBuilder"]
