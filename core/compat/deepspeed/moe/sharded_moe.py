"""``deepspeed.moe.sharded_moe``: DeepSpeed's token gating and its mixture-of-experts layer, on native PyTorch.

The gates decide, for S tokens and E experts, which expert(s) each token goes to and in which of an expert's C
capacity slots it lands (GShard's dispatch; https://arxiv.org/abs/2006.16668):

- :func:`top1gating`, :func:`top2gating`, :func:`topkgating` return ``(l_aux, combine_weights [S, E, C],
  dispatch_mask [S, E, C], exp_counts [E])``, or with ``sparse_routes=True`` the routes as one row per choice
  ``(l_aux, C, E, indices [k, S], locations [k, S], gates [k, S], exp_counts)`` (an index of -1: a route the
  capacity dropped). ``l_aux`` is the load-balancing loss the layer returns.
- The capacity: ``ceil(S / E * capacity_factor)`` (x k for top-2/top-k), at least ``min_capacity``; with
  ``drop_tokens=False`` the largest expert load instead, agreed over the expert-parallel group (an all-reduce
  MAX), so no token is dropped.
- Random streams are DeepSpeed's: random token selection (``use_rts``) draws one uniform per (token, expert) of
  the default generator, ``noisy_gate_policy='RSample'`` and top-2's second-expert sampling one Gumbel sample per
  logit, ``'Jitter'`` one uniform in [0.99, 1.01] per input element; each is drawn at the same point of the
  computation as DeepSpeed draws it, so a seeded run gates exactly as DeepSpeed's.

:class:`MOELayer` sends each expert its tokens (one ``all_to_all_single`` over the expert-parallel group when the
experts are spread over ``ep_size`` ranks), runs the local experts and sends the results back.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn import Module

from .. import comm as dist
from ..utils import groups
from .mappings import drop_tokens, gather_tokens, tensor_parallel_world_size

log = logging.getLogger("torsh.engine")

TOPK_GATE_TIMER = "topk_gate"
MOE_TIMER = "moe"
FIRST_ALLTOALL_TIMER = "1st_a2a"
SECOND_ALLTOALL_TIMER = "2nd_a2a"

USE_EINSUM = True  # DeepSpeed's switch; torch.einsum is used either way
TUTEL_INSTALLED = False  # Tutel's fused kernels are not used: the layer runs torch's dispatch

_NOISE: dict = {}


def _noise(kind: str, shape: tuple, device: torch.device, epsilon: float = 0.0) -> Tensor:
    """A draw of ``shape`` from the default generator: ``'gumbel'`` (standard Gumbel), ``'pick'`` (uniform in
    [0, 1), random token selection) or ``'jitter'`` (uniform in [1 - epsilon, 1 + epsilon]). The distribution
    objects are kept per device, as their parameters live there."""
    key = (kind, device, epsilon)
    draw = _NOISE.get(key)
    if draw is None:
        def on(value: float) -> Tensor:
            return torch.tensor(value, device=device)

        if kind == "gumbel":
            dist_ = torch.distributions.gumbel.Gumbel(on(0.0), on(1.0))
        elif kind == "pick":
            dist_ = torch.distributions.uniform.Uniform(on(0.0), on(1.0))
        else:
            dist_ = torch.distributions.uniform.Uniform(on(1.0 - epsilon), on(1.0 + epsilon))
        draw = _NOISE[key] = dist_.rsample
    return draw(shape)


def multiplicative_jitter(x: Tensor, device: torch.device, epsilon: float = 1e-2) -> Tensor:
    """``x`` scaled element-wise by noise in ``[1 - epsilon, 1 + epsilon]`` (the 'Jitter' gate policy)."""
    return x if epsilon == 0 else x * _noise("jitter", x.shape, device, epsilon)


def gumbel_rsample(shape: tuple, device: torch.device) -> Tensor:
    """Standard Gumbel noise of ``shape`` (the 'RSample' policy and top-2's sampled second expert)."""
    return _noise("gumbel", shape, device)


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` over ``group``: block i of the input goes to the group's rank i. The gradient
    travels back by the same exchange."""

    @staticmethod
    def forward(ctx: Any, group: Any, input: Tensor) -> Tensor:  # type: ignore[override]
        ctx.group = group
        received = torch.empty_like(input.contiguous())
        dist.all_to_all_single(received, input.contiguous(), group=group)
        return received

    @staticmethod
    def backward(ctx: Any, *grad_output: Tensor) -> tuple[None, Tensor]:
        return None, _AllToAll.apply(ctx.group, *grad_output)


def einsum(rule: str, a: Tensor, b: Tensor) -> Tensor:
    """Kept for scripts that import it: plain ``torch.einsum``."""
    return torch.einsum(rule, a, b)


def _spans_ranks(group: Any) -> bool:
    """True when ``group`` has more than one member (None: no expert parallelism at all)."""
    return False if group is None else dist.get_world_size(group) > 1


def _slots_per_expert(logits: Tensor, factor: float, min_capacity: int) -> Tensor:
    """The dropping capacity, an int64 tensor: ``tokens / experts * factor`` rounded up, floored at
    ``min_capacity``."""
    share = logits.shape[0] / logits.shape[1]
    wanted = torch.ceil(share * torch.tensor(factor)).to(torch.int64)
    return torch.maximum(wanted, torch.tensor(min_capacity).to(torch.int64))


def _busiest_expert(counts: Tensor, ep_group: Any) -> Tensor:
    """The capacity without dropping: the heaviest expert load, agreed (MAX) over the expert-parallel group so
    all ranks exchange buffers of one size; without expert tensor parallelism rounded up to a multiple of the
    tensor-parallel degree, which the layer later divides the slots by."""
    peak = counts.max()
    if _spans_ranks(ep_group):
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=ep_group)
    if groups._get_expert_model_parallel_world_size() > 1:
        return peak
    degree = tensor_parallel_world_size()
    return torch.ceil(peak / degree).mul(degree).to(peak.dtype)


def _balance_loss(gates: Tensor, routed: Tensor, squared: bool, k: int = 1) -> Tensor:
    """GShard's auxiliary loss from the mean router probability and the routed share of every expert."""
    experts = gates.shape[1]
    per_expert = gates.mean(dim=0) * routed.float().mean(dim=0)
    if not squared:
        return per_expert.sum() * experts
    loss = per_expert.mean() * experts * experts
    return loss if k == 1 else loss / k


def _queue_positions(tiers: list) -> list:
    """Where each route stands in its expert's queue: tier by tier (a later tier waits behind every route of
    the earlier ones), token order inside a tier. One ``[S, E]`` position tensor per tier."""
    positions, before = [], 0
    for tier in tiers:
        positions.append(torch.cumsum(tier, dim=0) - 1 + before)
        before = before + tier.sum(dim=0, keepdim=True)
    return positions


def _keep_best(mask: Tensor, scores: Tensor, capacity: Tensor) -> Tensor:
    """``mask`` with, per expert, only the routes among the ``capacity`` highest ``scores`` (never more than
    there are tokens)."""
    limit = int(min(capacity, torch.tensor(scores.shape[0]).to(capacity.device)))
    best = torch.topk(scores, k=limit, dim=0, sorted=False)[1]
    return mask * torch.zeros_like(mask).scatter_(0, best, 1)


def _route(gates: Tensor, chosen: Tensor, tiers: list, capacity: Tensor, policy: str, scores: Tensor = None,
           normalize: bool = True, l_aux: Tensor = None, counts: Tensor = None, sparse: bool = False) -> tuple:
    """The shared tail of every gate. ``chosen`` ``[S, k]``: each token's experts by rank; ``tiers``: their
    ``[S, E]`` masks grouped in queue order. ``policy``: ``'queue'`` drops routes placed beyond ``capacity``
    (None: drop none), ``'best'`` keeps the best ``scores`` per expert and queues the survivors."""
    if policy == "best":
        tiers = [_keep_best(tier, scores, capacity) for tier in tiers]
        positions = _queue_positions(tiers)
    else:
        positions = _queue_positions(tiers)
        if capacity is not None and policy == "queue":
            tiers = [tier * torch.lt(pos, capacity) for tier, pos in zip(tiers, positions)]
    kept = sum(tiers[1:], tiers[0])
    place = sum((pos * tier for pos, tier in zip(positions[1:], tiers[1:])), positions[0] * tiers[0])
    weights = gates * kept
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=torch.finfo(weights.dtype).eps)
    if sparse:
        live = kept.gather(1, chosen) > 0
        experts = torch.where(live, chosen, torch.full_like(chosen, -1))
        return (l_aux, capacity, gates.shape[1], experts.t().to(torch.int32),
                place.gather(1, chosen).t().to(torch.int32), weights.gather(1, chosen).t().contiguous(), counts)
    combine = weights.unsqueeze(-1) * F.one_hot(place.long(), num_classes=int(capacity)).float()
    return l_aux, combine, combine.bool(), counts


def top1gating(logits: Tensor, capacity_factor: float, min_capacity: int, used_token: Tensor = None,
               noisy_gate_policy: Optional[str] = None, drop_tokens: bool = True, use_rts: bool = True,
               ep_group: Union[Any, None] = None, sparse_routes: bool = False,
               use_tutel: bool = False) -> tuple:  # fmt: skip
    """Each token to its most probable expert (Gumbel-perturbed under 'RSample'); an over-full expert keeps
    random tokens (``use_rts``) or the first ones. Returns as the module docstring says."""
    if logits.shape[0] < min_capacity:
        raise ValueError(f"top-1 gating got {logits.shape[0]} tokens, fewer than min_capacity={min_capacity}: "
                         "lower min_capacity (0 disables it) or feed larger batches")
    perturbed = logits + gumbel_rsample(logits.shape, logits.device) if noisy_gate_policy == "RSample" else None
    gates = F.softmax(logits, dim=1)
    capacity = _slots_per_expert(gates, capacity_factor, min_capacity)
    best = (gates if perturbed is None else perturbed).argmax(dim=1)
    routed = F.one_hot(best, num_classes=gates.shape[1])
    if used_token is not None:
        routed = used_token.unsqueeze(1) * routed
    counts = routed.sum(dim=0).detach().to(logits.device)
    if not drop_tokens:
        capacity = _busiest_expert(counts, ep_group).to(logits.device)
        capacity = min(capacity, torch.tensor(routed.shape[0]).to(capacity.device))
    l_aux = _balance_loss(gates, routed, squared=False)
    scores = routed * _noise("pick", routed.shape, logits.device) if use_rts else routed
    return _route(gates, best.unsqueeze(1), [routed], capacity, "best", scores, False, l_aux, counts,
                  sparse_routes)  # fmt: skip


def top2gating(logits: Tensor, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               ep_group: Union[Any, None] = None, top2_2nd_expert_sampling: bool = True,
               sparse_routes: bool = False) -> tuple:  # fmt: skip
    """Each token to its most probable expert and to a second one (the best other logit, Gumbel-perturbed
    unless ``top2_2nd_expert_sampling=False``); first choices queue ahead of second ones; the two gate values
    are rescaled to sum to 1."""
    gates = F.softmax(logits, dim=1)
    experts = gates.shape[1]
    first = gates.argmax(dim=1)
    first_mask = F.one_hot(first, num_classes=experts)
    if top2_2nd_expert_sampling:
        logits = logits + gumbel_rsample(logits.shape, logits.device)
    second = logits.masked_fill(first_mask.bool(), float("-inf")).argmax(dim=1)
    second_mask = F.one_hot(second, num_classes=experts)
    l_aux = _balance_loss(gates, first_mask, squared=True)
    counts = (first_mask + second_mask).sum(dim=0).detach().to(logits.device)
    if drop_tokens:
        capacity, policy = _slots_per_expert(gates, capacity_factor * 2, min_capacity), "queue"
    else:
        capacity, policy = _busiest_expert(counts, ep_group), "all"
    return _route(gates, torch.stack([first, second], dim=1), [first_mask, second_mask], capacity, policy,
                  l_aux=l_aux, counts=counts, sparse=sparse_routes)  # fmt: skip


def topkgating(logits: Tensor, k: int, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               ep_group: Union[Any, None] = None, drop_policy: str = "probs", sparse_routes: bool = False) -> tuple:
    """Each token to its ``k`` most probable experts, queued in token order; the k gate values rescaled to sum
    to 1. Over capacity, ``drop_policy='probs'`` keeps an expert's highest-probability routes, ``'position'``
    its earliest."""
    gates = F.softmax(logits, dim=1)
    picked = torch.topk(gates, k=k, dim=1)[1]
    routed = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, picked, 1)
    counts = routed.sum(dim=0).detach().to(logits.device)
    l_aux = _balance_loss(gates, routed, squared=True, k=k)
    if not drop_tokens:
        capacity, policy = _busiest_expert(counts, ep_group), "all"
    elif drop_policy in ("probs", "position"):
        capacity = _slots_per_expert(gates, capacity_factor * k, min_capacity)
        policy = "best" if drop_policy == "probs" else "queue"
    else:
        raise ValueError(f"Invalid drop_policy: {drop_policy} (expected 'probs' or 'position')")
    return _route(gates, picked, [routed], capacity, policy, gates * routed, l_aux=l_aux, counts=counts,
                  sparse=sparse_routes)  # fmt: skip


def _route_slots(indices: Tensor, locations: Tensor, num_experts: int, capacity: int) -> Tensor:
    """Every route's row in the flat ``[E * C]`` expert buffer (``expert * C + position``); a dropped route
    (expert -1) gets the spare row ``E * C`` that encode and decode ignore."""
    spare = num_experts * capacity
    row = indices.long().mul(capacity).add(locations.long())
    return row.masked_fill(indices < 0, spare)


def _sparse_encode(reshaped_input: Tensor, slots: Tensor, num_experts: int, capacity: int) -> Tensor:
    """The ``[E, C, M]`` buffer the experts read: each row filled from the token routed there, zeros where no
    token was."""
    tokens, width = reshaped_input.shape
    owner = torch.full((num_experts * capacity + 1, ), tokens, dtype=torch.long, device=slots.device)
    owner[slots.reshape(-1)] = torch.arange(tokens, device=slots.device).repeat(slots.shape[0])
    with_blank = torch.cat([reshaped_input, reshaped_input.new_zeros(1, width)])
    return with_blank[owner[:-1]].view(num_experts, capacity, width)


def _sparse_decode(expert_output: Tensor, slots: Tensor, gates: Tensor, num_tokens: int) -> Tensor:
    """Back to tokens: each token's rows of ``expert_output`` (``[E * C, M]``) times its gate values, summed over
    its routes in the gates' precision, returned in the experts' dtype."""
    width = expert_output.shape[-1]
    with_blank = torch.cat([expert_output, expert_output.new_zeros(1, width)])
    picked = with_blank[slots.reshape(-1)].view(*slots.shape, width)
    return torch.einsum("ksm,ks->sm", picked, gates).to(expert_output.dtype)


class TopKGate(Module):
    """The router: ``wg``, a bias-free linear map from the model width to one logit per expert, evaluated in
    fp32, followed by top-1, top-2 or top-k gating by ``k``. Training uses ``capacity_factor`` and the noise
    policy; evaluation uses ``eval_capacity_factor`` and no noise."""

    wg: torch.nn.Linear

    def __init__(self, model_dim: int, num_experts: int, k: int = 1, capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0, min_capacity: int = 8, noisy_gate_policy: Optional[str] = None,
                 drop_tokens: bool = True, use_rts: bool = True, ep_group: Union[Any, None] = None,
                 top2_2nd_expert_sampling: bool = True) -> None:  # fmt: skip
        super().__init__()
        self.wg = torch.nn.Linear(model_dim, num_experts, bias=False)
        self.k, self.ep_group = k, ep_group
        self.capacity_factor, self.eval_capacity_factor = capacity_factor, eval_capacity_factor
        self.min_capacity, self.noisy_gate_policy = min_capacity, noisy_gate_policy
        self.drop_tokens, self.use_rts = drop_tokens, use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling
        self.wall_clock_breakdown, self.gate_time = False, 0.0

    def _set_ep_group(self, ep_group: Any) -> None:
        if self.ep_group is not None:
            raise ValueError("this gate already has an expert-parallel group; it is set once")
        self.ep_group = ep_group

    def forward(self, input: Tensor, used_token: Tensor = None, sparse_routes: bool = False,
                use_tutel: bool = False) -> tuple:  # fmt: skip
        x = input.float()
        noise = self.noisy_gate_policy if self.training else None
        if noise == "Jitter":
            x = multiplicative_jitter(x, device=input.device)
        logits = F.linear(x, self.wg.weight.float())
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            return top1gating(logits, factor, self.min_capacity, used_token, noise, self.drop_tokens, self.use_rts,
                              self.ep_group, sparse_routes, use_tutel)  # fmt: skip
        if self.k == 2:
            return top2gating(logits, factor, self.min_capacity, self.drop_tokens, self.ep_group,
                              self.top2_2nd_expert_sampling, sparse_routes)  # fmt: skip
        return topkgating(logits, self.k, factor, self.min_capacity, self.drop_tokens, self.ep_group,
                          sparse_routes=sparse_routes)  # fmt: skip


class MOELayer(Module):
    """Route, dispatch, run the experts, combine. With ``ep_size`` ranks in the expert-parallel group, each
    holding ``num_local_experts`` experts, the ``[E, C, M]`` dispatch buffer is exchanged all-to-all so every
    rank gets all ranks' tokens for its experts, and the expert results return the same way. The last
    forward's ``l_aux`` and ``exp_counts`` stay on the layer."""

    def __init__(self, gate: Module, experts: Module, ep_group_name: str, ep_size: int, num_local_experts: int,
                 use_tutel: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.gate, self.experts = gate, experts
        self.ep_group, self.ep_group_name, self.ep_size = None, ep_group_name, ep_size
        self.num_local_experts = num_local_experts
        self.time_falltoall = self.time_salltoall = self.time_moe = 0.0
        self.wall_clock_breakdown = False
        self.use_tutel = False
        if use_tutel:
            log.warning("MoE(use_tutel=True) is accepted but Tutel is not used: torsh dispatches with torch "
                        "operations, which give the same results")  # fmt: skip

    def _set_ep_group(self, ep_group: Any) -> None:
        self.ep_group = ep_group
        self.gate._set_ep_group(ep_group)

    def forward(self, *input: Tensor, **kwargs: Any) -> Tensor:
        hidden = input[0]
        width = hidden.shape[-1]
        flat = hidden.reshape(-1, width)
        mask = input[1] if len(input) > 1 else None
        routes = self.gate(flat, mask, True, False)
        self.l_aux, capacity, experts, self.exp_counts = routes[0], int(routes[1]), routes[2], routes[6]
        rows = _route_slots(routes[3], routes[4], experts, capacity)
        buffer = _sparse_encode(flat, rows, experts, capacity)

        split_slots = tensor_parallel_world_size() > 1  # tensor-parallel peers hold the same tokens
        expert_tp = split_slots and groups._get_expert_model_parallel_world_size() > 1
        if split_slots:
            buffer = drop_tokens(buffer, dim=1)
        buffer = self._exchange(buffer)
        if expert_tp:
            buffer = gather_tokens(buffer, dim=1)
        results = self.experts(buffer.reshape(self.ep_size, self.num_local_experts, -1, width))
        results = results.reshape(self.ep_size * self.num_local_experts, -1, width)
        if expert_tp:
            results = drop_tokens(results, dim=1)
        results = self._exchange(results)
        if split_slots:
            results = gather_tokens(results, dim=1)
        merged = _sparse_decode(results.view(experts * capacity, width), rows, routes[5], flat.shape[0])
        return merged.reshape(hidden.shape)

    def _exchange(self, buffer: Tensor) -> Tensor:
        """The all-to-all over the expert-parallel group (nothing to exchange when ``ep_size`` is 1)."""
        if self.ep_size == 1:
            return buffer.contiguous()
        if self.ep_group is None:
            from .._unsupported import NotSupportedByTorsh

            raise NotSupportedByTorsh(
                f"an MoE layer with ep_size={self.ep_size} ran before its expert-parallel group was made: the "
                "groups are made by deepspeed.initialize (the engine calls set_deepspeed_parallelism on every MoE "
                "layer); build the engine first, or call moe_layer.set_deepspeed_parallelism() on every rank")
        return _AllToAll.apply(self.ep_group, buffer)
