"""Run written FSDP configs against real torch FSDP on the ranks of one launch.

``python -m torch.distributed.run --nproc-per-node 2 fsdp_worker.py SPEC OUT``. SPEC is a JSON list of cases:
``{"name", "kind": "snippet" | "fsdp1" | "fsdp2", "payload", "classes"}`` - a ``torsh-migrate snippet`` text, or
the FSDP1 / FSDP2 kwargs ``convert --to fsdp`` writes. Each case builds a small model whose block class carries
the name the config wraps (``classes``), applies the config with torch's own FSDP, and runs a forward, a backward
and an optimizer step. Rank 0 writes ``{name: "ok" | error}`` to OUT.
"""

from __future__ import annotations

import functools
import json
import sys
import traceback

import torch
import torch.distributed as dist
from torch import nn


class _Block(nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        return torch.relu(self.lin(x))


def build_model(classes: list[str]) -> nn.Module:
    """Embedding-like input layer, a ModuleList of blocks (a model's ``layers``), an output head."""
    block = type(classes[0], (_Block,), {}) if classes else _Block

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(4, 8)
            self.layers = nn.ModuleList([block() for _ in range(3)])
            self.out = nn.Linear(8, 1)

        def forward(self, x):
            x = self.inp(x)
            for layer in self.layers:
                x = layer(x)
            return self.out(x)

    torch.manual_seed(0)
    return Model()


def _dtype(name):
    return getattr(torch, str(name).split(".")[-1]) if name else None


def _mesh(desc):
    from torch.distributed.device_mesh import init_device_mesh

    shape = list(desc["shape"])
    # The config's shard group may be larger than these 2 ranks (8 GPUs per node): the same layout, scaled down.
    shape[-1] = min(shape[-1], dist.get_world_size()) if shape[-1] != -1 else -1
    if -1 in shape:
        known = 1
        for s in shape:
            known *= s if s != -1 else 1
        shape[shape.index(-1)] = dist.get_world_size() // known
    return init_device_mesh("cpu", tuple(shape), mesh_dim_names=tuple(desc.get("dim_names") or ()) or None)


#: Arguments whose JSON value is a name (an enum member); any other string value is an expression of the source
#: script (``mp_policy``, ``world_mesh["dp"]``), kept by the adapter for the script and not evaluable here.
_NAMED = ("sharding_strategy", "backward_prefetch", "state_dict_type")


def script_expressions(kw: dict) -> list[str]:
    """Take the script's expressions out of ``kw``; returns their keys."""
    found = [k for k, v in kw.items() if isinstance(v, str) and k not in _NAMED]
    for key in ("mesh", "device_mesh"):
        mesh = kw.get(key)
        if isinstance(mesh, dict) and not all(isinstance(s, int) for s in mesh.get("shape", [None])):
            found.append(key)
    for key in ("mixed_precision", "mp_policy"):
        policy = kw.get(key)
        if isinstance(policy, dict):
            exprs = [k for k, v in policy.items() if k.endswith("dtype") and v is not None
                     and not isinstance(getattr(torch, str(v).split(".")[-1], None), torch.dtype)]  # fmt: skip
            kw[key] = {k: v for k, v in policy.items() if k not in exprs}
            found += [f"{key}.{k}" for k in exprs]
    for key in found:
        kw.pop(key, None)
    return found


def apply_fsdp1(model: nn.Module, payload: dict) -> nn.Module:
    from torch.distributed import fsdp
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy

    # device_id names the script's GPU; on this machine every rank computes on the CPU
    kw = {k: v for k, v in payload.items() if k not in ("state_dict_type", "device_id")}
    script_expressions(kw)
    if "sharding_strategy" in kw:
        kw["sharding_strategy"] = fsdp.ShardingStrategy[kw["sharding_strategy"]]
    if "mixed_precision" in kw:
        kw["mixed_precision"] = fsdp.MixedPrecision(**{k: _dtype(v) if k.endswith("dtype") else v
                                                       for k, v in kw["mixed_precision"].items()})  # fmt: skip
    if "cpu_offload" in kw:
        kw["cpu_offload"] = fsdp.CPUOffload(**kw["cpu_offload"])
    if kw.get("backward_prefetch"):
        kw["backward_prefetch"] = fsdp.BackwardPrefetch[kw["backward_prefetch"]]
    if "device_mesh" in kw:
        kw["device_mesh"] = _mesh(kw["device_mesh"])
    policy = kw.pop("auto_wrap_policy", {})
    if "transformer_layer_cls" in policy:
        names = set(policy["transformer_layer_cls"])
        kw["auto_wrap_policy"] = ModuleWrapPolicy({type(m) for m in model.modules() if type(m).__name__ in names})
    elif "min_num_params" in policy:
        kw["auto_wrap_policy"] = functools.partial(size_based_auto_wrap_policy, min_num_params=policy["min_num_params"])
    # FSDP1 needs an accelerator to broadcast module states: on this CPU machine the ranks start equal instead
    kw.pop("sync_module_states", None)
    return fsdp.FullyShardedDataParallel(model, device_id=torch.device("cpu"), **kw)


def apply_fsdp2(model: nn.Module, payload: dict) -> nn.Module:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kw = dict(payload.get("fully_shard", {}))
    script_expressions(kw)
    if "mesh" in kw:
        kw["mesh"] = _mesh(kw["mesh"])
    if "mp_policy" in kw:
        kw["mp_policy"] = MixedPrecisionPolicy(**{k: _dtype(v) if k.endswith("dtype") else v
                                                  for k, v in kw["mp_policy"].items()})  # fmt: skip
    if "offload_policy" in kw:
        kw["offload_policy"] = CPUOffloadPolicy(**kw["offload_policy"])
    names = set(payload.get("apply_to", []))
    for module in [m for m in model.modules() if m is not model and type(m).__name__ in names]:
        fully_shard(module, **kw)
    fully_shard(model, **kw)
    return model


def compute_dtype(case: dict):
    """The parameter dtype in compute the config sets (the script feeds inputs in it, as DeepSpeed scripts do)."""
    import re

    payload = case["payload"]
    if case["kind"] == "snippet":
        found = re.search(r"param_dtype=torch\.(\w+)", payload)
        return getattr(torch, found.group(1)) if found else None
    mp = payload.get("mixed_precision") if case["kind"] == "fsdp1" else payload.get("fully_shard", {}).get("mp_policy")
    name = mp.get("param_dtype") if isinstance(mp, dict) else None
    found = getattr(torch, str(name).split(".")[-1], None) if name else None
    return found if isinstance(found, torch.dtype) else None  # an expression of the script: its own dtype


def without_offload(case: dict) -> dict:
    """The case with CPU offload taken out: torch's offload needs an accelerator, which this machine lacks."""
    import re

    payload = case["payload"]
    if case["kind"] == "snippet":
        payload = re.sub(r"\n    offload_policy=CPUOffloadPolicy\([^)]*\),", "", payload)
    elif case["kind"] == "fsdp1":
        payload = {k: v for k, v in payload.items() if k != "cpu_offload"}
    else:
        payload = {**payload, "fully_shard": {k: v for k, v in payload.get("fully_shard", {}).items()
                                              if k != "offload_policy"}}  # fmt: skip
    return {**case, "payload": payload}


def has_offload(case: dict) -> bool:
    return without_offload(case)["payload"] != case["payload"]


def run_case(case: dict) -> None:
    if has_offload(case) and not torch.cuda.is_available():
        case = without_offload(case)
    model = build_model(case.get("classes") or [])
    if case["kind"] == "snippet":
        import re

        # the config's shard group may be larger than these 2 ranks: the same layout, scaled down
        code = re.sub(r"^shard_size = (\d+)", r"shard_size = min(\1, dist.get_world_size())", case["payload"],
                      flags=re.M)  # fmt: skip
        case = {**case, "payload": code}
        namespace = {"model": model}
        exec(compile(case["payload"], case["name"], "exec"), namespace)  # noqa: S102 - the code under test
        model = namespace["model"]
    elif case["kind"] == "fsdp1":
        model = apply_fsdp1(model, case["payload"])
    else:
        model = apply_fsdp2(model, case["payload"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(dist.get_rank()))
    dtype = compute_dtype(case)
    x = x.to(dtype) if dtype is not None else x
    model(x).float().sum().backward()
    optimizer.step()


def main(spec: str, out: str) -> int:
    dist.init_process_group("gloo")
    results = {}
    for case in json.loads(open(spec, encoding="utf-8").read()):
        try:
            run_case(case)
            results[case["name"]] = "ok" if not has_offload(case) or torch.cuda.is_available() else "ok-no-offload"
        except Exception as exc:  # noqa: BLE001 - every case reports; one failure must not hide the others
            results[case["name"]] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"
        dist.barrier()
    if dist.get_rank() == 0:
        with open(out, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
