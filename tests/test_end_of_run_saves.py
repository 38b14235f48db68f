"""The saves at the end of real DeepSpeed scripts, run by the same code under real DeepSpeed 0.19.8 and under torsh
on 2 gloo ranks (one launch for every case), the files compared.

- DeepSpeed-Chat's end of step 1 at ZeRO-3: an evaluation forward, ``save_hf_format`` (``model.state_dict()``
  saved by rank 0 alone), then ``save_zero_three_model`` (``GatheredParameters`` entered per parameter on every
  rank, rank 0 copying ``v.data.cpu()``) and LLaVA/FastChat's ``maybe_zero_3``;
- ``torch.save(model.state_dict())`` on rank 0 alone at stages 0-2 (DeepSpeed-Chat's ``save_hf_format``), read back
  with ``torch.load(weights_only=True)`` in another process: plain whole tensors, DeepSpeed's values; training goes
  on afterwards with DeepSpeed's losses (the ranks did not fall out of step).
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("torch")
pytest.importorskip("deepspeed", reason="DeepSpeed 0.19.8 is installed by requirements-dev.txt in CI")

import _engine_harness as h  # noqa: E402

pytestmark = pytest.mark.slow

MODULE = "test_end_of_run_saves"
ENGINES = ("torsh", "deepspeed")
FP32 = 1e-5


_backend, ds_config = h.backend, h.ds_config


def _train(engine, rank: int, start: int, steps: int) -> list[float]:
    return h.train(engine, rank, start, steps, micro=2)


def _evaluate(engine, rank: int) -> float:
    """DeepSpeed-Chat's perplexity evaluation at the end of each epoch: eval mode, forward without gradients."""
    import torch

    engine.eval()
    with torch.no_grad():
        x, y = h.batch(99, rank, 2)
        loss = h.lm_loss(engine(x), y).item()
    engine.train()
    return loss


def chat_zero3(rank: int, world_size: int, scenario: dict) -> dict:
    """DeepSpeed-Chat step 1's end at ZeRO-3, written as that script does it (and ``maybe_zero_3``)."""
    import torch

    backend = _backend(scenario["engine"])
    status = backend.runtime.zero.partition_parameters.ZeroParamStatus
    model = h.build_model(0)
    engine, *_ = backend.initialize(model=model, model_parameters=model.parameters(), config=scenario["config"])
    losses = _train(engine, rank, 0, 3)
    if scenario["evaluate"]:
        losses.append(_evaluate(engine, rank))
    if rank == 0:  # save_hf_format, called by rank 0 only, before the ZeRO-3 save
        torch.save(engine.module.state_dict(), os.path.join(scenario["dir"], "hf.bin"))
    gathered = {}
    for name, param in engine.module.named_parameters():
        if hasattr(param, "ds_id"):
            fetch = [p for p in [param] if hasattr(p, "ds_id") and p.ds_status == status.NOT_AVAILABLE]
            with backend.zero.GatheredParameters(fetch, enabled=True):
                value = param.data.cpu()
        else:
            value = param.cpu()
        if rank == 0:
            gathered[name] = value
    if rank == 0:
        torch.save(gathered, os.path.join(scenario["dir"], "zero3.bin"))
    # LLaVA / FastChat: maybe_zero_3 over the named parameters, every rank
    llava = {}
    for name, param in engine.module.named_parameters():
        if hasattr(param, "ds_id"):
            with backend.zero.GatheredParameters([param]):
                llava[name] = param.data.detach().cpu().clone()
        else:
            llava[name] = param.detach().cpu().clone()
    torch.save(llava, os.path.join(scenario["dir"], f"llava{rank}.bin"))
    losses += _train(engine, rank, 3, 1)  # the job goes on after saving: no rank out of step
    return {"losses": losses}


def rank0_state_dict(rank: int, world_size: int, scenario: dict) -> dict:
    """``torch.save(model.state_dict())`` on rank 0 alone after training (and after an evaluation forward when
    asked), then one more step on every rank."""
    import torch

    backend = _backend(scenario["engine"])
    model = h.build_model(0)
    engine, *_ = backend.initialize(model=model, model_parameters=model.parameters(), config=scenario["config"])
    losses = _train(engine, rank, 0, 3)
    if scenario["evaluate"]:
        losses.append(_evaluate(engine, rank))
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(scenario["dir"], "model.bin"))
        torch.save(engine.module.state_dict(), os.path.join(scenario["dir"], "module.bin"))
    losses += _train(engine, rank, 3, 1)
    return {"losses": losses}


def bert_model(seed: int):
    """HelloDeepSpeed's BERT in miniature: ``encoder.embeddings`` with persistent ``position_ids`` and
    ``token_type_ids`` buffers and a non-persistent one, an LM head whose ``decoder.weight`` is the word
    embeddings and whose ``decoder.bias`` is its ``bias`` (Hugging Face's ``RobertaLMHead``)."""
    import torch
    from torch import nn

    hidden, vocab, length = 16, h.VOCAB, 12

    class Embeddings(nn.Module):
        def __init__(self):
            super().__init__()
            self.word_embeddings = nn.Embedding(vocab, hidden)
            self.position_embeddings = nn.Embedding(length, hidden)
            self.LayerNorm = nn.LayerNorm(hidden)
            self.register_buffer("position_ids", torch.arange(length).expand((1, -1)))
            self.register_buffer("token_type_ids", torch.zeros(1, length, dtype=torch.long))
            self.register_buffer("scale", torch.ones(hidden), persistent=False)

        def forward(self, tokens):
            n = tokens.shape[1]
            x = self.word_embeddings(tokens) + self.position_embeddings(self.position_ids[:, :n])
            return self.LayerNorm(x + (self.token_type_ids[:, :n, None] * self.scale).to(x.dtype))

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.embeddings = Embeddings()
            self.layer = nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden))

        def forward(self, tokens):
            x = self.embeddings(tokens)
            return x + self.layer(x)

    class LMHead(nn.Module):
        def __init__(self, embedding):
            super().__init__()
            self.dense = nn.Linear(hidden, hidden)
            self.layer_norm = nn.LayerNorm(hidden)
            self.decoder = nn.Linear(hidden, vocab)
            self.bias = nn.Parameter(torch.zeros(vocab))
            self.decoder.bias = self.bias
            self.decoder.weight = embedding

        def forward(self, x):
            return self.decoder(self.layer_norm(torch.nn.functional.gelu(self.dense(x))))

    class MaskedLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = Encoder()
            self.lm_head = LMHead(self.encoder.embeddings.word_embeddings.weight)

        def forward(self, tokens):
            return self.lm_head(self.encoder(tokens))

    torch.manual_seed(seed)
    return MaskedLM()


def bert_resume(rank: int, world_size: int, scenario: dict) -> dict:
    """Real DeepSpeed trains 2 steps, checkpoints (default tag), trains 2 more; torsh builds the model with other
    weights, loads DeepSpeed's checkpoint with the default (strict) load and trains the same 2 steps."""
    import deepspeed

    import torsh

    model = bert_model(0)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=scenario["config"])
    before = _train(engine, rank, 0, 2)
    engine.save_checkpoint(scenario["dir"])
    after = _train(engine, rank, 2, 2)
    model = bert_model(1)
    ours, *_ = torsh.initialize(model=model, model_parameters=model.parameters(), config=scenario["config"])
    path, _ = ours.load_checkpoint(scenario["dir"])
    return {"before": before, "after": after, "resumed": _train(ours, rank, 2, 2), "global_steps": ours.global_steps,
            "tied": model.lm_head.decoder.bias is model.lm_head.bias, "loaded": path is not None}


def imagenet_zero1(rank: int, world_size: int, scenario: dict) -> dict:
    """DeepSpeed's ImageNet example at ZeRO-1: the script's own SGD passed in, then every rank saves
    ``{"state_dict": model.state_dict(), "optimizer": optimizer.state_dict()}`` with ``torch.save``; also
    ``engine.save_checkpoint``. Two more steps; a fresh job resumes each way and repeats them."""
    import torch

    backend = _backend(scenario["engine"])

    def start(seed):
        model = h.build_model(seed)
        sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
        engine, optimizer, _, _ = backend.initialize(model=model, optimizer=sgd, config=scenario["config"])
        return engine, optimizer

    engine, optimizer = start(0)
    before = _train(engine, rank, 0, 2)
    file = os.path.join(scenario["dir"], f"checkpoint{rank}.pth.tar")
    torch.save({"epoch": 1, "state_dict": engine.state_dict(), "optimizer": optimizer.state_dict()}, file)
    engine.save_checkpoint(scenario["dir"], tag="t")
    after = _train(engine, rank, 2, 2)
    out = {"before": before, "after": after}
    if scenario["engine"] == "torsh":
        fresh, _ = start(1)
        fresh.load_checkpoint(scenario["dir"], tag="t")
        out["resumed"] = _train(fresh, rank, 2, 2)
        fresh, fresh_optimizer = start(1)
        saved = torch.load(file, weights_only=True)
        fresh.load_state_dict(saved["state_dict"])
        fresh_optimizer.load_state_dict(saved["optimizer"])
        out["resumed_torch_save"] = _train(fresh, rank, 2, 2)
    return out


def _gathered_bytes(engine) -> int:
    """Bytes of the FSDP2 gathered (whole) parameter buffers the engine holds on this rank."""
    total = 0
    for module in engine.module.modules():
        if hasattr(module, "_get_fsdp_state"):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                for fsdp_param in group.fsdp_params:
                    total += sum(t.untyped_storage().nbytes() for t in getattr(fsdp_param, "all_gather_outputs", []))
    return total


def offload(rank: int, world_size: int, scenario: dict) -> dict:
    """DeepSpeedExamples' ``training/offload_states``: after a step, ``offload_states()`` then ``reload_states()``;
    the gathered parameters (whole between steps at stage 2) are freed by the offload, and training goes on."""
    import torsh

    model = h.build_model(0)
    engine, *_ = torsh.initialize(model=model, model_parameters=model.parameters(), config=scenario["config"])
    losses = _train(engine, rank, 0, 2)
    held = [_gathered_bytes(engine)]
    engine.offload_states()
    held.append(_gathered_bytes(engine))
    engine.reload_states()
    held.append(_gathered_bytes(engine))
    losses += _train(engine, rank, 2, 2)
    return {"losses": losses, "held": held}


def _scenarios(tmp) -> list[dict]:
    out = []
    for engine in ENGINES:
        for evaluate in (True, False):
            name = f"chat_z3{'_eval' if evaluate else ''}_{engine}"
            out.append({"name": name, "kind": "call", "target": f"{MODULE}:chat_zero3", "engine": engine,
                        "evaluate": evaluate, "config": ds_config(3), "dir": _mkdir(tmp, name)})  # fmt: skip
        for stage, dtype, evaluate in ((0, "fp32", False), (1, "fp32", False), (2, "fp32", False),
                                       (2, "fp32", True), (2, "bf16", False)):  # fmt: skip
            # bf16 with SGD: Adam's sign-like first steps turn the engines' bf16 rounding differences in
            # near-zero gradients into whole learning-rate steps; SGD keeps them at the dtype's rounding
            extra = {"bf16": {"enabled": True}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                     "zero_allow_untested_optimizer": True} \
                if dtype == "bf16" else {}  # fmt: skip
            name = f"rank0_s{stage}_{dtype}{'_eval' if evaluate else ''}_{engine}"
            out.append({"name": name, "kind": "call", "target": f"{MODULE}:rank0_state_dict", "engine": engine,
                        "evaluate": evaluate, "config": ds_config(stage, **extra), "dir": _mkdir(tmp, name)})
    for engine in ENGINES:
        for dtype in ("fp32", "bf16", "fp16") if engine == "torsh" else ("fp32", "bf16"):
            # (real DeepSpeed refuses fp16 on this CPU: no oneDNN fp16; torsh's fp16 runs and is checked alone)
            name = f"imagenet_z1_{dtype}_{engine}"
            extra = {dtype: {"enabled": True}} if dtype != "fp32" else {}
            config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "zero_allow_untested_optimizer":
                      True, "zero_optimization": {"stage": 1}, **extra}  # fmt: skip
            out.append({"name": name, "kind": "call", "target": f"{MODULE}:imagenet_zero1", "engine": engine,
                        "config": config, "dir": _mkdir(tmp, name)})  # fmt: skip
    for stage in (2, 3):
        out.append({"name": f"offload_s{stage}", "kind": "call", "target": f"{MODULE}:offload",
                    "config": ds_config(stage)})
    for stage, dtype in ((0, "fp32"), (0, "bf16"), (2, "fp32"), (2, "bf16")):
        name = f"bert_s{stage}_{dtype}"
        extra = {"bf16": {"enabled": True}} if dtype == "bf16" else {}
        out.append({"name": name, "kind": "call", "target": f"{MODULE}:bert_resume", "config": ds_config(stage, **extra),
                    "dir": _mkdir(tmp, name)})  # fmt: skip
    return out


def _mkdir(tmp, name: str) -> str:
    path = tmp / name
    path.mkdir()
    return str(path)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return tmp_path_factory.mktemp("end_of_run")


@pytest.fixture(scope="module")
def records(saved):
    return h.run(_scenarios(saved))


def _both(records, name: str) -> tuple[list[dict], list[dict]]:
    return h.both(records, name, ENGINES)


def _load(saved, name: str, file: str) -> dict:
    """A file written by the workers, read here (another process) as ``from_pretrained`` reads it."""
    import torch

    return torch.load(saved / name / file, weights_only=True)


def _assert_same(ours: dict, theirs: dict, *, bf16: bool = False) -> None:
    import torch

    assert list(ours) == list(theirs)
    for key, expected in theirs.items():
        value = ours[key]
        assert type(value) is torch.Tensor, (key, type(value))  # not a DTensor, not a Parameter
        assert value.dtype == expected.dtype and value.shape == expected.shape, key
        if bf16:  # the engines' bf16 steps are not bit-equal: the dtype's rounding, a few units in the last place
            torch.testing.assert_close(value.float(), expected.float(), rtol=3 * 2**-8, atol=1e-2)
        else:
            torch.testing.assert_close(value, expected, rtol=FP32, atol=1e-6)


@pytest.mark.parametrize("evaluate", [True, False], ids=["after_eval", "after_step"])
def test_deepspeed_chat_zero3_save_completes_with_deepspeeds_tensors(records, saved, evaluate):
    name = f"chat_z3{'_eval' if evaluate else ''}"
    torsh_ranks, ds_ranks = _both(records, name)
    for t, d in zip(torsh_ranks, ds_ranks):
        assert t["losses"] == pytest.approx(d["losses"], rel=FP32)
    ours, theirs = (_load(saved, f"{name}_{engine}", "zero3.bin") for engine in ENGINES)
    _assert_same(ours, theirs)
    for rank in (0, 1):
        ours, theirs = (_load(saved, f"{name}_{engine}", f"llava{rank}.bin") for engine in ENGINES)
        _assert_same(ours, theirs)


@pytest.mark.parametrize("case", ["s0_fp32", "s1_fp32", "s2_fp32", "s2_fp32_eval", "s2_bf16"])
def test_rank0_state_dict_is_plain_and_deepspeeds(records, saved, case):
    name = f"rank0_{case}"
    torsh_ranks, ds_ranks = _both(records, name)
    for t, d in zip(torsh_ranks, ds_ranks):
        # the step after the rank-0 save is DeepSpeed's: the ranks stayed in step
        assert t["losses"] == pytest.approx(d["losses"], rel=FP32 if "bf16" not in case else 1e-2)
    for file in ("model.bin", "module.bin"):
        ours, theirs = (_load(saved, f"{name}_{engine}", file) for engine in ENGINES)
        _assert_same(ours, theirs, bf16="bf16" in case)


@pytest.mark.parametrize("case", ["s0_fp32", "s0_bf16", "s2_fp32", "s2_bf16"])
def test_deepspeed_checkpoint_of_tied_bert_resumes_under_torsh(records, case):
    """The tied LM head and the buffers as DeepSpeed's module state dict has them: the default strict load
    succeeds (bf16 at stage 0 is the engine's fp32-master path) and the losses continue DeepSpeed's."""
    for rank in records:
        r = rank[f"bert_{case}"]
        assert "error" not in r, r.get("traceback")
        assert r["loaded"] and r["global_steps"] == 4 and r["tied"]  # 2 loaded, 2 trained
        tolerance = 1e-2 if "bf16" in case else FP32  # bf16: the engines' forward rounding differs
        assert r["resumed"] == pytest.approx(r["after"], rel=tolerance)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_imagenet_zero1_saves_optimizer_state_and_resumes(records, dtype):
    """``optimizer.state_dict()`` at ZeRO-1 on every rank (no consolidation error), as under DeepSpeed; both
    saves resume with the losses the job went on with (the script's torch.save holds the fp16/bf16 weights, not
    the fp32 masters: those resume to the dtype's rounding)."""
    for rank in records:
        t = rank[f"imagenet_z1_{dtype}_torsh"]
        assert "error" not in t, t.get("traceback")
        if dtype != "fp16":
            d = rank[f"imagenet_z1_{dtype}_deepspeed"]
            assert "error" not in d, d.get("traceback")
            tolerance = FP32 if dtype == "fp32" else 1e-2
            assert t["before"] + t["after"] == pytest.approx(d["before"] + d["after"], rel=tolerance)
        assert t["resumed"] == pytest.approx(t["after"], rel=FP32)
        assert t["resumed_torch_save"] == pytest.approx(t["after"], rel=FP32 if dtype == "fp32" else 1e-2)


@pytest.mark.parametrize("stage", [2, 3])
def test_offload_states_frees_the_gathered_parameters(records, stage):
    """The losses continue as without the offload (DeepSpeed's, see the rank-0 cases); at stage 3 the gathered
    parameters are freed by ``offload_states``. (Stage 2 holds no FSDP2 buffers: its whole parameters are the
    module's own, as DeepSpeed's stage 2 keeps them.)"""
    for rank in records:
        # the same 4 steps without an offload, by DeepSpeed
        r, plain = rank[f"offload_s{stage}"], rank["rank0_s2_fp32_deepspeed" if stage == 2 else "chat_z3_deepspeed"]
        assert "error" not in r, r.get("traceback")
        assert r["losses"] == pytest.approx(plain["losses"], rel=FP32)
        held, offloaded, reloaded = r["held"]
        assert offloaded == 0
        if stage == 2:
            assert held == reloaded == 0
