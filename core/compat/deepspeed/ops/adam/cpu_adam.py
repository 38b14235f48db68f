"""``deepspeed.ops.adam.cpu_adam``: ``DeepSpeedCPUAdam``, DeepSpeed's CPU Adam(W), on torch.

DeepSpeed runs a compiled kernel that reads each parameter and gradient in its own precision, does the whole update
in fp32 and writes the moments in fp32 (``fp32_optimizer_states=True``, the default) or in the parameter's dtype.
Here:

* parameters in fp32 (or fp64) step through ``torch.optim.Adam``'s own step: the same update;
* when a stepped parameter is fp16/bf16, :func:`adam_update` does DeepSpeed's update with torch operations in fp32,
  keeping the moments in the dtype DeepSpeed keeps them in;
* ZeRO-3 offload's per-sub-group calls exist: ``step_subgroup(i)`` steps the parameter with a gradient under the
  state ``optimizer.state[i]`` (one state per sub-group, not per parameter), and ``rollback_subgroup(i)`` undoes
  that sub-group's last step exactly as far as floating point allows (the same gradient must still be there).

The state keeps torch's layout (``step`` a float tensor, ``exp_avg``, ``exp_avg_sq``), so torch's and torsh's
checkpoint code read it as any Adam state. As with ``FusedAdam``, ``bias_correction=False`` is refused.
"""

from __future__ import annotations

import math

import torch

from ..._unsupported import NotSupportedByTorsh, message

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def adam_update(param, grad, exp_avg, exp_avg_sq, step: int, *, lr: float, beta1: float, beta2: float, eps: float,
                weight_decay: float, decoupled: bool) -> None:  # fmt: skip
    """One Adam (``decoupled=False``: L2 weight decay added to the gradient) or AdamW (decoupled decay) update of
    ``param`` and its moments in place, computed in fp32; ``step`` counts this update (1 for the first)."""
    p, g, m, v = (t.detach().float() for t in (param, grad, exp_avg, exp_avg_sq))
    if weight_decay and not decoupled:
        g = g.add(p, alpha=weight_decay)
    m.mul_(beta1).add_(g, alpha=1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bc1, bc2 = 1 - beta1**step, 1 - beta2**step
    if weight_decay and decoupled:
        p.mul_(1 - lr * weight_decay)
    p.addcdiv_(m, v.sqrt().div_(math.sqrt(bc2)).add_(eps), value=-lr / bc1)
    _write_back((param, p), (exp_avg, m), (exp_avg_sq, v))


def adam_rollback(param, grad, exp_avg, exp_avg_sq, step: int, *, lr: float, beta1: float, beta2: float, eps: float,
                  weight_decay: float, decoupled: bool) -> None:  # fmt: skip
    """Undo :func:`adam_update` number ``step`` with the same ``grad`` (in place, computed in fp32)."""
    p, g, m, v = (t.detach().float() for t in (param, grad, exp_avg, exp_avg_sq))
    bc1, bc2 = 1 - beta1**step, 1 - beta2**step
    p.addcdiv_(m, v.sqrt().div_(math.sqrt(bc2)).add_(eps), value=lr / bc1)
    if weight_decay and decoupled:
        p.div_(1 - lr * weight_decay)
    if weight_decay and not decoupled:
        g = g.add(p, alpha=weight_decay)
    m.sub_(g, alpha=1 - beta1).div_(beta1)
    v.addcmul_(g, g, value=-(1 - beta2)).div_(beta2).clamp_(min=0)  # a sum of squares: rounding must not go below 0
    _write_back((param, p), (exp_avg, m), (exp_avg_sq, v))


def check_bias_correction(name: str, bias_correction: bool) -> None:
    """Refuse ``bias_correction=False``: the classes step through torch's Adam, which always corrects."""
    if not bias_correction:
        raise NotSupportedByTorsh(message(f"ops.adam.{name}(bias_correction=False)", "torch.optim.Adam always "
                                          "corrects the moments' bias; remove bias_correction=False"))  # fmt: skip


def _write_back(*pairs) -> None:
    for target, value in pairs:
        if target.dtype != value.dtype:  # fp32 tensors were updated in place already
            target.detach().copy_(value)


class DeepSpeedCPUAdam(torch.optim.Adam):
    """DeepSpeed's ``DeepSpeedCPUAdam(model_params, lr, bias_correction, betas, eps, weight_decay, amsgrad,
    adamw_mode, fp32_optimizer_states)`` (see the module)."""

    def __init__(self, model_params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                 amsgrad=False, adamw_mode=True, fp32_optimizer_states=True):  # fmt: skip
        if amsgrad:
            raise RuntimeError("DeepSpeedCPUAdam does not support the AMSGrad variant.")  # DeepSpeed's own refusal
        check_bias_correction("DeepSpeedCPUAdam", bias_correction)
        super().__init__(model_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         decoupled_weight_decay=bool(adamw_mode))  # fmt: skip
        # in defaults and every group, so that a rebuilt optimizer (over sharded parameters) and views keep them
        extra = {"adamw_mode": bool(adamw_mode), "bias_correction": True,
                 "fp32_optimizer_states": bool(fp32_optimizer_states)}  # fmt: skip
        self.defaults.update(extra)
        for group in self.param_groups:
            for key, value in extra.items():
                group.setdefault(key, value)

    @torch.no_grad()
    def step(self, closure=None):
        """Update every parameter that has a gradient (see the module for which update runs)."""
        if not any(p.dtype in _LOW_PRECISION for g in self.param_groups for p in g["params"] if p.grad is not None):
            return _torch_adam_step(self, closure)
        loss = _closure_loss(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(group, p, self.state[p], rollback=False)
        return loss

    @torch.no_grad()
    def step_subgroup(self, subgroup_id: int, closure=None):
        """Step the one parameter with a gradient (ZeRO-3 offload's flat sub-group) under ``state[subgroup_id]``."""
        loss = _closure_loss(closure)
        for group, p in self._subgroup_members("step_subgroup", subgroup_id):
            self._update(group, p, self.state[subgroup_id], rollback=False)
        return loss

    @torch.no_grad()
    def rollback_subgroup(self, sub_group_id: int, closure=None):
        """Undo the last :meth:`step_subgroup` of ``sub_group_id`` (its gradient must still be the one stepped)."""
        state = self.state.get(sub_group_id)
        if not state:
            raise RuntimeError(f"Cannot rollback optimizer state for sub_group_id {sub_group_id} as it has not been "
                               "initialized (step_subgroup never ran for it).")  # fmt: skip
        if int(state.get("step", 0)) <= 0:
            raise RuntimeError(f"Cannot rollback sub_group_id {sub_group_id}: step count is {int(state['step'])}")
        loss = _closure_loss(closure)
        for group, p in self._subgroup_members("rollback_subgroup", sub_group_id):
            self._update(group, p, state, rollback=True)
        return loss

    # ---- helpers ---------------------------------------------------------------------------------------------------
    def _subgroup_members(self, method: str, subgroup_id: int) -> list:
        members = [(g, p) for g in self.param_groups for p in g["params"] if p.grad is not None]
        if len(members) > 1:
            raise ValueError(f"DeepSpeedCPUAdam.{method}({subgroup_id}): {len(members)} parameters have a gradient, "
                             "but a sub-group's state belongs to one (flat) parameter; leave exactly that one in "
                             "param_groups (or set the others' .grad to None)")  # fmt: skip
        return members

    def _update(self, group: dict, p: torch.Tensor, state: dict, *, rollback: bool) -> None:
        if group.get("amsgrad") or group.get("maximize"):
            option = "amsgrad" if group.get("amsgrad") else "maximize"
            what = f"ops.adam.DeepSpeedCPUAdam with {option}=True on {p.dtype} parameters"
            raise NotSupportedByTorsh(message(what, f"DeepSpeed's CPU Adam has no {option}; use torch.optim.AdamW"))
        dtype = torch.float32 if group.get("fp32_optimizer_states", True) else p.dtype
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        for key in ("exp_avg", "exp_avg_sq"):  # a state loaded or built in another dtype
            if state[key].dtype != dtype:
                state[key] = state[key].to(dtype)
        if not torch.is_tensor(state["step"]):
            state["step"] = torch.tensor(float(state["step"]))
        if not rollback:
            state["step"] += 1
        beta1, beta2 = group["betas"]
        (adam_rollback if rollback else adam_update)(
            p, p.grad, state["exp_avg"], state["exp_avg_sq"], int(state["step"]), lr=float(group["lr"]), beta1=beta1,
            beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
            decoupled=group.get("decoupled_weight_decay", True))
        if rollback:
            state["step"] -= 1


def _closure_loss(closure):
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def _torch_adam_step(optimizer: torch.optim.Adam, closure):
    """``torch.optim.Adam.step`` without the hook wrapper torch puts on each optimizer class: this class's own
    ``step`` is wrapped already, and step hooks must run once."""
    step = torch.optim.Adam.step
    if getattr(step, "hooked", False):
        step = step.__wrapped__
    return step(optimizer, closure)
