"""The precision contract, as DeepSpeed builds it: low-precision compute, fp32 master weights and optimizer state.

Under data parallelism (stages 0 and 1) the parameters are cast in place to the compute dtype, as DeepSpeed
does, and the optimizer updates fp32 copies ("master weights") whose values are copied back after each step.
Under FSDP2 (stages 2 and 3) the sharded parameters *are* the master weights, kept in fp32 even when the model
was loaded in bf16 (user pain 1: an FSDP port whose optimizer stepped bf16 weights silently did not converge),
and ``MixedPrecisionPolicy`` casts them for compute. Buffers keep their dtype unless ``buffer_dtype`` is set
(user pain 5: a blanket downcast changed RoPE buffers).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from torsh.config import PrecisionConfig
from torsh.plan import EnginePlan

log = logging.getLogger("torsh.engine")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


MASTER = "_torsh_master"
"""The attribute of a low-precision parameter holding its fp32 master copy (stages 0/1)."""


@dataclass
class MasterWeights:
    """fp32 copies of low-precision parameters, by name; the optimizer steps these (stages 0 and 1)."""

    params: dict[str, torch.nn.Parameter]
    """Model parameter (low precision) by name."""
    masters: dict[str, torch.nn.Parameter]
    """Its master copy (``master_dtype``) by name."""
    accumulate_in_master: bool = False
    """Move each micro-batch's gradient into the master gradient (``grad_accum_dtype`` wider than compute)."""

    def grads_to_master(self, *, accumulate: bool) -> None:
        """Move model gradients into the master gradients (added when ``accumulate``), freeing the former."""
        for name, p in self.params.items():
            if p.grad is None:
                continue
            m = self.masters[name]
            g = p.grad.to(device=m.device, dtype=m.dtype)  # masters may be on the CPU (optimizer offload)
            m.grad = g if (m.grad is None or not accumulate) else m.grad.add_(g)
            p.grad = None

    @torch.no_grad()
    def params_to_master(self) -> None:
        """Copy the compute parameters' values into the master weights (after loading the model's weights)."""
        for name, p in self.params.items():
            self.masters[name].copy_(p)

    @torch.no_grad()
    def master_to_params(self) -> None:
        """Copy the updated master weights into the compute parameters."""
        torch._foreach_copy_(list(self.params.values()), [self.masters[name] for name in self.params])


@dataclass
class PrecisionPlan:
    """What the later steps need to know about precision."""

    param_dtype: torch.dtype
    """Compute dtype of parameters."""
    reduce_dtype: torch.dtype
    """Dtype of the gradient reduction."""
    autocast_dtype: torch.dtype | None = None
    """Run forward under ``torch.autocast`` with this dtype (parameters stay in the master dtype)."""
    cast_forward_inputs: bool = False
    """Cast floating inputs to ``param_dtype`` (DeepSpeed ``fp16.auto_cast``)."""
    masters: MasterWeights | None = None
    """Master weights (stages 0/1 with low-precision parameters)."""
    fsdp_policy: object | None = None
    """``MixedPrecisionPolicy`` for stages 2/3."""
    reduce_every_micro_step: bool = False
    """Gradients accumulate in a wider dtype than the compute dtype (``grad_accum_dtype``), so each
    micro-batch's gradient is reduced and added to the wide (master / fp32 shard) gradient, as DeepSpeed
    ZeRO does, instead of accumulating low-precision gradients locally until the boundary."""
    grad_accum_dtype: torch.dtype | None = None
    """The dtype gradients accumulate in over the micro-steps (``precision.grad_accum_dtype``, else the compute
    dtype; None: not a dtype the engine knows, the compute dtype then). ZeRO-1/2's partition gradients are kept
    in it."""


def apply_precision(model: torch.nn.Module, precision: PrecisionConfig, decided: EnginePlan) -> PrecisionPlan:
    """Cast ``model`` per the precision contract and the plan's dtypes (:func:`torsh.plan.plan`) and return what
    the later steps need; master copies go to the CPU under optimizer offload (stages 0/1)."""
    param_dtype = DTYPES[decided.param_dtype]
    master_dtype = DTYPES[decided.master_dtype]
    reduce_dtype = DTYPES[decided.reduce_dtype]  # under FSDP2, a fp16/bf16 "compression" is folded in
    if precision.buffer_dtype is not None:
        for b in model.buffers():
            if b.is_floating_point():
                b.data = b.data.to(DTYPES[precision.buffer_dtype])
    elif not precision.autocast and param_dtype != torch.float32:
        _cast_norm_statistics(model, param_dtype)
    if DTYPES[precision.optimizer_state_dtype] != master_dtype:
        log.warning("precision.optimizer_state_dtype=%s: torch optimizers keep their state in the master dtype "
                    "(%s); the state follows the master weights", precision.optimizer_state_dtype,
                    precision.master_dtype)  # fmt: skip
    plan = PrecisionPlan(param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                         cast_forward_inputs=precision.cast_forward_inputs,
                         grad_accum_dtype=DTYPES.get(precision.effective_grad_accum_dtype))  # fmt: skip

    if decided.autocast:
        _autocast(model, plan, decided, master_dtype)
        return plan
    plan.reduce_every_micro_step = DTYPES[precision.effective_grad_accum_dtype] != param_dtype
    if decided.fsdp:
        _fsdp(model, plan, decided, precision, master_dtype)
    elif decided.data_parallel in ("zero1", "zero2"):  # the partition keeps the fp32 masters (.zero_partition)
        _cast_params(model, param_dtype)
    else:
        _data_parallel(model, plan, decided, master_dtype)
    return plan


def _autocast(model: torch.nn.Module, plan: PrecisionPlan, decided: EnginePlan, master_dtype: torch.dtype) -> None:
    """torch_autocast: parameters stay in the master dtype; op-level autocast chooses compute dtypes."""
    _cast_params(model, master_dtype)
    plan.autocast_dtype, plan.param_dtype = plan.param_dtype, master_dtype
    if decided.fsdp_mixed_precision:  # FSDP2 reduces in the planned dtype; the fp32 shards are not cast
        from torch.distributed.fsdp import MixedPrecisionPolicy

        plan.fsdp_policy = MixedPrecisionPolicy(reduce_dtype=plan.reduce_dtype)


def _fsdp(model: torch.nn.Module, plan: PrecisionPlan, decided: EnginePlan, precision: PrecisionConfig,
          master_dtype: torch.dtype) -> None:  # fmt: skip
    """Stages 2/3 on FSDP2: the shards are the master weights (also for a bf16-loaded model); the policy casts
    them for compute."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    _cast_params(model, master_dtype)
    if decided.fsdp_mixed_precision:
        plan.fsdp_policy = MixedPrecisionPolicy(param_dtype=plan.param_dtype, reduce_dtype=plan.reduce_dtype,
                                                cast_forward_inputs=precision.cast_forward_inputs)  # fmt: skip
        plan.cast_forward_inputs = False  # the policy does it


def _data_parallel(model: torch.nn.Module, plan: PrecisionPlan, decided: EnginePlan, master_dtype: torch.dtype
                   ) -> None:  # fmt: skip
    """Stage 0 (also the pipeline engine's): compute parameters in the compute dtype; separate masters when their
    dtype or device differs."""
    param_dtype = plan.param_dtype
    master_device = torch.device("cpu") if decided.masters_on_cpu else None
    offloaded = master_device is not None and any(p.device != master_device for p in model.parameters())
    if master_dtype == param_dtype and not offloaded:
        _cast_params(model, param_dtype)
        return
    params = {n: p for n, p in model.named_parameters()}
    masters = {n: torch.nn.Parameter(p.detach().to(device=master_device or p.device, dtype=master_dtype).clone(),
                                     requires_grad=p.requires_grad) for n, p in params.items()}  # fmt: skip
    _cast_params(model, param_dtype)
    plan.masters = MasterWeights(params, masters, accumulate_in_master=plan.reduce_every_micro_step)
    for name, p in params.items():
        setattr(p, MASTER, masters[name])  # what DeepSpeed's safe_get_full_fp32_param reads (its hp param)


def _cast_norm_statistics(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Running statistics of BatchNorm-style layers in the compute dtype: their kernels take one dtype for
    input, weight and statistics (fp16 weights with fp32 running_mean fail with "expected scalar type Half but
    found Float"). DeepSpeed's ``module.half()`` cast them (with every buffer); DeepSpeed 0.19.8 casts buffers
    only with ``data_types.buffer_dtype`` and otherwise fails the same way. Other buffers keep their dtype."""
    cast = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.modules.batchnorm._NormBase):
            for b in module.buffers(recurse=False):
                if b.is_floating_point() and b.dtype != dtype:
                    b.data = b.data.to(dtype)
                    cast.append(name)
    if cast:
        log.info("precision: running statistics of %d normalization layer(s) (%s%s) are kept in %s, the compute "
                 "dtype", len(set(cast)), ", ".join(sorted(set(cast))[:3]), ", ..." if len(set(cast)) > 3 else "",
                 dtype)  # fmt: skip


def _cast_params(model: torch.nn.Module, dtype: torch.dtype) -> None:
    # In place on .data so that the Parameter objects (and the user's references to them) survive.
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)


# ---- DeepSpeedEngine's helpers for the module cast ---------------------------------------------------------
# DeepSpeed's engine has them as methods reading only ``_config.param_dtype`` / ``_config.buffer_dtype``, the
# fp16/bf16 flags and ``module``; scripts and DeepSpeed's own tests call them on the class with stand-in objects,
# so they are written against those members alone (the torsh engine casts through :func:`apply_precision`).

#: DeepSpeed's spellings of a dtype in ``data_types`` (its ``DtypeEnum``).
DTYPE_NAMES = {
    torch.float16: ("torch.float16", "fp16", "float16", "half"),
    torch.float32: ("torch.float32", "fp32", "float32", "float"),
    torch.int8: ("torch.int8", "int8"),
    torch.bfloat16: ("torch.bfloat16", "bf16", "bfloat16"),
}
_CASTABLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def dtype_named(value) -> torch.dtype:
    """The torch dtype of a ``data_types`` value (a torch dtype or one of DeepSpeed's names for it)."""
    if isinstance(value, torch.dtype) and value in DTYPE_NAMES:
        return value
    for dtype, names in DTYPE_NAMES.items():
        if value in names:
            return dtype
    known = sorted(n for names in DTYPE_NAMES.values() for n in names)
    raise ValueError(f"{value!r} is not a dtype DeepSpeed's data_types accepts; use one of {known}")


def _model_dtype(engine) -> torch.dtype | None:
    if engine.fp16_enabled():
        return torch.float16
    return torch.bfloat16 if engine.bfloat16_enabled() else None


def mixed_precision_dtypes(engine) -> tuple[torch.dtype | None, torch.dtype | None]:
    """DeepSpeed's ``_mixed_precision_dtypes``: (the parameters' dtype: fp16/bf16 when enabled, else None;
    ``data_types.buffer_dtype``, else None: buffers keep their dtype)."""
    buffer_dtype = engine._config.buffer_dtype
    return _model_dtype(engine), None if buffer_dtype is None else dtype_named(buffer_dtype)


def assert_valid_mixed_precision_config(engine) -> None:
    """DeepSpeed's ``_assert_valid_mixed_precision_config``: ``data_types.param_dtype``, when set, must be the
    dtype the fp16/bf16 flags give (fp32 without them); an AssertionError otherwise, as DeepSpeed's."""
    requested = engine._config.param_dtype
    if requested is None:
        return
    model_dtype = _model_dtype(engine) or torch.float32
    assert dtype_named(requested) == model_dtype, (
        f"data_types.param_dtype is '{requested}' but the fp16/bf16 settings make the model {model_dtype}: "
        "enable the matching fp16/bf16 section, or leave data_types.param_dtype unset")


def cast_module_mixed_precision(engine, param_dtype, buffer_dtype, is_zero_init_model, keep_pattern=None) -> None:
    """DeepSpeed's ``_cast_module_mixed_precision``: ``engine.module``'s floating parameters to ``param_dtype``
    (not when ``zero.Init`` built them: they already are), its floating buffers to ``buffer_dtype`` only when it
    is given; buffers whose full names match ``keep_pattern`` (a compiled regex) are kept in (made) fp32."""
    module = engine.module
    wanted: list[tuple[torch.Tensor, torch.dtype]] = []  # (tensor, the dtype it ends in)
    if param_dtype is not None and not is_zero_init_model:
        wanted += [(p, param_dtype) for p in module.parameters() if p.dtype in _CASTABLE]
    for name, b in module.named_buffers():
        if keep_pattern is not None and b.is_floating_point() and keep_pattern.search(name):
            wanted.append((b, torch.float32))
        elif buffer_dtype is not None and b.dtype in _CASTABLE:
            wanted.append((b, buffer_dtype))
    for tensor, dtype in wanted:
        if tensor.dtype != dtype:
            tensor.data = tensor.data.to(dtype)
