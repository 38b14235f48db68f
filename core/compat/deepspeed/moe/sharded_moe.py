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

uniform_map: dict = {}
gumbel_map: dict = {}
exp_selection_uniform_map: dict = {}


def _sampler(cache: dict, device: torch.device, make):
    """A distribution's ``rsample`` for ``device``, made once (its parameters are tensors on the device)."""
    sample = cache.get(device)
    if sample is None:
        sample = cache[device] = make(device).rsample
    return sample


def multiplicative_jitter(x: Tensor, device: torch.device, epsilon: float = 1e-2) -> Tensor:
    """``x`` times uniform noise in ``[1 - epsilon, 1 + epsilon]`` (the 'Jitter' gate policy)."""
    if epsilon == 0:
        return x
    uniform = _sampler(uniform_map, device, lambda d: torch.distributions.uniform.Uniform(
        torch.tensor(1.0 - epsilon, device=d), torch.tensor(1.0 + epsilon, device=d)))  # fmt: skip
    return x * uniform(x.shape)


def gumbel_rsample(shape: tuple, device: torch.device) -> Tensor:
    """Standard Gumbel noise of ``shape`` (the 'RSample' policy and top-2's sampled second expert)."""
    gumbel = _sampler(gumbel_map, device, lambda d: torch.distributions.gumbel.Gumbel(
        torch.tensor(0.0, device=d), torch.tensor(1.0, device=d)))  # fmt: skip
    return gumbel(shape)


def _token_selection_noise(shape: tuple, device: torch.device) -> Tensor:
    uniform = _sampler(exp_selection_uniform_map, device, lambda d: torch.distributions.uniform.Uniform(
        torch.tensor(0.0, device=d), torch.tensor(1.0, device=d)))  # fmt: skip
    return uniform(shape)


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` over ``group``: chunk i of the input goes to the group's rank i. Its backward is
    the same exchange (it is its own inverse)."""

    @staticmethod
    def forward(ctx: Any, group: Any, input: Tensor) -> Tensor:  # type: ignore[override]
        ctx.group = group
        input = input.contiguous()
        output = torch.empty_like(input)
        dist.all_to_all_single(output, input, group=group)
        return output

    @staticmethod
    def backward(ctx: Any, *grad_output: Tensor) -> tuple[None, Tensor]:
        return None, _AllToAll.apply(ctx.group, *grad_output)


def einsum(rule: str, a: Tensor, b: Tensor) -> Tensor:
    """``torch.einsum`` (DeepSpeed's switch between einsum and hand-written products; the results agree)."""
    return torch.einsum(rule, a, b)


def _is_parallel(group: Any) -> bool:
    """Whether ``group`` spans more than one rank; None means no expert parallelism (never the world)."""
    return group is not None and dist.get_world_size(group) > 1


def _capacity(gates: Tensor, capacity_factor: Tensor, min_capacity: Tensor) -> Tensor:
    """Slots per expert: ``ceil(tokens / experts * capacity_factor)``, at least ``min_capacity`` (a tensor)."""
    num_tokens, num_experts = gates.shape[0], gates.shape[1]
    capacity = torch.ceil((num_tokens / num_experts) * capacity_factor).to(torch.int64)
    return torch.maximum(capacity, min_capacity.to(torch.int64))


def _undropped_capacity(exp_counts: Tensor, ep_group: Any) -> Tensor:
    """``drop_tokens=False``: the largest expert load, the maximum over the expert-parallel group (every rank
    must size its buffers alike for the all-to-all), rounded up to a multiple of the tensor-parallel degree
    when the experts are not tensor-parallel (the layer then splits the slots over that degree)."""
    capacity = torch.max(exp_counts)
    if _is_parallel(ep_group):
        dist.all_reduce(capacity, op=dist.ReduceOp.MAX, group=ep_group)
    if groups._get_expert_model_parallel_world_size() == 1:
        tp = tensor_parallel_world_size()
        capacity = torch.ceil(capacity / tp).mul(tp).to(capacity.dtype)
    return capacity


def _stack_routes(routes: Tensor, dtype: Optional[torch.dtype] = None) -> Tensor:
    """A ``[S, k]`` per-route tensor as the ``[k, S]`` block the dispatch reads (cast once)."""
    routes = routes.t().contiguous()
    return routes if dtype is None else routes.to(dtype)


def _route_slots(indices: Tensor, locations: Tensor, num_experts: int, capacity: int) -> Tensor:
    """The flat slot ``expert * capacity + location`` of every route in the ``[E * C]`` expert buffer; a dropped
    route (index < 0) points at the extra slot ``E * C``, which the encode and decode leave out."""
    slot = indices.long() * capacity + locations.long()
    return torch.where(indices >= 0, slot, torch.full_like(slot, num_experts * capacity))


def _sparse_encode(reshaped_input: Tensor, slots: Tensor, num_experts: int, capacity: int) -> Tensor:
    """The ``[E, C, M]`` expert buffer: each slot holds the token routed to it, empty slots zeros (one gather)."""
    num_tokens, d_model = reshaped_input.shape
    source = torch.full((num_experts * capacity + 1, ), num_tokens, dtype=torch.long, device=slots.device)
    token_of_route = torch.arange(num_tokens, device=slots.device).expand_as(slots)
    source.scatter_(0, slots.reshape(-1), token_of_route.reshape(-1))
    padded = torch.cat([reshaped_input, reshaped_input.new_zeros(1, d_model)])  # row S: the empty slot's zeros
    return padded.index_select(0, source[:-1]).view(num_experts, capacity, d_model)


def _sparse_decode(expert_output: Tensor, slots: Tensor, gates: Tensor, num_tokens: int) -> Tensor:
    """Each token's expert results, weighted by its gate values and summed over its routes (in fp32, the gates'
    dtype), in the experts' dtype. ``expert_output``: ``[E * C, M]``."""
    d_model = expert_output.size(-1)
    padded = torch.cat([expert_output, expert_output.new_zeros(1, d_model)])
    routed = padded.index_select(0, slots.reshape(-1)).view(slots.size(0), num_tokens, d_model)
    return (routed * gates.unsqueeze(-1)).sum(0).to(expert_output.dtype)


def top1gating(logits: Tensor, capacity_factor: float, min_capacity: int, used_token: Tensor = None,
               noisy_gate_policy: Optional[str] = None, drop_tokens: bool = True, use_rts: bool = True,
               ep_group: Union[Any, None] = None, sparse_routes: bool = False,
               use_tutel: bool = False) -> tuple:  # fmt: skip
    """Top-1 gating of ``logits`` ``[S, E]`` (see the module docstring for what it returns)."""
    if noisy_gate_policy == "RSample":
        noisy_logits = logits + gumbel_rsample(logits.shape, device=logits.device)
    gates = F.softmax(logits, dim=1)
    capacity = _capacity(gates, torch.tensor(capacity_factor), torch.tensor(min_capacity))
    indices1_s = torch.argmax(noisy_logits if noisy_gate_policy == "RSample" else gates, dim=1)
    num_experts = int(gates.shape[1])
    mask1 = F.one_hot(indices1_s, num_classes=num_experts)
    if used_token is not None:
        mask1 = einsum("s,se->se", used_token, mask1)
    exp_counts = torch.sum(mask1, dim=0).detach().to(logits.device)
    if not drop_tokens:
        capacity = _undropped_capacity(exp_counts, ep_group).to(logits.device)
        capacity = min(capacity, torch.tensor(mask1.size(0)).to(capacity.device))  # never more than the tokens

    # the load-balancing loss: mean gate probability times the fraction of tokens, per expert
    me = torch.mean(gates, dim=0)
    ce = torch.mean(mask1.float(), dim=0)
    l_aux = torch.sum(me * ce) * num_experts

    # which tokens an over-full expert keeps: random ones (use_rts), else the first
    mask1_rand = mask1 * _token_selection_noise(mask1.shape, logits.device) if use_rts else mask1
    assert logits.shape[0] >= min_capacity, ("No. of tokens (batch-size) should be greater than min_capacity. "
                                             "Either set min_capacity to 0 or increase your batch size.")
    selection = min(capacity, torch.tensor(mask1.size(0)).to(capacity.device))  # topk cannot pick more than S
    top_idx = torch.topk(mask1_rand, k=selection, dim=0)[1]
    mask1 = mask1 * torch.zeros_like(mask1).scatter_(0, top_idx, 1)

    if sparse_routes:
        indices1_s = torch.min(indices1_s, mask1.sum(dim=1) * num_experts - 1)  # a dropped token: -1
    locations1 = torch.cumsum(mask1, dim=0) - 1
    locations1_s = torch.sum(locations1 * mask1, dim=1)
    if sparse_routes:
        gates1_s = (gates * mask1).sum(dim=1)
        return (l_aux, capacity, num_experts, indices1_s.to(torch.int32).unsqueeze(0),
                locations1_s.to(torch.int32).unsqueeze(0), gates1_s.unsqueeze(0), exp_counts)  # fmt: skip

    gates = gates * mask1.float()
    locations1_sc = F.one_hot(locations1_s, num_classes=int(capacity)).float()
    combine_weights = einsum("se,sc->sec", gates, locations1_sc)
    return l_aux, combine_weights, combine_weights.bool(), exp_counts


def top2gating(logits: Tensor, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               ep_group: Union[Any, None] = None, top2_2nd_expert_sampling: bool = True,
               sparse_routes: bool = False) -> tuple:  # fmt: skip
    """Top-2 gating of ``logits`` ``[S, E]``: the most probable expert, and the next one (sampled with Gumbel
    noise unless ``top2_2nd_expert_sampling=False``); the two gate values normalised to sum to 1."""
    gates = F.softmax(logits, dim=1)
    indices1_s = torch.argmax(gates, dim=1)
    num_experts = int(gates.shape[1])
    mask1 = F.one_hot(indices1_s, num_classes=num_experts)
    if top2_2nd_expert_sampling:
        logits = logits + gumbel_rsample(logits.shape, device=logits.device)
    indices2_s = torch.argmax(logits.masked_fill(mask1.bool(), float("-inf")), dim=1)
    mask2 = F.one_hot(indices2_s, num_classes=num_experts)

    # slots: first choices first, then second choices after all first choices of the expert
    locations1 = torch.cumsum(mask1, dim=0) - 1
    locations2 = torch.cumsum(mask2, dim=0) - 1
    locations2 += torch.sum(mask1, dim=0, keepdim=True)

    me = torch.mean(gates, dim=0)
    ce = torch.mean(mask1.float(), dim=0)
    l_aux = torch.mean(me * ce) * num_experts * num_experts
    exp_counts = torch.sum(mask1 + mask2, dim=0).detach().to(logits.device)

    if drop_tokens:
        capacity = _capacity(gates, torch.tensor(capacity_factor * 2), torch.tensor(min_capacity))
        mask1 *= torch.lt(locations1, capacity)
        mask2 *= torch.lt(locations2, capacity)
    else:
        capacity = _undropped_capacity(exp_counts, ep_group)

    locations1_s = torch.sum(locations1 * mask1, dim=1)
    locations2_s = torch.sum(locations2 * mask2, dim=1)
    mask1_float, mask2_float = mask1.float(), mask2.float()
    gates1_s = einsum("se,se->s", gates, mask1_float)
    gates2_s = einsum("se,se->s", gates, mask2_float)
    denom_s = torch.clamp(gates1_s + gates2_s, min=torch.finfo(gates1_s.dtype).eps)
    gates1_s /= denom_s
    gates2_s /= denom_s

    if sparse_routes:
        indices1_s = torch.where(mask1.any(dim=1), indices1_s, torch.full_like(indices1_s, -1))
        indices2_s = torch.where(mask2.any(dim=1), indices2_s, torch.full_like(indices2_s, -1))
        return (l_aux, capacity, num_experts, torch.stack([indices1_s, indices2_s]).to(torch.int32),
                torch.stack([locations1_s, locations2_s]).to(torch.int32), torch.stack([gates1_s, gates2_s]),
                exp_counts)  # fmt: skip

    gates1 = einsum("s,se->se", gates1_s, mask1_float)
    gates2 = einsum("s,se->se", gates2_s, mask2_float)
    locations1_sc = F.one_hot(locations1_s, num_classes=int(capacity)).float()
    locations2_sc = F.one_hot(locations2_s, num_classes=int(capacity)).float()
    combine_weights = einsum("se,sc->sec", gates1, locations1_sc) + einsum("se,sc->sec", gates2, locations2_sc)
    return l_aux, combine_weights, combine_weights.bool(), exp_counts


def topkgating(logits: Tensor, k: int, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               ep_group: Union[Any, None] = None, drop_policy: str = "probs", sparse_routes: bool = False) -> tuple:
    """Top-k gating of ``logits`` ``[S, E]``; the k gate values of a token normalised to sum to 1. Over capacity,
    ``drop_policy='probs'`` keeps each expert's most probable routes, ``'position'`` its first ones."""
    gates = F.softmax(logits, dim=1)
    num_experts = int(gates.shape[1])
    top_gate, top_idx = torch.topk(gates, k=k, dim=1)
    mask = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, top_idx, 1)
    exp_counts = torch.sum(mask, dim=0).detach().to(logits.device)

    me = torch.mean(gates, dim=0)
    ce = torch.mean(mask.float(), dim=0)
    l_aux = torch.mean(me * ce) * num_experts * num_experts / k

    if drop_tokens:
        capacity = _capacity(gates, torch.tensor(capacity_factor * k), torch.tensor(min_capacity))
        if drop_policy == "probs":
            routed_gates = torch.zeros_like(gates).scatter(1, top_idx, top_gate)
            selection = min(capacity, torch.tensor(gates.size(0)).to(capacity.device))
            _, kept = torch.topk(routed_gates, k=selection, dim=0, sorted=False)
            mask &= torch.zeros_like(gates, dtype=torch.bool).scatter_(0, kept, True)
            locations = torch.cumsum(mask, dim=0) - 1
        elif drop_policy == "position":
            locations = torch.cumsum(mask, dim=0) - 1
            mask *= torch.lt(locations, capacity)
        else:
            raise ValueError(f"Invalid drop_policy: {drop_policy}")
    else:
        capacity = _undropped_capacity(exp_counts, ep_group)
        locations = torch.cumsum(mask, dim=0) - 1

    gates_masked = gates * mask
    denom_s = torch.clamp(torch.sum(gates_masked, dim=-1, keepdim=True), min=torch.finfo(gates_masked.dtype).eps)
    gates_masked = gates_masked / denom_s

    if sparse_routes:
        kept_route = mask.gather(1, top_idx)
        route_indices = torch.where(kept_route, top_idx, torch.full_like(top_idx, -1))
        route_locations = locations.gather(1, top_idx) * kept_route
        route_gates = gates_masked.gather(1, top_idx)
        return (l_aux, capacity, num_experts, _stack_routes(route_indices, torch.int32),
                _stack_routes(route_locations, torch.int32), _stack_routes(route_gates), exp_counts)  # fmt: skip

    locations_sc = F.one_hot(locations * mask, num_classes=int(capacity)).float()
    combine_weights = torch.einsum("se,sec->sec", gates_masked, locations_sc)
    return l_aux, combine_weights, combine_weights.bool(), exp_counts


class TopKGate(Module):
    """The router: a bias-free linear layer ``wg`` from the model dimension to the experts, in fp32, then top-1,
    top-2 or top-k gating (``k``). ``capacity_factor`` applies in training, ``eval_capacity_factor`` in eval;
    the noise policy only in training."""

    wg: torch.nn.Linear

    def __init__(self, model_dim: int, num_experts: int, k: int = 1, capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0, min_capacity: int = 8, noisy_gate_policy: Optional[str] = None,
                 drop_tokens: bool = True, use_rts: bool = True, ep_group: Union[Any, None] = None,
                 top2_2nd_expert_sampling: bool = True) -> None:  # fmt: skip
        super().__init__()
        self.wg = torch.nn.Linear(model_dim, num_experts, bias=False)
        self.ep_group = ep_group
        self.k = k
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = noisy_gate_policy
        self.wall_clock_breakdown = False
        self.gate_time = 0.0
        self.drop_tokens = drop_tokens
        self.use_rts = use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling

    def _set_ep_group(self, ep_group: Any) -> None:
        assert self.ep_group is None, "Attempting to override an existing ep_group"
        self.ep_group = ep_group

    def forward(self, input: Tensor, used_token: Tensor = None, sparse_routes: bool = False,
                use_tutel: bool = False) -> tuple:  # fmt: skip
        input_fp32 = input.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            input_fp32 = multiplicative_jitter(input_fp32, device=input.device)
        logits = F.linear(input_fp32, weight=self.wg.weight.float(), bias=None)
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            return top1gating(logits, factor, self.min_capacity, used_token,
                              self.noisy_gate_policy if self.training else None, self.drop_tokens, self.use_rts,
                              self.ep_group, sparse_routes, use_tutel)  # fmt: skip
        if self.k == 2:
            return top2gating(logits, factor, self.min_capacity, self.drop_tokens, self.ep_group,
                              self.top2_2nd_expert_sampling, sparse_routes)  # fmt: skip
        return topkgating(logits, self.k, factor, self.min_capacity, self.drop_tokens, self.ep_group,
                          sparse_routes=sparse_routes)  # fmt: skip


class MOELayer(Module):
    """Gate, dispatch, experts, combine. The experts of the layer are spread over the ``ep_size`` ranks of the
    expert-parallel group (``num_local_experts`` on each): the ``[E, C, M]`` buffer of dispatched tokens is
    exchanged so that each rank receives every rank's tokens for its own experts, and the results go back the
    same way. ``l_aux`` and ``exp_counts`` of the last forward are kept on the layer."""

    def __init__(self, gate: Module, experts: Module, ep_group_name: str, ep_size: int, num_local_experts: int,
                 use_tutel: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.ep_group = None
        self.ep_size = ep_size
        self.ep_group_name = ep_group_name
        self.num_local_experts = num_local_experts
        self.time_falltoall = 0.0
        self.time_salltoall = 0.0
        self.time_moe = 0.0
        self.wall_clock_breakdown = False
        self.use_tutel = False
        if use_tutel:
            log.warning("MoE(use_tutel=True): Tutel's fused dispatch is not used by torsh; the layer runs torch's "
                        "dispatch (the same results)")  # fmt: skip

    def _set_ep_group(self, ep_group: Any) -> None:
        self.ep_group = ep_group
        self.gate._set_ep_group(ep_group)

    def forward(self, *input: Tensor, **kwargs: Any) -> Tensor:
        d_model = input[0].shape[-1]
        tokens = input[0].reshape(-1, d_model)
        self.l_aux, capacity, num_experts, indices, locations, gates, self.exp_counts = self.gate(
            tokens, input[1] if len(input) > 1 else None, True, False)
        capacity = int(capacity)
        slots = _route_slots(indices, locations, num_experts, capacity)
        dispatched = _sparse_encode(tokens, slots, num_experts, capacity)

        tp = tensor_parallel_world_size()
        expert_tp = groups._get_expert_model_parallel_world_size() > 1
        if tp > 1:  # the tensor-parallel ranks hold the same tokens: each sends only its share of the slots
            dispatched = drop_tokens(dispatched, dim=1)
        dispatched = self._exchange(dispatched)
        if tp > 1 and expert_tp:
            dispatched = gather_tokens(dispatched, dim=1)
        expert_output = self.experts(dispatched.reshape(self.ep_size, self.num_local_experts, -1, d_model))
        expert_output = expert_output.reshape(self.ep_size * self.num_local_experts, -1, d_model)
        if tp > 1 and expert_tp:
            expert_output = drop_tokens(expert_output, dim=1)
        expert_output = self._exchange(expert_output)
        if tp > 1:
            expert_output = gather_tokens(expert_output, dim=1)
        combined = _sparse_decode(expert_output.view(num_experts * capacity, d_model), slots, gates, tokens.size(0))
        return combined.reshape(input[0].shape)

    def _exchange(self, buffer: Tensor) -> Tensor:
        """The all-to-all over the expert-parallel group (none with one rank per layer's experts)."""
        if self.ep_size == 1:
            return buffer.contiguous()
        if self.ep_group is None:
            from .._unsupported import NotSupportedByTorsh

            raise NotSupportedByTorsh(
                f"an MoE layer with ep_size={self.ep_size} ran before its expert-parallel group was made: the "
                "groups are made by deepspeed.initialize (the engine calls set_deepspeed_parallelism on every MoE "
                "layer); build the engine first, or call moe_layer.set_deepspeed_parallelism() on every rank")
        return _AllToAll.apply(self.ep_group, buffer)
