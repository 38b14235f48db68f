"""``deepspeed.ops.op_builder``: DeepSpeed's op builders, reporting truthfully what torsh has.

DeepSpeed compiles C++/CUDA ops (``load()`` builds or loads the extension); scripts and libraries ask a builder
whether its op can run here (``CPUAdamBuilder().is_compatible()``, ``deepspeed.ops.__compatible_ops__[NAME]``)
before using the optimizer class that needs it. torsh compiles nothing: no op is *installed* (prebuilt), and an
op is *compatible* exactly when torsh provides its Python API on a torch implementation (``cpu_adam`` and
``fused_adam``: :mod:`deepspeed.ops.adam` on ``torch.optim.Adam``; ``cpu_adagrad`` on ``torch.optim.Adagrad``).
``load()`` never returns a compiled module: it raises :class:`NotSupportedByTorsh` naming the torch class to use.
"""

from __future__ import annotations

from .._unsupported import NotSupportedByTorsh, message


class OpBuilder:
    """A DeepSpeed op builder (``NAME``); torsh's answer for that op."""

    NAME = "deepspeed_not_implemented"
    #: The torsh class providing the op's Python API on torch (None: torsh does not run the op).
    TORCH_IMPLEMENTATION: str | None = None

    def __init__(self, name: str | None = None):
        self.name = name or self.NAME
        self.error_log = None

    def absolute_name(self) -> str:
        return f"deepspeed.ops.{self.NAME}.{self.NAME}_op"

    def is_compatible(self, verbose: bool = False) -> bool:
        """Whether the op's Python API runs here (on its torch implementation)."""
        return self.TORCH_IMPLEMENTATION is not None

    def is_installed(self) -> bool:
        """False: torsh ships no prebuilt op."""
        return False

    def sources(self) -> list:
        return []

    def include_paths(self) -> list:
        return []

    def cxx_args(self) -> list:
        return []

    def nvcc_args(self) -> list:
        return []

    def load(self, verbose: bool = True):
        if self.TORCH_IMPLEMENTATION is not None:
            instead = f"torsh compiles no op; use {self.TORCH_IMPLEMENTATION}, which runs on torch"
        else:
            instead = "torsh compiles no op and has no torch implementation of this one"
        raise NotSupportedByTorsh(message(f"ops.op_builder.{type(self).__name__}().load()", instead))

    jit_load = load

    def builder(self):
        raise NotSupportedByTorsh(message(f"ops.op_builder.{type(self).__name__}().builder()",
                                          "torsh builds no C++/CUDA extension"))  # fmt: skip


def _builder(class_name: str, name: str, torch_implementation: str | None = None) -> type:
    doc = (f"DeepSpeed's ``{name}`` op: " + (f"runs as {torch_implementation} (torch)" if torch_implementation
                                              else "not run by torsh (is_compatible() is False)"))  # fmt: skip
    return type(class_name, (OpBuilder,), {"NAME": name, "TORCH_IMPLEMENTATION": torch_implementation,
                                            "__doc__": doc, "__module__": __name__})  # fmt: skip


CPUAdamBuilder = _builder("CPUAdamBuilder", "cpu_adam", "deepspeed.ops.adam.DeepSpeedCPUAdam")
FusedAdamBuilder = _builder("FusedAdamBuilder", "fused_adam", "deepspeed.ops.adam.FusedAdam")
CPUAdagradBuilder = _builder("CPUAdagradBuilder", "cpu_adagrad", "deepspeed.ops.adagrad.DeepSpeedCPUAdagrad")
CPULionBuilder = _builder("CPULionBuilder", "cpu_lion")
FusedLambBuilder = _builder("FusedLambBuilder", "fused_lamb")
FusedLionBuilder = _builder("FusedLionBuilder", "fused_lion")


class AsyncIOBuilder(OpBuilder):
    """DeepSpeed's ``async_io`` op (libaio reads and writes of NVMe offload's swap files). Compatible: scripts ask
    ``is_compatible()`` before choosing ``offload_optimizer.device: nvme``, and torsh runs NVMe offload without
    libaio (positional file reads and writes on a thread pool, :mod:`torsh.engine.zero.nvme`). The op itself is
    still not compiled: not installed, and ``load()`` refuses."""

    NAME = "async_io"
    TORCH_IMPLEMENTATION = "offload_optimizer.device nvme (torsh's own file I/O, torsh.engine.zero.nvme)"


GDSBuilder = _builder("GDSBuilder", "gds")
TransformerBuilder = _builder("TransformerBuilder", "transformer")
StochasticTransformerBuilder = _builder("StochasticTransformerBuilder", "stochastic_transformer")
InferenceBuilder = _builder("InferenceBuilder", "transformer_inference")
QuantizerBuilder = _builder("QuantizerBuilder", "quantizer")
RandomLTDBuilder = _builder("RandomLTDBuilder", "random_ltd")
SpatialInferenceBuilder = _builder("SpatialInferenceBuilder", "spatial_inference")
EvoformerAttnBuilder = _builder("EvoformerAttnBuilder", "evoformer_attn")
FPQuantizerBuilder = _builder("FPQuantizerBuilder", "fp_quantizer")
InferenceCoreBuilder = _builder("InferenceCoreBuilder", "inference_core_ops")
RaggedOpsBuilder = _builder("RaggedOpsBuilder", "ragged_ops")
RaggedUtilsBuilder = _builder("RaggedUtilsBuilder", "ragged_device_ops")
PinMemoryBuilder = _builder("PinMemoryBuilder", "pin_memory")
CCLCommBuilder = _builder("CCLCommBuilder", "deepspeed_ccl_comm")
ShareMemCommBuilder = _builder("ShareMemCommBuilder", "deepspeed_shm_comm")
DeepCompileBuilder = _builder("DeepCompileBuilder", "dc")
NotImplementedBuilder = _builder("NotImplementedBuilder", "deepspeed_not_implemented")

#: name -> builder class, every op DeepSpeed 0.19.8 knows (DeepSpeed's ``all_ops.ALL_OPS`` holds instances).
ALL_OPS = {cls.NAME: cls() for cls in (
    CPUAdamBuilder, FusedAdamBuilder, CPUAdagradBuilder, CPULionBuilder, FusedLambBuilder, FusedLionBuilder,
    AsyncIOBuilder, GDSBuilder, TransformerBuilder, StochasticTransformerBuilder, InferenceBuilder, QuantizerBuilder,
    RandomLTDBuilder, SpatialInferenceBuilder, EvoformerAttnBuilder, FPQuantizerBuilder, InferenceCoreBuilder,
    RaggedOpsBuilder, RaggedUtilsBuilder, PinMemoryBuilder, CCLCommBuilder, ShareMemCommBuilder,
    DeepCompileBuilder, NotImplementedBuilder)}  # fmt: skip
__op_builders__ = list(ALL_OPS.values())

#: What ``deepspeed.ops.__compatible_ops__`` / ``git_version_info.compatible_ops`` report.
compatible_ops = {name: builder.is_compatible() for name, builder in ALL_OPS.items()}
#: Nothing is prebuilt.
installed_ops = dict.fromkeys(ALL_OPS, False)


def get_default_compute_capabilities() -> str:
    return ""
