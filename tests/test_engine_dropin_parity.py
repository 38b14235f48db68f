"""Behaviours real DeepSpeed scripts rely on, run by the same script under real DeepSpeed 0.19.8 and under torsh
on 2 gloo ranks (DeepSpeed JSON, ``backend.initialize``), per-step losses compared (fp32: 1e-5 relative).

- tied weights at stages 2/3 (an output head sharing the embedding's weight): trains, saves, loads, stays tied;
- a parameter unused in forward (a BERT-style pooler) at stages 0/1, without any config key;
- a script that calls the raw model, then ``engine.backward``/``engine.step``: averaged gradients, equal ranks;
- fp16 with BatchNorm (stages 0 and 2);
- ``deepspeed.utils.zero_to_fp32`` on the tied model's checkpoints (torsh's and DeepSpeed's), against DeepSpeed's own;
- a Mixture-of-Experts block flagged with ``deepspeed.utils.set_z3_leaf_modules`` at ZeRO-3, each rank routing
  its tokens to other experts;
- a LoRA-style job (frozen parameters, only the trainable ones passed, checkpoints without them) at stages 0-3;
- saving at ZeRO-3 as Trainer scripts do: ``zero_optimization_partition_weights()``,
  ``zero_gather_16bit_weights_on_model_save()``, then ``_zero3_consolidated_16bit_state_dict()`` on every rank.
"""

from __future__ import annotations

import importlib.util
import json
import math

import pytest

pytest.importorskip("torch")
pytest.importorskip("deepspeed", reason="DeepSpeed 0.19.8 is installed by requirements-dev.txt in CI")

import _engine_harness as h  # noqa: E402
import capabilities  # noqa: E402

pytestmark = pytest.mark.slow

MODULE = "test_engine_dropin_parity"
FP32 = 1e-5


_backend, ds_config = h.backend, h.ds_config


def _train(engine, rank: int, start: int, steps: int, *, raw=None) -> list[float]:
    """DeepSpeed's loop; ``raw`` (the user's model) replaces ``engine(x)`` when given."""
    losses = []
    for step in range(start, start + steps):
        x, y = h.batch(step, rank, 2)
        loss = h.lm_loss((raw or engine)(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def tied_model(seed: int):
    import torch
    from torch import nn

    class TiedLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(h.VOCAB, h.HIDDEN)
            self.block = nn.Sequential(nn.Linear(h.HIDDEN, 2 * h.HIDDEN), nn.GELU(), nn.Linear(2 * h.HIDDEN, h.HIDDEN))
            self.norm = nn.LayerNorm(h.HIDDEN)
            self.head = nn.Linear(h.HIDDEN, h.VOCAB, bias=False)
            self.head.weight = self.embed.weight  # tied, as most Hugging Face causal LMs

        def forward(self, tokens):
            x = self.embed(tokens)
            return self.head(self.norm(x + self.block(x)))

    torch.manual_seed(seed)
    return TiedLM()


def tied(rank: int, world_size: int, scenario: dict) -> dict:
    """Train 4 steps, save, train 2; a fresh engine (other weights) loads and repeats those 2 losses."""
    backend = _backend(scenario["engine"])
    model = tied_model(0)
    engine, *_ = backend.initialize(model=model, model_parameters=model.parameters(), config=scenario["config"])
    losses = _train(engine, rank, 0, 4)
    engine.save_checkpoint(scenario["dir"], tag="t")
    after = _train(engine, rank, 4, 2)
    model = tied_model(1)
    fresh, *_ = backend.initialize(model=model, model_parameters=model.parameters(), config=scenario["config"])
    fresh.load_checkpoint(scenario["dir"], tag="t")
    tied_after_load = fresh.module.head.weight is fresh.module.embed.weight
    resumed = _train(fresh, rank, 4, 2)
    return {"losses": losses, "after": after, "resumed": resumed, "tied": tied_after_load,
            "params": len(list(fresh.module.parameters()))}  # fmt: skip


def pooler_model(seed: int):
    import torch
    from torch import nn

    class Bertish(nn.Module):
        """A BERT-style encoder whose pooler is not used by the LM loss; ``extra`` only while ``use_extra``."""

        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(h.VOCAB, h.HIDDEN)
            self.encoder = nn.Linear(h.HIDDEN, h.HIDDEN)
            self.extra = nn.Linear(h.HIDDEN, h.HIDDEN)
            self.pooler = nn.Linear(h.HIDDEN, h.HIDDEN)
            self.head = nn.Linear(h.HIDDEN, h.VOCAB)
            self.use_extra = True
            self.use_pooler = False

        def forward(self, tokens):
            x = self.embed(tokens)
            x = x + torch.tanh(self.encoder(x))
            if self.use_extra:
                x = x + self.extra(x)
            if self.use_pooler:
                x = x + self.pooler(x)
            return self.head(x)

    torch.manual_seed(seed)
    return Bertish()


def _weights(engine) -> dict[str, float]:
    full = {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in engine.module.named_parameters()}
    return {n: float(p.detach().double().sum()) for n, p in full.items()}


def unused(rank: int, world_size: int, scenario: dict) -> dict:
    """The pooler is never used (``late``: always used); ``extra`` is used in the first ``extra_steps`` steps only."""
    backend = _backend(scenario["engine"])
    model = pooler_model(0)
    model.use_pooler = scenario.get("late", False)
    engine, *_ = backend.initialize(model=model, model_parameters=model.parameters(), config=scenario["config"])
    losses = _train(engine, rank, 0, scenario["extra_steps"])
    model.use_extra = False
    losses += _train(engine, rank, scenario["extra_steps"], 4 - scenario["extra_steps"])
    return {"losses": losses, "weights": _weights(engine) if engine.zero_optimization_stage() < 3 else None}


def raw(rank: int, world_size: int, scenario: dict) -> dict:
    """The script calls its own model, not the engine, then engine.backward/step."""
    backend = _backend(scenario["engine"])
    model = h.build_model(0)
    engine, *_ = backend.initialize(model=model, model_parameters=model.parameters(), config=scenario["config"])
    losses = _train(engine, rank, 0, 4, raw=model)
    return {"losses": losses, "weights": _weights(engine) if engine.zero_optimization_stage() < 2 else None}


def conv_bn_model(seed: int):
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 4))


def fp16_bn(rank: int, world_size: int, scenario: dict) -> dict:
    """A conv/BatchNorm classifier in fp16; the script casts its inputs with ``.half()`` (as DeepSpeed scripts)."""
    import torch

    backend = _backend(scenario["engine"])
    model = conv_bn_model(0)
    engine, *_ = backend.initialize(model=model, model_parameters=model.parameters(), config=scenario["config"])
    losses = []
    for step in range(4):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(2, 3, 8, 8, generator=g), torch.randint(0, 4, (2,), generator=g)
        loss = torch.nn.functional.cross_entropy(engine(x.half() if scenario.get("half", True) else x).float(), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    stats = {n: str(b.dtype) for n, b in engine.module.named_buffers()}
    return {"losses": losses, "stats": stats, "running_mean": float(engine.module[1].running_mean.float().sum())}


def _gathered(engine) -> dict | None:
    state = engine._zero3_consolidated_16bit_state_dict()
    if state is None:
        return None
    return {"tied": state["head.weight"] is state["embed.weight"],
            "state": {k: [str(v.dtype), str(v.device), list(v.shape), float(v.double().sum())]
                      for k, v in state.items()}}  # fmt: skip


def save16(rank: int, world_size: int, scenario: dict) -> dict:
    """Ask what a save needs and gather the 16-bit weights as Trainer scripts do, before and after 2 steps."""
    backend = _backend(scenario["engine"])
    model = tied_model(0)
    engine, *_ = backend.initialize(model=model, model_parameters=model.parameters(), config=scenario["config"])
    flags = [engine.zero_optimization_partition_gradients(), engine.zero_optimization_partition_weights(),
             engine.zero_gather_16bit_weights_on_model_save(), engine.zero_cpu_offload()]  # fmt: skip
    try:
        before = _gathered(engine)
    except ValueError as exc:
        return {"flags": flags, "refused": str(exc)}
    losses = _train(engine, rank, 0, 2)
    return {"flags": flags, "before": before, "losses": losses, "after": _gathered(engine)}


def moe_model(seed: int):
    """Embedding, a top-1 routed MoE block whose 4 experts hold most parameters, head."""
    import torch
    from torch import nn

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.router = nn.Linear(h.HIDDEN, 4)
            self.experts = nn.ModuleList(nn.Sequential(nn.Linear(h.HIDDEN, 4 * h.HIDDEN), nn.GELU(),
                                                       nn.Linear(4 * h.HIDDEN, h.HIDDEN)) for _ in range(4))

        def forward(self, x):
            choice = self.router(x).argmax(-1)
            out = torch.zeros_like(x)
            for i, expert in enumerate(self.experts):
                picked = choice == i
                if picked.any():  # as MoE blocks do: an expert no token picked does not run
                    out[picked] = expert(x[picked])
            return x + out

    class MoeLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(h.VOCAB, h.HIDDEN)
            self.moe = Experts()
            self.head = nn.Linear(h.HIDDEN, h.VOCAB)

        def forward(self, tokens):
            return self.head(self.moe(self.embed(tokens)))

    torch.manual_seed(seed)
    return MoeLM()


def moe(rank: int, world_size: int, scenario: dict) -> dict:
    """The MoE block flagged as a leaf, 4 steps; which experts each rank ran at each step."""
    backend = _backend(scenario["engine"])
    model = moe_model(0)
    leaves = [type(m).__name__ for m in backend.utils.set_z3_leaf_modules(model, ["Experts"])]
    engine, *_ = backend.initialize(model=model, model_parameters=model.parameters(), config=scenario["config"])
    ran: list[set] = []
    for n, expert in enumerate(model.moe.experts):
        expert.register_forward_pre_hook(lambda m, i, n=n: ran[-1].add(n))
    losses = []
    for step in range(4):
        ran.append(set())
        losses += _train(engine, rank, step, 1)
    return {"losses": losses, "leaves": leaves, "ran": [sorted(r) for r in ran],
            "leaf": backend.utils.z3_leaf_module(model.moe), "found": len(backend.utils.get_z3_leaf_modules(model))}


def mixtral(rank: int, world_size: int, scenario: dict) -> dict:
    """A tiny Hugging Face Mixtral, nothing flagged by the script: DeepSpeed's default leaf classes apply."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    backend = _backend(scenario["engine"])
    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(vocab_size=h.VOCAB, hidden_size=h.HIDDEN, intermediate_size=32,
                                             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                             num_local_experts=4, num_experts_per_tok=1))  # fmt: skip
    engine, *_ = backend.initialize(model=model, model_parameters=model.parameters(), config=scenario["config"])
    losses = []
    for step in range(3):
        x, y = h.batch(step, rank, 2)
        loss = h.lm_loss(engine(input_ids=x).logits, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    leaves = [type(m).__name__ for m in model.modules() if getattr(m, "_z3_leaf", False)]
    return {"losses": losses, "leaves": leaves}


def overflow_flag(rank: int, world_size: int, scenario: dict) -> dict:
    """``engine.optimizer.overflow`` after each step, the second step's loss made infinite (DeepSpeed-Chat and
    GPT-NeoX read it to count skipped steps)."""
    backend = _backend(scenario["engine"])
    model = h.build_model(0)
    engine, *_ = backend.initialize(model=model, model_parameters=model.parameters(), config=scenario["config"])
    flags, scales = [], []
    for step in range(3):
        x, y = h.batch(step, rank, 2)
        loss = h.lm_loss(engine(x), y)
        engine.backward(loss * float("inf") if step == 1 else loss)
        engine.step()
        flags.append(engine.optimizer.overflow)
        # fp16: the loss scale, which GPT-NeoX and Megatron-DeepSpeed log from the optimizer
        scales.append([getattr(engine.optimizer, "cur_scale", None), getattr(engine.optimizer, "loss_scale", None)])
    return {"flags": flags, "scales": scales}


def fp32_param(rank: int, world_size: int, scenario: dict) -> dict:
    """``deepspeed.utils.safe_get_full_fp32_param`` after 2 bf16 steps: the fp32 master, not the bf16 weight."""
    import math

    import torch

    backend = _backend(scenario["engine"])
    model = h.build_model(0)
    engine, *_ = backend.initialize(model=model, model_parameters=model.parameters(), config=scenario["config"])
    _train(engine, rank, 0, 2)
    full = {n: backend.utils.safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters()}
    none = sorted(n for n, v in full.items() if v is None)
    full = {n: v for n, v in full.items() if v is not None}
    # safe_get_full_grad between backward and step
    head = dict(engine.module.named_parameters())["head.weight"]
    x, y = h.batch(9, rank, 2)
    engine.backward(h.lm_loss(engine(x), y))
    grad = backend.utils.safe_get_full_grad(head)
    grad = None if grad is None else [str(grad.dtype), math.fsum(grad.double().flatten().tolist()),
                                      math.fsum(grad.double().abs().flatten().tolist())]  # fmt: skip
    engine.step()
    # safe_set_full_fp32_param writes the fp32 weights the optimizer steps; a second step trains from them
    backend.utils.safe_set_full_fp32_param(head, torch.full(tuple(head.shape), 0.5))
    written = backend.utils.safe_get_full_fp32_param(head)
    set_value = None if written is None else sorted(set(written.flatten().tolist()))
    return {"grad": grad, "set": set_value, "after_set": _train(engine, rank, 3, 2), "none": none,
            "dtypes": sorted({str(v.dtype) for v in full.values()}),
            "fp32_bits": any(not torch.equal(v, v.bfloat16().float()) for v in full.values()),
            "sums": {n: [math.fsum(v.double().flatten().tolist()), math.fsum(v.double().abs().flatten().tolist())]
                     for n, v in full.items()}}  # fmt: skip


def _lora_style(seed_trainable: int):
    """``h.build_model(0)`` with the embedding and each block's ``up`` frozen (the base model, loaded the same every
    time) and the other parameters from ``seed_trainable`` (the adapters)."""
    import torch

    model = h.build_model(0)
    frozen = (model.embed, *(block.up for block in model.blocks))
    for module in frozen:
        module.requires_grad_(False)
    if seed_trainable:
        torch.manual_seed(seed_trainable)
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.normal_()
    return model


def frozen(rank: int, world_size: int, scenario: dict) -> dict:
    """A LoRA-style job: only the trainable parameters given to ``initialize`` (``filter(lambda p:
    p.requires_grad, ...)``, as PEFT scripts pass them); 4 steps, a checkpoint without the frozen parameters (the
    Trainer's ``exclude_frozen_parameters=True`` for PEFT models), 2 more steps; a fresh job loads it with
    ``load_module_strict=False`` and repeats those 2 steps."""
    backend = _backend(scenario["engine"])

    def start(seed):
        model = _lora_style(seed)
        return backend.initialize(model=model, config=scenario["config"],
                                  model_parameters=filter(lambda p: p.requires_grad, model.parameters()))[0]

    engine = start(0)
    losses = _train(engine, rank, 0, 4)
    engine.save_checkpoint(scenario["dir"], tag="f", exclude_frozen_parameters=True)
    after = _train(engine, rank, 4, 2)
    full = {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in engine.module.named_parameters()}
    fresh = start(5)
    try:  # DeepSpeed's default is a strict load, which both refuse
        fresh.load_checkpoint(scenario["dir"], tag="f")
        strict = ""
    except Exception as exc:  # noqa: BLE001 - DeepSpeed's RuntimeError, torsh's CheckpointError
        strict = str(exc)
    fresh.load_checkpoint(scenario["dir"], tag="f", load_module_strict=False)
    return {"losses": losses, "after": after, "resumed": _train(fresh, rank, 4, 2), "strict": strict,
            "frozen": {n: float(p.detach().double().sum()) for n, p in full.items() if not p.requires_grad}}


ENGINES = ("torsh", "deepspeed")


def _scenarios(tmp: str) -> list[dict]:
    out = []
    for engine in ENGINES:
        for stage in (2, 3):
            out.append({"name": f"tied_s{stage}_{engine}", "kind": "call", "target": f"{MODULE}:tied",
                        "engine": engine, "config": ds_config(stage), "dir": f"{tmp}/tied_s{stage}_{engine}"})
        for stage in (0, 1, 2, 3):
            # pooler unused throughout; extra unused from step 3 on as well; late: only extra, from step 3 on
            for extra_steps, late in ((4, False), (2, False), (2, True)):
                out.append({"name": f"unused{extra_steps}{'late' if late else ''}_s{stage}_{engine}", "kind": "call",
                            "engine": engine, "target": f"{MODULE}:unused", "extra_steps": extra_steps, "late": late,
                            "config": ds_config(stage, optimizer={"type": "AdamW", "params": {
                                "lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}})})  # fmt: skip
        ds_fp16 = engine == "torsh" or capabilities.deepspeed_fp16()
        for stage in (0, 2):
            fp16 = {"enabled": True, "initial_scale_power": 8}
            # DeepSpeed 0.19.8 keeps buffers in fp32 unless data_types.buffer_dtype says otherwise (and then
            # fails at the first BatchNorm, see the test); torsh needs no key
            extra = {"data_types": {"buffer_dtype": "fp16"}} if engine == "deepspeed" else {}
            if not ds_fp16:  # DeepSpeed's fp32 run of the same script is the reference
                out.append({"name": f"fp16bn_s{stage}_{engine}", "kind": "call", "target": f"{MODULE}:fp16_bn",
                            "engine": engine, "config": ds_config(stage), "half": False})  # fmt: skip
                continue
            out.append({"name": f"fp16bn_s{stage}_{engine}", "kind": "call", "target": f"{MODULE}:fp16_bn",
                        "engine": engine, "config": ds_config(stage, fp16=fp16, **extra)})  # fmt: skip
            if engine == "deepspeed":
                out.append({"name": f"fp16bn_nokey_s{stage}", "kind": "call", "target": f"{MODULE}:fp16_bn",
                            "engine": engine, "config": ds_config(stage, fp16=fp16)})  # fmt: skip
        for dtype, stage in (("fp16", 0), ("fp16", 2), ("bf16", 0)):
            if dtype == "fp16" and not ds_fp16:
                continue  # compared with DeepSpeed's recorded behaviour (see the test)
            out.append({"name": f"overflow_{dtype}_s{stage}_{engine}", "kind": "call", "engine": engine,
                        "target": f"{MODULE}:overflow_flag",
                        "config": ds_config(stage, **{dtype: {"enabled": True, **(
                            {"initial_scale_power": 10} if dtype == "fp16" else {})}})})  # fmt: skip
        for stage in (0, 2, 3):
            out.append({"name": f"frozen_s{stage}_{engine}", "kind": "call", "target": f"{MODULE}:frozen",
                        "engine": engine, "config": ds_config(stage, gradient_accumulation_steps=2),
                        "dir": f"{tmp}/frozen_s{stage}_{engine}"})
        out.append({"name": f"moe_s3_{engine}", "kind": "call", "target": f"{MODULE}:moe", "engine": engine,
                    "config": ds_config(3)})
        if importlib.util.find_spec("transformers"):
            out.append({"name": f"mixtral_s3_{engine}", "kind": "call", "target": f"{MODULE}:mixtral",
                        "engine": engine, "config": ds_config(3)})
        for stage, dtype in ((3, "fp32"), (3, "bf16"), (2, "bf16")):
            extra = {"bf16": {"enabled": True}} if dtype == "bf16" else {}
            zero = {"stage": stage, "gather_16bit_weights_on_model_save": dtype == "bf16",
                    "offload_optimizer": {"device": "cpu"} if stage == 2 else {"device": "none"}}  # fmt: skip
            out.append({"name": f"save16_{dtype}_s{stage}_{engine}", "kind": "call", "target": f"{MODULE}:save16",
                        "engine": engine, "config": ds_config(stage, zero_optimization=zero, **extra)})  # fmt: skip
        for stage in (0, 1, 2, 3):
            out.append({"name": f"fp32param_s{stage}_{engine}", "kind": "call", "target": f"{MODULE}:fp32_param",
                        "engine": engine, "config": ds_config(stage, bf16={"enabled": True})})  # fmt: skip
        for stage in (0, 1, 2):
            out.append({"name": f"raw_s{stage}_{engine}", "kind": "call", "target": f"{MODULE}:raw", "engine": engine,
                        "config": ds_config(stage, gradient_accumulation_steps=2)})  # fmt: skip
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The directory the scenarios save their checkpoints under."""
    return tmp_path_factory.mktemp("dropin")


@pytest.fixture(scope="module")
def records(saved):
    return h.run(_scenarios(str(saved)))


def _both(records, name: str) -> tuple[list[dict], list[dict]]:
    return h.both(records, name, ENGINES)


@pytest.mark.parametrize("stage", [2, 3])
def test_tied_weights_train_save_load_like_deepspeed(records, stage):
    torsh_ranks, ds_ranks = _both(records, f"tied_s{stage}")
    for t, d in zip(torsh_ranks, ds_ranks):
        assert t["losses"] + t["after"] == pytest.approx(d["losses"] + d["after"], rel=FP32)
        assert t["resumed"] == pytest.approx(t["after"], rel=FP32)
        assert t["tied"] is True and t["params"] == d["params"] == 7  # embed (= head), 2 linears and the norm (w, b)


@pytest.mark.parametrize("case", ["4", "2", "2late"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_unused_parameters_need_no_flag(records, stage, case):
    """``2late``: every parameter is used in the first steps (DDP keeps its fast path), one is not from step 3 on."""
    torsh_ranks, ds_ranks = _both(records, f"unused{case}_s{stage}")
    if stage == 3 and case == "2late":
        # DeepSpeed's ZeRO-3 differs from its own stages 0-2 here (4th loss 3.4793 vs 3.4786): the reference is
        # its stage 2, which torsh's stage 3 matches like its stages 0-2 do
        _, ds_ranks = _both(records, f"unused{case}_s2")
    for t, d in zip(torsh_ranks, ds_ranks):
        assert t["losses"] == pytest.approx(d["losses"], rel=FP32)
        if stage < 3:  # (DeepSpeed's stage-3 weights are partitioned: not compared)
            # weight decay and Adam's moments move the unused pooler as in DeepSpeed (a zero gradient)
            assert t["weights"] == pytest.approx(d["weights"], rel=FP32)
    assert torsh_ranks[0]["weights"] == torsh_ranks[1]["weights"]


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_raw_model_calls_get_averaged_gradients(records, stage):
    torsh_ranks, ds_ranks = _both(records, f"raw_s{stage}")
    for t, d in zip(torsh_ranks, ds_ranks):
        assert t["losses"] == pytest.approx(d["losses"], rel=FP32)
        if stage < 2:  # (DeepSpeed's stage-2 partitioned weights are not compared)
            assert t["weights"] == pytest.approx(d["weights"], rel=FP32)
    assert torsh_ranks[0]["weights"] == torsh_ranks[1]["weights"]  # the ranks did not diverge


@pytest.mark.parametrize("stage", [0, 2])
def test_fp16_with_batchnorm(records, stage):
    torsh_ranks, ds_ranks = _both(records, f"fp16bn_s{stage}")
    for t, d in zip(torsh_ranks, ds_ranks):
        # the same fp16 forward from the same weights; later steps differ by fp16 rounding of the updates
        # (the engines' fp16 paths are not bit-equal, also without BatchNorm), so they are only checked to train.
        # Without DeepSpeed fp16 on this CPU, its fp32 run is the reference: fp16 rounding apart (measured 3e-4).
        rel = 1e-6 if capabilities.deepspeed_fp16() else 5e-3
        assert t["losses"][0] == pytest.approx(d["losses"][0], rel=rel)
        assert all(math.isfinite(v) for v in t["losses"]) and t["losses"][1:] != t["losses"][:1] * 3
        assert math.isfinite(t["running_mean"]) and t["running_mean"] != 0.0
        assert t["stats"] == {"1.running_mean": "torch.float16", "1.running_var": "torch.float16",
                              "1.num_batches_tracked": "torch.int64"}  # fmt: skip
    # DeepSpeed 0.19.8 without data_types.buffer_dtype: the fp32 running statistics fail the fp16 BatchNorm
    if capabilities.deepspeed_fp16():
        assert "expected scalar type Half but found Float" in records[0][f"fp16bn_nokey_s{stage}"]["error"]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_zero3_consolidated_state_dict_like_deepspeed(records, dtype):
    """Rank 0 gets every key in the compute dtype on the CPU, a tied weight once under both keys, with DeepSpeed's
    values (bf16 training is not bit-equal between the engines, so its trained values are not compared); rank 1
    gets None."""
    torsh_ranks, ds_ranks = _both(records, f"save16_{dtype}_s3")
    for t, d in zip(torsh_ranks, ds_ranks):
        assert t["flags"] == d["flags"] == [True, True, dtype == "bf16", False]
    assert torsh_ranks[1]["before"] is torsh_ranks[1]["after"] is ds_ranks[1]["after"] is None
    t, d = torsh_ranks[0], ds_ranks[0]
    assert t["before"] == d["before"]  # the initial weights, cast: equal to the last bit
    assert t["after"]["tied"] is d["after"]["tied"] is True
    assert t["after"]["state"].keys() == d["after"]["state"].keys()
    for key, (dtype_name, device, shape, total) in d["after"]["state"].items():
        assert t["after"]["state"][key][:3] == [dtype_name, device, shape], key
        if dtype == "fp32":
            assert t["after"]["state"][key][3] == pytest.approx(total, rel=FP32, abs=1e-6), key
    assert t["after"]["state"]["embed.weight"] != t["before"]["state"]["embed.weight"]  # the trained weights


def test_zero3_consolidated_state_dict_refused_below_stage_3(records):
    torsh_ranks, ds_ranks = _both(records, "save16_bf16_s2")
    for t, d in zip(torsh_ranks, ds_ranks):
        assert t["flags"] == d["flags"] == [True, False, True, True]
        assert t["refused"] == d["refused"] == "this function requires ZeRO-3 mode"


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_to_fp32_gives_deepspeeds_weights_from_either_checkpoint(records, saved, stage):
    """torsh's ``deepspeed.utils.zero_to_fp32`` on DeepSpeed's checkpoint gives DeepSpeed's own function's tensors,
    bit for bit; on torsh's checkpoint of the same training, the same weights (fp32 parity)."""
    import torch
    from deepspeed.utils import zero_to_fp32 as real

    from torsh.compat.deepspeed.utils import zero_to_fp32 as ours

    _both(records, f"tied_s{stage}")  # the runs that wrote the checkpoints succeeded
    torsh_dir, ds_dir = (saved / f"tied_s{stage}_{engine}" for engine in ENGINES)
    reference = real.get_fp32_state_dict_from_zero_checkpoint(str(ds_dir))
    from_ds = ours.get_fp32_state_dict_from_zero_checkpoint(str(ds_dir))
    from_torsh = ours.get_fp32_state_dict_from_zero_checkpoint(torsh_dir, tag="t", lazy_mode=True)
    assert list(from_ds) == list(reference) and sorted(from_torsh) == sorted(reference)
    for key, tensor in reference.items():
        assert from_ds[key].dtype == tensor.dtype == torch.float32 and torch.equal(from_ds[key], tensor), key
        assert from_torsh[key].dtype == torch.float32, key
        torch.testing.assert_close(from_torsh[key].contiguous(), tensor, rtol=FP32, atol=1e-6)
    # the helpers on top: load into a model (moved to the CPU), and write the file DeepSpeed writes
    model = ours.load_state_dict_from_zero_checkpoint(tied_model(7), torsh_dir)
    assert all(torch.equal(model.state_dict()[k], from_torsh[k]) for k in from_torsh)
    ours.convert_zero_checkpoint_to_fp32_state_dict(torsh_dir, saved / f"out_s{stage}_torsh")
    real.convert_zero_checkpoint_to_fp32_state_dict(str(ds_dir), str(saved / f"out_s{stage}_deepspeed"))
    names = [sorted(p.name for p in (saved / f"out_s{stage}_{engine}").iterdir()) for engine in ENGINES]
    assert names[0] == names[1] == ["pytorch_model.bin"]
    written = torch.load(saved / f"out_s{stage}_torsh" / "pytorch_model.bin", weights_only=True)
    assert all(torch.equal(written[k], from_torsh[k]) for k in reference) and written.keys() == reference.keys()
    # shards with Hugging Face's index; safetensors with the tied weight, shared in DeepSpeed's checkpoint (its own
    # function raises on the shared memory)
    assert from_ds["head.weight"] is from_ds["embed.weight"]
    ours.convert_zero_checkpoint_to_fp32_state_dict(torsh_dir, saved / f"sharded_s{stage}", max_shard_size="2KB")
    index = json.loads((saved / f"sharded_s{stage}" / "pytorch_model.bin.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(reference) and len(set(index["weight_map"].values())) > 1
    ours.convert_zero_checkpoint_to_fp32_state_dict(ds_dir, saved / f"safe_s{stage}", safe_serialization=True)
    from safetensors.torch import load_file

    assert sorted(load_file(saved / f"safe_s{stage}" / "model.safetensors")) == sorted(reference)
    with pytest.raises(ValueError, match="exclude_frozen_parameters.*does not record which parameters were frozen"):
        ours.get_fp32_state_dict_from_zero_checkpoint(torsh_dir, exclude_frozen_parameters=True)
    assert len(ours.get_fp32_state_dict_from_zero_checkpoint(ds_dir, exclude_frozen_parameters=True)) == 8


def test_zero_to_fp32_errors_are_deepspeeds(tmp_path):
    from deepspeed.utils import zero_to_fp32 as real

    from torsh.compat.deepspeed.utils import zero_to_fp32 as ours

    errors = []
    for module in (real, ours):
        for tag in (None, "nope"):
            with pytest.raises((ValueError, FileNotFoundError)) as info:
                module.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path), tag=tag)
            errors.append((type(info.value), str(info.value)))
    assert errors[:2] == errors[2:]
    assert errors[0][0] is ValueError and errors[1][0] is FileNotFoundError


def test_moe_leaf_module_trains_like_deepspeed(records):
    """Each rank runs other experts; with the block a leaf, its parameters are gathered together (no per-expert
    unit waits on a rank that never calls it), and the losses are DeepSpeed's."""
    torsh_ranks, ds_ranks = _both(records, "moe_s3")
    for t, d in zip(torsh_ranks, ds_ranks):
        assert t["losses"] == pytest.approx(d["losses"], rel=FP32)
        assert t["leaves"] == d["leaves"] == ["Experts"] and t["leaf"] is d["leaf"] is True and t["found"] == 1
    assert torsh_ranks[0]["ran"] != torsh_ranks[1]["ran"]  # the ranks routed to different experts
    assert any(len(r) < 4 for r in torsh_ranks[0]["ran"] + torsh_ranks[1]["ran"])  # and some expert did not run


def test_units_never_split_a_leaf_module():
    """Without the flag the experts are the model's largest repeated blocks and become units (per-expert gathers);
    with it the block is whole, under every unit policy."""
    from torsh.compat.deepspeed.utils import set_z3_leaf_modules, unset_z3_leaf_modules
    from torsh.config import TorshConfig
    from torsh.engine.zero.units import plan_units
    from torsh.sharding_plan import sharding_plan

    model = moe_model(0)
    sharding = sharding_plan(TorshConfig.from_dict({"sharding": {"stage": 3}}))
    assert [u.modules for u in plan_units(model, sharding, policy="per_layer").units][:2] == [
        ("moe.experts.0",), ("moe.experts.1",)]
    set_z3_leaf_modules(model, ["Experts"])
    for policy in ("buckets", "per_layer", "children"):
        units = [name for u in plan_units(model, sharding, policy=policy).units for name in u.modules]
        assert not any(name.startswith("moe.") for name in units), (policy, units)
    wrap = {"module_classes": ["Sequential"]}
    wrapped = sharding_plan(TorshConfig.from_dict({"sharding": {"stage": 3, "wrap": wrap}}))
    assert [u.modules for u in plan_units(model, wrapped, policy="wrap").units] == [("moe",)]
    unset_z3_leaf_modules(model, ["Experts"])
    set_z3_leaf_modules(model, ["ModuleList"])  # the experts' container itself a leaf: its experts are not units
    units = [name for u in plan_units(model, sharding, policy="per_layer").units for name in u.modules]
    assert not any(name.startswith("moe.experts.") for name in units), units
    set_z3_leaf_modules(model, ["Experts"])
    with pytest.raises(ValueError, match="No modules of type"):
        set_z3_leaf_modules(model, ["NoSuchBlock"])
    assert unset_z3_leaf_modules(model, ["Experts"]) == [model.moe]


def test_mixtral_moe_blocks_are_leaves_by_default_like_deepspeed(records):
    """DeepSpeed flags the Mixtral and Qwen MoE blocks as leaf modules without being asked (its leaf_module
    defaults); so does torsh, and a Hugging Face Mixtral trains at ZeRO-3 with DeepSpeed's losses."""
    pytest.importorskip("transformers", reason="transformers is installed by requirements-dev.txt in CI")
    torsh_ranks, ds_ranks = _both(records, "mixtral_s3")
    for t, d in zip(torsh_ranks, ds_ranks):
        assert t["leaves"] == d["leaves"] == ["MixtralSparseMoeBlock"] * 2
        assert t["losses"] == pytest.approx(d["losses"], rel=FP32)


def test_leaf_module_config_names_modules():
    """zero_optimization.leaf_module as DeepSpeed reads it: classes (default: the Mixtral/Qwen MoE blocks),
    names and name suffixes."""
    from torsh import adapters
    from torsh.engine.zero import leaves

    def leaf_modules(section: dict):
        raw = {"train_batch_size": 2, "zero_optimization": {"stage": 3, **section}}
        return adapters.load(raw).result.sharding.leaf_modules

    model = moe_model(0)
    assert leaves.apply_config(model, leaf_modules({})) == []  # no default class in this model
    assert leaves.apply_config(model, leaf_modules({"leaf_module": {"classes": [], "name_suffixes": ["moe"]}})) \
        == [model.moe]  # fmt: skip
    model = moe_model(0)
    assert leaves.apply_config(model, leaf_modules({"leaf_module": {"names": ["moe.experts.1"]}})) == \
        [model.moe.experts[1]]  # fmt: skip


#: ``overflow_flag`` under DeepSpeed 0.19.8 in fp16 (initial scale 2**10): stage 0's FP16_Optimizer has only
#: ``loss_scale`` and halves it at the overflow; stage 2's ZeRO optimizer has both and its hysteresis of 2 keeps it.
OVERFLOW_FP16 = {"fp16_s0": {"flags": [False, True, False], "scales": [[None, 1024.0], [None, 512.0], [None, 512.0]]},
                 "fp16_s2": {"flags": [False, True, False], "scales": [[1024.0, 1024.0]] * 3}}  # fmt: skip


@pytest.mark.parametrize("case", ["fp16_s0", "fp16_s2", "bf16_s0"])
def test_optimizer_overflow_flag_like_deepspeed(records, case):
    if case.startswith("fp16") and not capabilities.deepspeed_fp16():
        # DeepSpeed 0.19.8's values, recorded on a CPU where it has fp16
        torsh_ranks, ds_ranks = [records[r][f"overflow_{case}_torsh"] for r in (0, 1)], [OVERFLOW_FP16[case]] * 2
    else:
        torsh_ranks, ds_ranks = _both(records, f"overflow_{case}")
    for t, d in zip(torsh_ranks, ds_ranks):
        assert "error" not in t, t.get("traceback")
        assert t["flags"] == d["flags"] == [False, True, False]
        # the optimizer's cur_scale / loss_scale where DeepSpeed's optimizer has them (None: it has not)
        assert t["scales"] == d["scales"], (t["scales"], d["scales"])
    if case == "fp16_s0":  # the scale halves at the overflow (stage 2's hysteresis of 2 keeps it)
        assert [s[1] for s in torsh_ranks[0]["scales"]] == [1024.0, 512.0, 512.0]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_safe_get_full_fp32_param_is_the_fp32_master_like_deepspeed(records, stage):
    """bf16 training: the function returns the fp32 master weights (values beyond bf16's precision), as DeepSpeed's;
    safe_get_full_grad gives their fp32 gradient; safe_set_full_fp32_param writes them (read back the same on both,
    and the next steps' losses agree)."""
    torsh_ranks, ds_ranks = _both(records, f"fp32param_s{stage}")
    for t, d in zip(torsh_ranks, ds_ranks):
        assert t["none"] == [] and t["dtypes"] == ["torch.float32"] and t["fp32_bits"] and t["set"] == [0.5]
        assert t["grad"][0] == "torch.float32"  # safe_get_full_grad: the gradient of the fp32 weights
        assert all(loss == loss for loss in t["after_set"])  # training goes on from the written weights
        if stage == 0:  # DeepSpeed 0.19.8's bf16 stage 0 keeps no mapping to its masters: None for every parameter
            assert d["none"] == sorted(t["sums"]) and not d["sums"] and d["set"] is None
            continue
        assert d["none"] == [] and d["dtypes"] == ["torch.float32"] and d["fp32_bits"] and d["set"] == [0.5]
        assert t["grad"][0] == d["grad"][0] and abs(t["grad"][1] - d["grad"][1]) <= 1e-3 * d["grad"][2]
        # the step after the write still computes with the old weights, then updates from the written ones
        assert t["after_set"] == pytest.approx(d["after_set"], rel=4e-3)
        assert t["sums"].keys() == d["sums"].keys()
        for name, (total, size) in d["sums"].items():
            assert abs(t["sums"][name][0] - total) <= 4e-3 * size, name  # bf16 steps: measured up to 9.2e-4


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_frozen_parameters_lora_style_like_deepspeed(records, saved, stage):
    """Only the trainable parameters passed to initialize, gradient accumulation 2: DeepSpeed's losses, the frozen
    weights stay as they were, and a checkpoint that leaves them out resumes exactly."""
    torsh_ranks, ds_ranks = _both(records, f"frozen_s{stage}")
    for t, d in zip(torsh_ranks, ds_ranks):
        assert t["losses"] + t["after"] == pytest.approx(d["losses"] + d["after"], rel=FP32)
        assert t["frozen"] == d["frozen"] and len(t["frozen"]) == 5
        assert t["resumed"] == pytest.approx(t["after"], rel=FP32)  # the checkpoint without the base model resumes
        assert d["resumed"] == pytest.approx(d["after"], rel=FP32)
        assert "embed.weight" in d["strict"] and "load with load_module_strict=False" not in d["strict"]
        assert "Missing key in checkpoint state_dict: model.embed.weight" in t["strict"]
        assert "load it with load_module_strict=False" in t["strict"]  # and torsh says what to do
    # torsh's checkpoint holds the trainable parameters only, as DeepSpeed's
    from torsh.engine.checkpoint.merge import merged_weights

    weights, _, _ = merged_weights(saved / f"frozen_s{stage}_torsh" / "f")
    assert sorted(weights) == ["blocks.0.down.bias", "blocks.0.down.weight", "blocks.1.down.bias",
                               "blocks.1.down.weight", "gain", "head.bias", "head.weight", "norm.bias", "norm.weight"]
