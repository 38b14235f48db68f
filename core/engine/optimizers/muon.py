"""Muon with an auxiliary Adam, as DeepSpeed 0.19.8 builds it for ``optimizer.type: "Muon"`` (its
``MuonWithAuxAdam``); the Muon step is K. Jordan's (https://kellerjordan.github.io/posts/muon/).

**The split** (:func:`split_groups`): a parameter is Muon's when its shape has at least 2 dimensions and its name
contains neither ``embed`` nor ``lm_head`` (case-insensitive); every other trainable parameter is Adam's. Each of
the script's parameter groups becomes a Muon half and an Adam half (an empty half is left out), named
``muon-params`` / ``adam-params`` (``group<i>-...`` or ``<name>-...`` with several groups), each with the config's
keys it reads, then ``muon_lr`` / ``adam_lr``, then the group's own values. Muon reads ``lr`` (default 0.02),
``momentum`` (0.95), ``weight_decay`` (0), ``ns_method`` (``"gram"`` or ``"standard"``); Adam ``lr`` (3e-4),
``betas`` ((0.9, 0.95)), ``eps`` (1e-10), ``weight_decay`` (0).

**Muon's step** of a matrix ``W`` with gradient ``G`` and momentum ``M`` (state ``momentum_buffer``)::

    M = lerp(M, G, 1 - momentum)              (kept unchanged when G has a non-finite value; G is then the update)
    U = lerp(G, M, momentum)                  (Nesterov, always)
    O = NS5(U) * sqrt(max(1, rows / cols))    (rows, cols: G's last two dimensions; a 4-D U is seen as 2-D)
    W = W * (1 - lr * weight_decay) - lr * O

``NS5`` is five quintic Newton-Schulz iterations with coefficients (3.4445, -4.7750, 2.0315) on ``U / (|U|_F +
1e-7)`` (transposed when it has more rows than columns): ``"standard"`` iterates on ``X`` in bfloat16 where the
device has it; ``"gram"`` (the default, T. Dao's Gram form) iterates on ``X X^T`` with a restart at iteration 2
in float16 where the device has it (CUDA; a CPU with MKL-DNN fp16), both float32 elsewhere.

**Adam's step**: Adam with bias correction (``exp_avg``, ``exp_avg_sq``, an integer ``step``), decoupled weight
decay unless the config's ``adam_w_mode`` is false (then L2: ``weight_decay * p`` added to the gradient).

torch 2.13's ``torch.optim.Muon`` has the same momentum, Nesterov blend, coefficients and ``sqrt(max(1, A/B))``
scale, but it normalises by ``max(|U|, eps)``, always iterates in bfloat16 (DeepSpeed's default is the Gram form,
float32 on a CPU without fp16), defaults ``weight_decay`` to 0.1 and ``lr`` to 1e-3 and takes 2-D parameters only:
not the same run, so it is not used.

**Whole matrices**: on ZeRO-1/2's flat partitions the gradients and momenta of a Muon group are all-gathered,
each matrix that has elements on this rank is orthogonalised whole and this rank's elements kept (DeepSpeed
orthogonalises the whole gradient before it partitions it); on FSDP2's shards each matrix's gradient and momentum
are gathered whole (``full_tensor``). The Adam half is elementwise.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch

from .pieces import flat_layout, local

log = logging.getLogger("torsh.engine")

NS_METHODS = ("gram", "standard")
_A, _B, _C = 3.4445, -4.7750, 2.0315
_RESTART = 2

#: Which keys each half reads from the config (and from a group), DeepSpeed's.
MUON_KEYS = ("lr", "momentum", "weight_decay", "ns_method")
ADAM_KEYS = ("lr", "betas", "eps", "weight_decay")
MUON_DEFAULTS = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.0, "ns_method": "gram"}
ADAM_DEFAULTS = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0.0}


# ---- the split ---------------------------------------------------------------------------------------------


def is_muon_param(name: str, shape: tuple[int, ...] | torch.Size) -> bool:
    """Muon's parameters: matrices (2 or more dimensions) not named like an embedding or the output head."""
    return len(shape) >= 2 and not any(k in name.lower() for k in ("embed", "lm_head"))


def split_groups(groups: list[dict], settings: dict, *, shape_of: Callable[[str], tuple[int, ...]],
                 trainable: Callable[[str], bool]) -> list[dict]:  # fmt: skip
    """``groups`` (parameter *names* per group, the script's ``model_parameters``) as Muon and Adam halves.

    ``settings``: the config's optimizer values (``lr``, ``muon_lr``, ``adam_lr``, ...). Already split groups
    (carrying ``use_muon``) are returned as they are."""
    if any("use_muon" in g for g in groups):
        return groups
    halves = ((True, "muon", MUON_KEYS, _half_settings(settings, MUON_KEYS, "muon_lr")),
              (False, "adam", ADAM_KEYS, _half_settings(settings, ADAM_KEYS, "adam_lr")))  # fmt: skip
    out = []
    for index, group in enumerate(groups):
        overrides = {k: v for k, v in group.items() if k != "params"}
        names = [n for n in group["params"] if trainable(n)]
        for use_muon, label, keys, defaults in halves:
            half = [n for n in names if is_muon_param(n, shape_of(n)) is use_muon]
            if not half:
                continue
            prefix = overrides.get("name") or (f"group{index}" if len(groups) > 1 else None)
            values = {**defaults, **{k: v for k, v in overrides.items() if k in keys}}
            out.append({"params": half, "use_muon": use_muon,
                        "name": f"{prefix}-{label}-params" if prefix else f"{label}-params", **values})
    return out


def _half_settings(settings: dict, keys: tuple[str, ...], lr_key: str) -> dict:
    values = {k: settings[k] for k in keys if k in settings}
    if lr_key in settings:
        values["lr"] = settings[lr_key]
    return values


# ---- Newton-Schulz --------------------------------------------------------------------------------------------


def ns_dtype(method: str, device: torch.device) -> torch.dtype:
    """The dtype Newton-Schulz iterates in (DeepSpeed's choice per method and device)."""
    if method == "gram":
        if device.type == "cuda" or (device.type == "cpu" and _cpu_fp16()):
            return torch.float16
        return torch.float32
    if device.type == "cpu" or (device.type == "cuda" and torch.cuda.is_bf16_supported()):
        return torch.bfloat16
    return torch.float32


def _cpu_fp16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except Exception:  # an unusual build without the query: no fp16 on this CPU
        return False


def _normalised(g: torch.Tensor, dtype: torch.dtype, norm_dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
    x = g.to(norm_dtype)
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    return (x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)).to(dtype), tall


def _quintic(x: torch.Tensor, steps: int) -> torch.Tensor:
    for _ in range(steps):
        gram = x @ x.mT
        x = _A * x + (_B * gram + _C * gram @ gram) @ x
    return x


def orthogonalise(g: torch.Tensor, steps: int = 5, method: str = "gram") -> torch.Tensor:
    """NS5 of ``g`` (a matrix, or a batch of them in the leading dimensions), in :func:`ns_dtype`."""
    dtype = ns_dtype(method, g.device)
    if method == "standard":
        x, tall = _normalised(g, dtype, dtype)
        x = _quintic(x, steps)
        return x.mT if tall else x
    x, tall = _normalised(g, dtype, torch.float32 if g.dtype == torch.float16 else g.dtype)
    if x.size(-1) <= x.size(-2):  # square (after the transpose): the Gram form saves nothing
        x = _quintic(x, steps)
        return x.mT if tall else x
    r = x @ x.mT  # iterate on the small Gram matrix R = X X^T and collect the polynomial Q; X = Q X at the end
    q = None
    eye = torch.eye(r.size(-1), dtype=r.dtype, device=r.device)
    for i in range(steps):
        if i == _RESTART:  # fold Q into X and start again from a fresh R (keeps half precision stable)
            x = q @ x
            r = x @ x.mT
            q = None
        z = _B * r + _C * r @ r
        q = z + _A * eye if q is None else _A * q + z @ q
        if i < steps - 1 and i + 1 != _RESTART:
            rz = _A * r + z @ r
            r = _A * rz + z @ rz
    x = q @ x
    return x.mT if tall else x


def muon_update(grad: torch.Tensor, momentum: torch.Tensor, beta: float = 0.95, ns_steps: int = 5,
                method: str = "gram", batched: bool = False) -> torch.Tensor:  # fmt: skip
    """Muon's update of one matrix (``momentum`` updated in place; ``grad`` left as it is). ``batched``: the
    leading dimension is a batch of matrices (DeepSpeed's expert groups), scaled by the update's own shape."""
    finite = torch.isfinite(grad).all()
    momentum.copy_(torch.where(finite, momentum.lerp(grad, 1 - beta), momentum))
    update = grad.lerp(momentum, beta)
    if batched:
        out = orthogonalise(update, ns_steps, method) * _aspect(update.size(-2), update.size(-1))
    else:
        flat = update.view(len(update), -1) if update.ndim == 4 else update
        out = orthogonalise(flat, ns_steps, method) * _aspect(grad.size(-2), grad.size(-1))
    return torch.where(finite, out.to(grad.dtype), grad)


def _aspect(rows: int, cols: int) -> float:
    return math.sqrt(rows / cols) if rows > cols else 1.0


# ---- the optimizer ---------------------------------------------------------------------------------------------


class MuonWithAuxAdam(torch.optim.Optimizer):
    """Muon over the groups with ``use_muon: True``, Adam over the others (see the module docstring).

    ``param_groups`` must each carry ``use_muon`` (:func:`split_groups` makes them); missing keys get DeepSpeed's
    defaults. ``adam_w_mode``: decoupled weight decay in the Adam half (False: L2)."""

    def __init__(self, param_groups, adam_w_mode: bool = True):
        groups = [dict(g) for g in param_groups]
        for g in groups:
            if "use_muon" not in g:
                raise ValueError("MuonWithAuxAdam: every parameter group needs 'use_muon' (True: Muon, False: Adam)")
            for k, v in (MUON_DEFAULTS if g["use_muon"] else ADAM_DEFAULTS).items():
                g.setdefault(k, v)
            if g["use_muon"] and g["ns_method"] not in NS_METHODS:
                raise ValueError(f"ns_method must be one of {set(NS_METHODS)}, got {g['ns_method']!r}")
            if g["use_muon"]:
                # DeepSpeed orders a Muon group's parameters largest first
                g["params"] = sorted(g["params"], key=lambda p: tuple(p.size()), reverse=True)
        super().__init__(groups, {"adam_w_mode": bool(adam_w_mode)})  # in defaults: a rebuild keeps it
        for g in self.param_groups:
            g.pop("adam_w_mode", None)  # DeepSpeed's groups do not carry it
        self.adam_w_mode = bool(adam_w_mode)
        self._orthogonalised: set[int] = set()  # Muon parameters whose .grad holds their update this step
        self._warned = False

    @torch.no_grad()
    def orthogonalise_grads(self, loss_scale: float = 1.0) -> None:
        """Replace each Muon parameter's gradient by its Muon update (the momentum advanced), for :meth:`step` to
        apply as it is. DeepSpeed's ZeRO-1/2/3 do this before they compute the gradient norm and clip, so that
        ``gradient_clipping`` (DeepSpeed's default 1.0) scales the orthogonalised updates, and the Adam half's
        gradients by a norm that includes them; its stage 0 clips the raw gradients. An engine stepping ZeRO
        partitions or shards calls this after the gradients are reduced, before the norm; ``loss_scale``: the
        gradients' (the update is computed on the unscaled gradient and scaled back, so that the engine's unscale
        leaves it as it is, as DeepSpeed rescales it)."""
        for group in self.param_groups:
            if not group["use_muon"]:
                continue
            for p in group["params"]:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                state = self.state[p]
                if not state:
                    state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if loss_scale != 1.0:
                    p.grad.div_(loss_scale)
                update = self._update(p, state["momentum_buffer"], group)
                local(p.grad).copy_(update * loss_scale if loss_scale != 1.0 else update)
                self._orthogonalised.add(id(p))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_group(group)
            else:
                self._adam_group(group)
        self._orthogonalised.clear()
        return loss

    def _muon_group(self, group: dict) -> None:
        for p in group["params"]:
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # every rank takes part in the collectives below
            state = self.state[p]
            if not state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if id(p) in self._orthogonalised:
                update = local(p.grad)
            else:
                self._note_order(p)
                update = self._update(p, state["momentum_buffer"], group)
            param = local(p)
            param.mul_(1 - group["lr"] * group["weight_decay"])
            param.add_(update.to(param.dtype), alpha=-group["lr"])

    def _note_order(self, p: torch.Tensor) -> None:
        if not self._warned and (hasattr(p, "full_tensor") or flat_layout(self, p) is not None):
            self._warned = True
            log.warning("Muon on ZeRO partitions or shards: this engine clipped the raw gradients before Muon (as "
                        "DeepSpeed's stage 0 does); DeepSpeed's ZeRO stages clip the orthogonalised updates "
                        "instead, which differs when gradient_clipping is set (DeepSpeed's default 1.0)")

    def _update(self, p: torch.Tensor, momentum: torch.Tensor, group: dict) -> torch.Tensor:
        """The Muon update of ``p``'s local elements (its momentum's updated in place)."""
        beta, method = group["momentum"], group["ns_method"]
        layout = flat_layout(self, p)
        if layout is not None:  # ZeRO-1/2: this rank's elements of the whole matrices in the flat master
            update = torch.zeros_like(p.grad)
            grads, moms = layout.wholes(p.grad), layout.wholes(momentum)
            for q, g, m in zip(layout.params, grads, moms):
                if layout.holds(q):
                    m = m.clone()
                    whole = muon_update(g, m, beta, method=method, batched=_expert(q))
                    layout.write_local(q, update, whole)
                    layout.write_local(q, momentum, m)
            return update
        if hasattr(p, "full_tensor"):  # FSDP2 shard: the whole matrix, then this rank's shard of the result
            from torch.distributed.tensor import distribute_tensor

            m = momentum.full_tensor()
            whole = muon_update(p.grad.full_tensor(), m, beta, method=method, batched=_expert(p))
            local(momentum).copy_(distribute_tensor(m, p.device_mesh, p.placements, src_data_rank=None).to_local())
            return distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None).to_local()
        return muon_update(p.grad, momentum, beta, method=method, batched=_expert(p))

    def _adam_group(self, group: dict) -> None:
        beta1, beta2 = group["betas"]
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        for p in group["params"]:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            state = self.state[p]
            if not state:
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] = 0
            state["step"] += 1
            t = state["step"]
            param, grad = local(p), local(p.grad).to(local(p).dtype)
            exp_avg, exp_avg_sq = local(state["exp_avg"]), local(state["exp_avg_sq"])
            if not self.adam_w_mode and wd:
                grad = grad.add(param, alpha=wd)
            exp_avg.lerp_(grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2**t)).add_(eps)
            if self.adam_w_mode and wd:
                param.mul_(1 - lr * wd)
            param.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1**t))


def _expert(p: torch.Tensor) -> bool:
    return bool(getattr(p, "is_expert_group", False))
