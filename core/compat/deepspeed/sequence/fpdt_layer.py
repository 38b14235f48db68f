"""``deepspeed.sequence.fpdt_layer``: FPDT (Fully Pipelined Distributed Transformer), DeepSpeed's chunked
sequence-parallel attention with CUDA streams, flash-attention kernels and host offloading. The names import; using
one raises :class:`NotSupportedByTorsh`: Ulysses attention (``deepspeed.sequence.layer.DistributedAttention``) runs
the same sequence parallelism without the chunking."""

from __future__ import annotations

from .._unsupported import NotSupportedByTorsh, message, unsupported_class

_INSTEAD = ("FPDT's chunked, offloaded attention needs DeepSpeed's CUDA kernels; use "
            "deepspeed.sequence.layer.DistributedAttention (Ulysses) for sequence parallelism")


def _function(name: str) -> type:
    """An autograd-Function-shaped name: ``.apply`` (and construction) raise :class:`NotSupportedByTorsh`."""

    def apply(*args, **kwargs):
        raise NotSupportedByTorsh(message(f"sequence.fpdt_layer.{name}", _INSTEAD))

    cls = unsupported_class(f"sequence.fpdt_layer.{name}", _INSTEAD)
    cls.apply = staticmethod(apply)
    return cls


FPDT_InputConstruct = unsupported_class("sequence.fpdt_layer.FPDT_InputConstruct", _INSTEAD)
FPDT_Attention = unsupported_class("sequence.fpdt_layer.FPDT_Attention", _INSTEAD)
SequenceChunk = unsupported_class("sequence.fpdt_layer.SequenceChunk", _INSTEAD)
_FPDTGPUAttentionImpl_ = _function("_FPDTGPUAttentionImpl_")
_FPDTGPUOffloadingAttentionImpl_ = _function("_FPDTGPUOffloadingAttentionImpl_")
FPDT_FFN = _function("FPDT_FFN")
FPDT_LogitsLoss = _function("FPDT_LogitsLoss")
