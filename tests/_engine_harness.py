"""Multi-process harness for engine tests: one 2-rank gloo launch runs a list of scenarios.

Each scenario is a DeepSpeed-style training loop (``engine(x)``, ``engine.backward(loss)``, ``engine.step()``
every micro-batch) on a tiny language model with deterministic per-rank data; the per-rank records
(losses, grad norms, lrs, counters) come back as JSON for the test to compare.
"""

from __future__ import annotations

import gc
import json
import os
import socket
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

VOCAB, HIDDEN, SEQ = 32, 16, 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(scenarios: list[dict], world_size: int = 2) -> list[dict[str, dict]]:
    """Run ``scenarios`` on ``world_size`` gloo ranks; returns, per rank, ``{scenario name: record}``."""
    with tempfile.TemporaryDirectory() as out:
        spawn(scenarios, world_size, out)
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world_size)]


def spawn(scenarios: list[dict], world_size: int, out: str, runner: Any = None) -> None:
    """Start ``world_size`` gloo ranks that run each scenario with ``runner(rank, world_size, scenario)`` (a
    module-level function; None: the harness's own scenario of the scenario's ``kind``) and write
    ``out/rankR.json``; a scenario that raises is recorded as its error, and the ranks go on with the next."""
    start(_worker, (world_size, free_port(), scenarios, out, runner), world_size)


def start(fn: Any, args: tuple, nprocs: int, join: bool = True, timeout: float = 900) -> Any:
    """``torch.multiprocessing.spawn(fn, args, nprocs, join)``, with the ranks forked from this process: torch,
    TorchDynamo (every optimizer and DDP import it) and the engine are imported once here instead of again in
    every rank (~4 CPU seconds a rank). A process that holds a process group of its own (its ranks would inherit
    it) spawns fresh interpreters instead. With ``join``, ranks still running after ``timeout`` seconds are killed
    and the test fails (a hung rank must not hang the suite)."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    fork = not (dist.is_available() and dist.is_initialized())
    if fork:
        import torch._dynamo  # noqa: F401

        import torsh.engine.initialize  # noqa: F401

        # objects of earlier tests' process groups left in reference cycles are finalized here, where their
        # threads exist: a forked rank that collected them would wait forever for threads fork did not copy
        gc.collect()
    context = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="fork" if fork else "spawn")
    if not join:
        return context
    deadline = time.monotonic() + timeout
    while not context.join(timeout=1):  # raises what a rank raised
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"{getattr(fn, '__name__', fn)}: ranks still running after {timeout:.0f} s, killed")
    return context


def build_model(seed: int = 0):
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(HIDDEN, 2 * HIDDEN)
            self.down = nn.Linear(2 * HIDDEN, HIDDEN)
            self.calls = 0  # forward executions, recomputation included (activation checkpointing)

        def forward(self, x):
            self.calls += 1
            return x + self.down(torch.nn.functional.gelu(self.up(x)))

    class TinyLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, HIDDEN)
            self.blocks = nn.Sequential(Block(), Block())
            self.norm = nn.LayerNorm(HIDDEN)
            self.head = nn.Linear(HIDDEN, VOCAB)
            self.register_buffer("gain", torch.ones(HIDDEN))  # a buffer, like RoPE's inv_freq: kept in fp32

        def forward(self, tokens):
            x = self.embed(tokens)
            return self.head(self.norm(self.blocks(x * self.gain.to(x.dtype))))

    torch.manual_seed(seed)
    return TinyLM()


def batch(step: int, rank: int, micro_batch: int):
    """Deterministic tokens for (micro-step, rank): any process can rebuild any rank's batch."""
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, VOCAB, (micro_batch, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _number(value):
    """A tensor the engine returns (``get_global_grad_norm()``), as a JSON number (None stays None)."""
    return None if value is None else float(value)


def lm_loss(logits, targets):
    import torch

    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def backend(name: str):
    """The module a side-by-side scenario runs on: real DeepSpeed (its CPU accelerator) or torsh."""
    if name == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed

        return deepspeed
    import torsh

    return torsh


def ds_config(stage: int, **extra) -> dict:
    """A DeepSpeed JSON for the side-by-side scenarios: micro batch 2, AdamW (torch's), ZeRO ``stage``."""
    return {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0, "torch_adam": True}},
            **extra}  # fmt: skip


def ranks_of(records: list[dict], name: str) -> list[dict]:
    """Every rank's record of scenario ``name``, failing with the rank's traceback where it raised."""
    ranks = [r[name] for r in records]
    for r in ranks:
        assert "error" not in r, r.get("traceback")
    return ranks


def both(records: list[dict], name: str, engines: tuple[str, str] = ("torsh", "deepspeed")) -> tuple[list, list]:
    """(torsh, deepspeed) records of scenario ``name`` (``{name}_{engine}``) on every rank; a worker error fails
    with its traceback."""
    out = []
    for engine in engines:
        ranks = [r[f"{name}_{engine}"] for r in records]
        for r in ranks:
            assert "error" not in r, f"{engine}: {r.get('traceback')}"
        out.append(ranks)
    return out[0], out[1]


def base_config(**overrides: Any) -> dict:
    """A native torsh config dict for the scenarios (micro batch 2, AdamW, no clipping)."""
    cfg: dict[str, Any] = {
        "batch": {"micro_batch_size": 2, "gradient_accumulation_steps": 1},
        "optimizer": {"name": "AdamW", "lr": 1e-2, "weight_decay": 0.0},
    }
    for path, value in overrides.items():
        node = cfg
        parts = path.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return cfg


def _worker(rank: int, world_size: int, port: int, scenarios: list[dict], out: str, runner: Any = None) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_PORT=str(port))  # fmt: skip
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    results: dict[str, dict] = {}
    try:
        for scenario in scenarios:
            try:
                run_one = runner or SCENARIOS[scenario.get("kind", "loop")]
                results[scenario["name"]] = run_one(rank, world_size, scenario)
            except Exception as exc:  # reported per scenario so one failure does not hide the others
                results[scenario["name"]] = {"error": f"{type(exc).__name__}: {exc}",
                                             "traceback": traceback.format_exc()}  # fmt: skip
            dist.barrier()
    finally:
        Path(out, f"rank{rank}.json").write_text(json.dumps(results))
        dist.destroy_process_group()


def loop(rank: int, world_size: int, scenario: dict) -> dict:
    """The unchanged DeepSpeed loop; records loss per micro-step and per-boundary metrics."""
    import torch

    import torsh as deepspeed

    model = build_model(scenario.get("seed", 0))
    optimizer = None
    if scenario.get("client_optimizer"):
        optimizer = torch.optim.AdamW(model.parameters(), **scenario["client_optimizer"])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine, opt, _, sched = deepspeed.initialize(model=model, optimizer=optimizer,
                                                 model_parameters=model.parameters(), config=scenario["config"])
    mbs = engine.train_micro_batch_size_per_gpu()
    rec: dict[str, Any] = {"losses": [], "norms": [], "lrs": [], "boundaries": [], "returned": [],
                           "optimizer": type(opt).__name__, "scheduler": type(sched).__name__}  # fmt: skip
    for step in range(scenario.get("micro_steps", 4)):
        x, y = batch(step, rank, mbs)
        loss = lm_loss(engine(x), y)
        rec["boundaries"].append(engine.is_gradient_accumulation_boundary())
        rec["returned"].append(float(engine.backward(loss)))
        engine.step()
        rec["losses"].append(loss.item())
        if rec["boundaries"][-1]:
            rec["norms"].append(_number(engine.get_global_grad_norm()))
            rec["lrs"].append(engine.get_lr()[0])
    rec.update(global_steps=engine.global_steps, global_samples=engine.global_samples, micro_steps=engine.micro_steps,
               skipped_steps=engine.skipped_steps, applied=engine.was_step_applied(),
               stage=engine.zero_optimization_stage(), bf16=engine.bfloat16_enabled(), fp16=engine.fp16_enabled(),
               gas=engine.gradient_accumulation_steps(), train_batch_size=engine.train_batch_size(),
               world_size=engine.world_size, global_rank=engine.global_rank, local_rank=engine.local_rank,
               device=str(engine.device), train_returns=engine.train(), eval_returns=engine.eval())  # fmt: skip
    rec["eval_mode"] = not engine.module.training and not engine.training
    if scenario.get("save_16bit"):
        assert engine.save_16bit_model(scenario["save_16bit"]) is True
        saved = torch.load(os.path.join(scenario["save_16bit"], "pytorch_model.bin"), weights_only=True)
        rec["saved_16bit"] = {k: [list(v.shape), str(v.dtype)] for k, v in saved.items()}
        rec["expected_16bit"] = {k: [list(v.shape), str(v.dtype)] for k, v in build_model().state_dict().items()}
    loader = engine.deepspeed_io(torch.utils.data.TensorDataset(torch.arange(10)))
    rec["io"] = [len(loader), type(loader.sampler).__name__]
    rec["block_calls"] = sum(b.calls for b in engine.module.blocks)
    prefetching = [m._get_fsdp_state()._states_to_forward_prefetch for m in engine.module.modules()
                   if hasattr(m, "_get_fsdp_state")]  # fmt: skip
    rec["forward_prefetch"] = [[type(s._modules[0]).__name__.removeprefix("FSDP") for s in states]
                               for states in prefetching if states]  # fmt: skip
    full = _full_params(engine)
    rec["changed"] = max(float((full[n].float() - before[n].float()).abs().max()) for n in before)
    rec["param_dtypes"] = sorted({str(p.dtype) for p in engine.module.parameters()})
    rec["buffer_dtypes"] = sorted({str(b.dtype) for b in engine.module.buffers()})
    inner = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer keeps the local optimizer in .optim
    rec["state_dtypes"] = sorted({str(v.dtype) for st in inner.state.values() for k, v in st.items()
                                  if torch.is_tensor(v) and k != "step"})  # fmt: skip
    rec["loss_scale"] = engine.loss_scale()
    return rec


def train(engine, rank: int, start: int, steps: int, micro: int | None = None) -> list[float]:
    """``steps`` DeepSpeed-style steps from step ``start`` on this rank's batches (micro batch ``micro``, or the
    engine's); the losses."""
    micro = micro or engine.train_micro_batch_size_per_gpu()
    losses = []
    for step in range(start, start + steps):
        x, y = batch(step, rank, micro)
        loss = lm_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _full_params(engine) -> dict:
    out = {}
    for n, p in engine.module.named_parameters():
        out[n] = p.full_tensor().detach() if hasattr(p, "full_tensor") else p.detach()
    return out


def first_norm(rank: int, world_size: int, scenario: dict) -> dict:
    """The engine's first global grad norm, and the norm of the same gradient computed without any sharding."""
    import torch

    import torsh

    model = build_model(0)
    reference = build_model(0)
    engine, *_ = torsh.initialize(model=model, config=scenario["config"])
    mbs = engine.train_micro_batch_size_per_gpu()
    x, y = batch(0, rank, mbs)
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    # unsharded: the mean of every rank's loss on one full model
    total = sum(lm_loss(reference(batch(0, r, mbs)[0]), batch(0, r, mbs)[1]) for r in range(world_size)) / world_size
    total.backward()
    ref = torch.sqrt(sum(p.grad.pow(2).sum() for p in reference.parameters()))
    return {"engine": _number(engine.get_global_grad_norm()), "reference": float(ref)}


def dataloader(rank: int, world_size: int, scenario: dict) -> dict:
    """``training_data`` becomes a DataLoader of the micro batch over a DistributedSampler."""
    import torch

    import torsh

    data = torch.utils.data.TensorDataset(torch.arange(21).float().unsqueeze(1))
    engine, _, loader, _ = torsh.initialize(model=build_model(0), training_data=data, config=scenario["config"])
    firsts = [[float(v) for v in b[0].flatten()] for b in loader]
    return {"len": len(loader), "batches": firsts, "sampler": type(loader.sampler).__name__,
            "again": [[float(v) for v in b[0].flatten()] for b in loader]}  # fmt: skip


def accelerate_order(rank: int, world_size: int, scenario: dict) -> dict:
    """Accelerate's calling order: the boundary is set after forward, before backward; step only on sync."""
    import torsh

    model = build_model(0)
    engine, *_ = torsh.initialize(model=model, config=scenario["config"])
    gas = scenario["gas"]
    losses = []
    for step in range(2 * gas):
        x, y = batch(step, rank, engine.train_micro_batch_size_per_gpu())
        loss = lm_loss(engine(x), y)
        sync = (step + 1) % gas == 0
        engine.set_gradient_accumulation_boundary(sync)
        engine.backward(loss)
        if sync:
            engine.step()
        losses.append(float(loss))
    return {"losses": losses, "global_steps": engine.global_steps, "norm": _number(engine.get_global_grad_norm())}


SCENARIOS = {"loop": loop, "first_norm": first_norm, "dataloader": dataloader, "accelerate": accelerate_order}


def api(rank: int, world_size: int, scenario: dict) -> dict:
    """initialize()'s return rules and argument handling, one check per key."""
    import argparse
    import base64

    import torch

    import torsh
    from torsh.errors import ConfigError

    out: dict[str, Any] = {}
    cfg0 = {"batch": {"micro_batch_size": 2}}

    engine, opt, loader, sched = torsh.initialize(model=build_model(), config=cfg0)
    out["no_optimizer"] = [opt is None, loader is None, sched is None]
    out["fallthrough"] = type(engine.embed).__name__  # DeepSpeedEngine.__getattr__ -> module
    try:
        torsh.initialize(model=build_model(), config={**cfg0, "sharding": {"stage": 1}})
        out["stage1_without_optimizer"] = "no error"
    except ConfigError as exc:
        out["stage1_without_optimizer"] = str(exc)
    _, opt, _, _ = torsh.initialize(model=build_model(), config={**cfg0, "sharding": {"stage": 3}})
    out["stage3_without_optimizer"] = opt is None

    # a scheduler built on the script's optimizer follows the rebuilt one
    model = build_model()
    client = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    client_sched = torch.optim.lr_scheduler.StepLR(client, step_size=1, gamma=0.5)
    engine, opt, _, sched = torsh.initialize(model=model, optimizer=client, lr_scheduler=client_sched,
                                             config={**cfg0, "sharding": {"stage": 3}})  # fmt: skip
    x, y = batch(0, rank, 2)
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    out["rebuilt"] = [opt is not client, sched is client_sched, sched.optimizer is opt, opt.param_groups[0]["lr"],
                      opt.defaults["momentum"], all(p.grad is None for p in client.param_groups[0]["params"])]

    # callables: optimizer(params) and scheduler(optimizer), param groups from model_parameters
    model = build_model()
    groups = [{"params": list(model.head.parameters()), "lr": 0.5}, {"params": list(model.embed.parameters())}]
    engine, opt, _, sched = torsh.initialize(
        model=model, model_parameters=groups, optimizer=lambda p: torch.optim.Adam(p, lr=0.01),
        lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0), config=cfg0)  # fmt: skip
    out["callables"] = [type(opt).__name__, [g["lr"] for g in opt.param_groups],
                        sum(len(g["params"]) for g in opt.param_groups), type(sched).__name__]  # fmt: skip

    # args: --deepspeed_config and args.local_rank (overwritten with the launcher's LOCAL_RANK)
    parser = torsh.add_config_arguments(argparse.ArgumentParser())
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", scenario["config_path"], "--local_rank", "0"])
    model = build_model()
    engine, opt, _, _ = torsh.initialize(args=args, model=model, model_parameters=model.parameters())
    out["args"] = [args.local_rank, engine.train_micro_batch_size_per_gpu(), type(opt).__name__]
    # engine.config is the config as a dict, as DeepSpeed's: a file's content, a dict itself, base64 text decoded
    from pathlib import Path

    written = json.loads(Path(scenario["config_path"]).read_text())
    encoded = base64.urlsafe_b64encode(json.dumps(cfg0).encode()).decode()
    by_b64, *_ = torsh.initialize(model=build_model(), config=encoded)
    by_dict, *_ = torsh.initialize(model=build_model(), config=cfg0)
    out["config_attribute"] = [engine.config == written, by_dict.config is cfg0, by_b64.config == cfg0,
                               by_b64.train_micro_batch_size_per_gpu()]  # fmt: skip
    try:
        torsh.initialize(args=args, model=build_model(), config=cfg0)
        out["both_configs"] = "no error"
    except ConfigError as exc:
        out["both_configs"] = str(exc)

    # batch ramp-up (Megatron-DeepSpeed) and freeing gathered parameters after an evaluation forward (DeepSpeed-Chat)
    from torch.distributed.tensor import DTensor

    engine, *_ = torsh.initialize(model=build_model(), config={**cfg0, "sharding": {"stage": 3, "reshard_after_forward":
                                  False}, "optimizer": {"name": "SGD", "lr": 0.1}})  # fmt: skip
    engine.set_train_batch_size(8)
    ramp = [engine.gradient_accumulation_steps(), engine.train_batch_size()]
    for step in range(4):
        x, y = batch(step, rank, 2)
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    ramp.append(engine.global_steps)
    try:
        engine.set_train_batch_size(7)
    except ValueError as exc:
        ramp.append(str(exc))
    engine.set_train_micro_batch_size(4)
    ramp += [engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps(), engine.train_batch_size()]
    out["batch_ramp"] = ramp
    with torch.no_grad():
        engine(batch(0, rank, 2)[0])
    gathered = [any(not isinstance(p, DTensor) for p in engine.module.parameters())]
    engine.empty_partition_cache()
    out["empty_partition_cache"] = gathered + [any(not isinstance(p, DTensor) for p in engine.module.parameters())]

    # engine.monitor.write_events (DeepSpeed-Chat and DeepSpeedExamples log their metrics through it)
    engine.monitor.write_events([("Train/Samples/loss", 1.5, 8)])  # nothing enabled: nothing written, no error
    out_dir = str(Path(scenario["config_path"]).parent / "csv")
    engine, *_ = torsh.initialize(model=build_model(), config={**cfg0, "monitoring": {"csv": {
        "enabled": True, "output_path": out_dir, "job_name": "job"}}})  # fmt: skip
    engine.monitor.write_events([("Train/Samples/loss", 1.5, 8), ("eval acc", 0.25, 8)])
    engine.monitor.write_events([("Train/Samples/loss", 1.25, 16)])
    out["monitor"] = [engine.monitor.enabled, sorted(os.listdir(os.path.join(out_dir, "job"))),
                      Path(out_dir, "job", "Train_Samples_loss.csv").read_text().splitlines()]  # fmt: skip

    # DeepSpeed JSON through the adapter, when it is installed
    from torsh import adapters

    if "deepspeed" in adapters.names():
        ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
              "bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}  # fmt: skip
        engine, opt, _, _ = torsh.initialize(model=build_model(), config=ds)
        out["deepspeed"] = [engine.zero_optimization_stage(), engine.bfloat16_enabled(), engine.gradient_clipping(),
                            type(opt).__name__, opt.defaults["weight_decay"], engine.train_batch_size()]  # fmt: skip
        # the Hugging Face "auto" convention, resolved from the dataloader and the optimizer passed in
        hf = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
              "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
              "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
              "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}}  # fmt: skip
        model = build_model()
        passed = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(8, 1)), batch_size=2)
        engine, opt, dl, _ = torsh.initialize(model=model, optimizer=passed, training_data=loader, config=hf)
        out["deepspeed_auto"] = [engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps(),
                                 engine.train_batch_size(), engine.gradient_clipping(), opt.defaults["lr"],
                                 opt.defaults["weight_decay"], dl is loader]  # fmt: skip
        fp16 = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
                "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
                "fp16": {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 100}}  # fmt: skip
        engine, *_ = torsh.initialize(model=build_model(), config=fp16)
        out["deepspeed_fp16"] = [engine.fp16_enabled(), engine.loss_scale(),
                                 engine.loss_scaler.semantics if hasattr(engine.loss_scaler, "semantics") else None,
                                 sorted({str(p.dtype) for p in engine.module.parameters()})]  # fmt: skip
    return out


SCENARIOS["api"] = api


def overflow(rank: int, world_size: int, scenario: dict) -> dict:
    """A non-finite loss at the micro-step(s) ``scenario['bad']``: the step is skipped (weights and scheduler
    untouched, skipped_steps and global_steps counted) and the loss scale reacts."""
    import torsh

    engine, opt, _, sched = torsh.initialize(model=build_model(), config=scenario["config"])
    rec: dict[str, Any] = {"applied": [], "lrs": [], "scales": [], "unchanged": [], "skipped": []}
    bad = scenario["bad"] if isinstance(scenario["bad"], list) else [scenario["bad"]]
    for step in range(scenario.get("steps", 4)):
        before = [p.detach().clone() for p in engine.module.parameters()]
        x, y = batch(step, rank, engine.train_micro_batch_size_per_gpu())
        loss = lm_loss(engine(x), y)
        if step in bad:
            loss = loss * float("inf")
        engine.backward(loss)
        engine.step()
        rec["applied"].append(engine.was_step_applied())
        rec["lrs"].append(engine.get_lr()[0])
        rec["scales"].append(engine.loss_scale())
        rec["skipped"].append(engine.skipped_steps)
        rec.setdefault("overflow", []).append(engine.optimizer.overflow)
        rec["unchanged"].append(all(bool((a == b.detach()).all()) for a, b in zip(before, engine.module.parameters())))
    rec["global_steps"] = engine.global_steps
    return rec


def checkpoint(rank: int, world_size: int, scenario: dict) -> dict:
    """Save after 2 steps, train 2 more; a fresh engine loading the checkpoint repeats those 2 losses."""
    import torsh

    def losses(engine, start):
        out = []
        for step in range(start, start + 2):
            x, y = batch(step, rank, engine.train_micro_batch_size_per_gpu())
            loss = lm_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            out.append(loss.item())
        return out

    engine, *_ = torsh.initialize(model=build_model(0), config=scenario["config"])
    losses(engine, 0)
    checksum = _checksum(engine)
    assert engine.save_checkpoint(scenario["dir"], client_state={"epoch": 3}) is True
    uninterrupted = losses(engine, 2)
    fresh, *_ = torsh.initialize(model=build_model(1), config=scenario["config"])  # other weights on purpose
    missing = fresh.load_checkpoint(scenario["dir"] + "/nowhere")
    path, client = fresh.load_checkpoint(scenario["dir"])
    resumed = losses(fresh, 2)
    return {"uninterrupted": uninterrupted, "resumed": resumed, "missing": list(missing), "path": str(path),
            "epoch": (client or {}).get("epoch"), "global_steps": fresh.global_steps, "checksum": checksum}  # fmt: skip


def _checksum(engine) -> float:
    return float(sum(p.double().sum() for p in _full_params(engine).values()))


def load_only(rank: int, world_size: int, scenario: dict) -> dict:
    """Load a checkpoint written at another world size (and stage); the weights and counters come back, and
    training continues from them."""
    import torsh

    engine, *_ = torsh.initialize(model=build_model(1), config=scenario["config"])
    path, client = engine.load_checkpoint(scenario["dir"], tag="global_step2")
    checksum = _checksum(engine)
    x, y = batch(0, rank, engine.train_micro_batch_size_per_gpu())
    engine.backward(lm_loss(engine(x), y))
    engine.step()  # the loaded optimizer state steps
    return {"path": str(path), "checksum": checksum, "global_steps": engine.global_steps,
            "epoch": (client or {}).get("epoch"), "applied": engine.was_step_applied()}


SCENARIOS["overflow"] = overflow
SCENARIOS["checkpoint"] = checkpoint


def nosync(rank: int, world_size: int, scenario: dict) -> dict:
    """The non-boundary micro-batches run inside ``engine.no_sync()``; ``step()`` inside it is refused."""
    import torsh

    engine, *_ = torsh.initialize(model=build_model(0), config=scenario["config"])
    losses, refused = [], None
    for step in range(8):
        x, y = batch(step, rank, engine.train_micro_batch_size_per_gpu())
        if engine.is_gradient_accumulation_boundary():
            loss = lm_loss(engine(x), y)
            engine.backward(loss)
        else:
            with engine.no_sync():
                loss = lm_loss(engine(x), y)
                engine.backward(loss)
                if refused is None:
                    try:
                        engine.step()
                        refused = False
                    except RuntimeError:
                        refused = True
        engine.step()
        losses.append(loss.item())
    return {"losses": losses, "refused": refused, "global_steps": engine.global_steps}


SCENARIOS["nosync"] = nosync

SCENARIOS["load_only"] = load_only


def synced(rank: int, world_size: int, scenario: dict) -> dict:
    """Every rank builds the model from its own seed (``head`` in float64: two dtypes to broadcast); after
    ``initialize`` each rank reports its full weights, and rank 0's model as built."""
    import torch

    import torsh
    from torsh.engine.zero import sharding

    sharding.SYNC_BUCKET_BYTES = scenario.get("bucket_bytes", sharding.SYNC_BUCKET_BYTES)
    model = build_model(seed=rank)
    model.head.to(torch.float64)
    engine, *_ = torsh.initialize(model=model, config=scenario["config"])
    reference = build_model(seed=0)
    return {"weights": {n: p.float().sum().item() for n, p in _full_params(engine).items()},
            "rank0_built": {n: p.float().sum().item() for n, p in reference.named_parameters()}}


SCENARIOS["synced"] = synced


def call(rank: int, world_size: int, scenario: dict) -> dict:
    """A scenario defined in a test module: ``scenario['target']`` is ``"module:function"`` (importable in the
    workers, as the test modules are), called with ``(rank, world_size, scenario)``."""
    import importlib

    module, _, function = scenario["target"].partition(":")
    return getattr(importlib.import_module(module), function)(rank, world_size, scenario)


SCENARIOS["call"] = call
