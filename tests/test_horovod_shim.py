"""torsh.horovod against Horovod's documented semantics, with 2 ranks on gloo.

Real Horovod is not installable next to current torch, so every property is checked directly: one torchrun
launch runs all the cases below (this file is also the worker script), each rank reports each case as "ok" or
the failure, and one pytest test per case reads the report. Ranks get different data, so a sum where a mean is
due (or rank 0's gradient alone) shows up.
"""

from __future__ import annotations

import http.server
import json
import os
import socket
import subprocess
import sys
import threading
import traceback
from pathlib import Path

import pytest

HERE = Path(__file__).resolve()
CASES: dict = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


# --------------------------------------------------------------------------------------------------
# worker side (runs under torchrun)


def _model(seed: int):
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))


def _local_grads(model, batches):
    """Each parameter's gradient of this rank's batches, computed without any communication."""
    import copy

    ref = copy.deepcopy(model)
    for x in batches:
        ref(x).pow(2).sum().backward()
    return [p.grad.clone() for p in ref.parameters()]


def _rank_batches(hvd, n=1, seed=0):
    import torch

    g = torch.Generator().manual_seed(1000 + 10 * hvd.rank() + seed)
    return [torch.randn(5, 4, generator=g) * (hvd.rank() + 1) for _ in range(n)]


def _every_rank(hvd, tensors):
    """[rank][i] tensors of every rank."""
    return hvd.allgather_object([t.clone() for t in tensors])


def _synced_model(hvd, seed=0):
    model = _model(seed)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return model


@case
def topology(hvd, torch):
    assert hvd.is_initialized()
    assert (hvd.size(), hvd.rank()) == (2, int(os.environ["RANK"]))
    assert (hvd.local_rank(), hvd.local_size()) == (int(os.environ["LOCAL_RANK"]), 2)
    assert (hvd.cross_rank(), hvd.cross_size()) == (0, 1)  # one node: each local rank is alone in its column
    assert hvd.is_homogeneous() and hvd.gloo_enabled() and not hvd.mpi_enabled()


@case
def average_is_mean_of_local_gradients(hvd, torch):
    model = _synced_model(hvd)
    batches = _rank_batches(hvd)
    local = _local_grads(model, batches)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    model(batches[0]).pow(2).sum().backward()
    opt.step()
    every = _every_rank(hvd, local)
    for i, p in enumerate(model.parameters()):
        mean = (every[0][i] + every[1][i]) / 2
        torch.testing.assert_close(p.grad, mean, rtol=1e-6, atol=0)
        assert not torch.allclose(p.grad, every[0][i] + every[1][i])  # not a sum
        assert not torch.allclose(every[0][i], every[1][i])  # the ranks really had different data


@case
def predivide_factor_gives_the_same_mean(hvd, torch):
    model = _synced_model(hvd)
    batches = _rank_batches(hvd)
    local = _local_grads(model, batches)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), gradient_predivide_factor=4.0)
    model(batches[0]).pow(2).sum().backward()
    opt.step()
    every = _every_rank(hvd, local)
    for i, p in enumerate(model.parameters()):
        torch.testing.assert_close(p.grad, (every[0][i] + every[1][i]) / 2, rtol=1e-6, atol=1e-7)


@case
def a_parameter_unused_on_one_rank_still_averages(hvd, torch):
    """Rank 1 never uses the last bias: it takes part with zeros (as in Horovod), launched by step()."""
    os.environ["HOROVOD_FUSION_THRESHOLD"] = "40"  # several buckets, the first one incomplete on rank 1
    try:
        model = _synced_model(hvd)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    finally:
        del os.environ["HOROVOD_FUSION_THRESHOLD"]
    x = _rank_batches(hvd)[0]
    hidden = model[1](model[0](x))
    out = model[2](hidden) if hvd.rank() == 0 else torch.nn.functional.linear(hidden, model[2].weight)
    out.pow(2).sum().backward()
    local_bias = model[2].bias.grad.clone() if hvd.rank() == 0 else torch.zeros(2)
    opt.step()
    every = _every_rank(hvd, [p.grad for p in model.parameters()] + [local_bias])
    for mine, theirs in zip(every[0][:-1], every[1][:-1], strict=True):
        assert torch.equal(mine, theirs)
    torch.testing.assert_close(model[2].bias.grad, every[0][-1] / 2, rtol=1e-6, atol=0)


@case
def fusion_threshold_splits_buckets_without_changing_the_mean(hvd, torch):
    os.environ["HOROVOD_FUSION_THRESHOLD"] = "40"  # bytes: several buckets for this model
    try:
        model = _synced_model(hvd)
        batches = _rank_batches(hvd)
        local = _local_grads(model, batches)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        assert len(opt._buckets) > 2
        model(batches[0]).pow(2).sum().backward()
        opt.step()
    finally:
        del os.environ["HOROVOD_FUSION_THRESHOLD"]
    every = _every_rank(hvd, local)
    for i, p in enumerate(model.parameters()):
        torch.testing.assert_close(p.grad, (every[0][i] + every[1][i]) / 2, rtol=1e-6, atol=0)


@case
def sum_op_sums(hvd, torch):
    model = _synced_model(hvd)
    batches = _rank_batches(hvd)
    local = _local_grads(model, batches)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Sum)
    model(batches[0]).pow(2).sum().backward()
    opt.step()
    every = _every_rank(hvd, local)
    for i, p in enumerate(model.parameters()):
        torch.testing.assert_close(p.grad, every[0][i] + every[1][i], rtol=1e-6, atol=0)


@case
def backward_passes_per_step_accumulates_then_communicates_once(hvd, torch):
    from torsh.horovod import _optimizer

    model = _synced_model(hvd)
    batches = _rank_batches(hvd, n=2)
    local = _local_grads(model, batches)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), backward_passes_per_step=2)
    calls = []  # allreduces the optimizer starts (the background thread runs them)
    real = _optimizer._allreduce_launch
    _optimizer._allreduce_launch = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    try:
        model(batches[0]).pow(2).sum().backward()
        assert calls == [], "communicated during an accumulation pass"
        model(batches[1]).pow(2).sum().backward()
        assert len(calls) == 1, f"expected one fused allreduce started by the last pass, got {len(calls)}"
        opt.step()
        assert len(calls) == 1, "step() communicated again"
    finally:
        _optimizer._allreduce_launch = real
    every = _every_rank(hvd, local)
    for i, p in enumerate(model.parameters()):
        torch.testing.assert_close(p.grad, (every[0][i] + every[1][i]) / 2, rtol=1e-6, atol=1e-7)
    # A third pass before step() is Horovod's AssertionError, as is zero_grad() between backward and step.
    opt.zero_grad()
    for x in batches:
        model(x).pow(2).sum().backward()
    try:
        model(batches[0]).pow(2).sum().backward()
    except AssertionError as exc:
        assert "backward_passes_per_step" in str(exc)
    else:
        raise AssertionError("a third backward pass was accepted")
    try:
        opt.zero_grad()
    except AssertionError as exc:
        assert "zero_grad" in str(exc)
    else:
        raise AssertionError("zero_grad between backward and step was accepted")
    opt.step()
    opt.zero_grad()


@case
def synchronize_then_skip_synchronize_reduces_once(hvd, torch):
    import torch.distributed as dist

    model = _synced_model(hvd)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    calls = []
    real = dist.all_reduce
    dist.all_reduce = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    try:
        model(_rank_batches(hvd)[0]).pow(2).sum().backward()
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with opt.skip_synchronize():
            opt.step()
    finally:
        dist.all_reduce = real
    assert len(calls) == 1


@case
def fp16_compression_changes_values_only_by_fp16_rounding(hvd, torch):
    model = _synced_model(hvd)
    batches = _rank_batches(hvd)
    local = _local_grads(model, batches)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), compression=hvd.Compression.fp16)
    model(batches[0]).pow(2).sum().backward()
    opt.step()
    every = _every_rank(hvd, local)
    for i, p in enumerate(model.parameters()):
        assert p.grad.dtype == torch.float32
        fp16_mean = ((every[0][i].half() + every[1][i].half()) * 0.5).float()
        assert torch.equal(p.grad, fp16_mean), (p.grad, fp16_mean)
        torch.testing.assert_close(p.grad, (every[0][i] + every[1][i]) / 2, rtol=2e-3, atol=1e-4)


@case
def adasum_is_a_clear_error(hvd, torch):
    model = _model(0)
    for call in (lambda: hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Adasum),
                 lambda: hvd.allreduce(torch.ones(2), op=hvd.Adasum)):  # fmt: skip
        try:
            call()
        except NotImplementedError as exc:
            assert "Adasum" in str(exc) and "hvd.Average" in str(exc)
        else:
            raise AssertionError("Adasum was accepted")


@case
def bad_arguments_raise_like_horovod(hvd, torch):
    model = _model(0)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    for kwargs, words in [({"op": hvd.Sum, "gradient_predivide_factor": 2.0}, "predivide"),
                          ({"backward_passes_per_step": 0}, "backward_passes_per_step"),
                          ({"named_parameters": [("a", p) for p in model.parameters()]}, "unique")]:  # fmt: skip
        try:
            hvd.DistributedOptimizer(sgd, **kwargs)
        except ValueError as exc:
            assert words in str(exc)
        else:
            raise AssertionError(f"{kwargs} accepted")


@case
def parameters_broadcast_from_the_root(hvd, torch):
    for root in (0, 1):
        model = _model(seed=hvd.rank())  # different weights on each rank
        hvd.broadcast_parameters(model.state_dict(), root_rank=root)
        every = _every_rank(hvd, list(model.parameters()))
        root_model = _model(seed=root)
        for mine, theirs, expected in zip(every[0], every[1], root_model.parameters(), strict=True):
            assert torch.equal(mine, theirs) and torch.equal(mine, expected.detach())
    named = _model(seed=hvd.rank())
    hvd.broadcast_parameters(list(named.named_parameters()), root_rank=0)
    assert all(torch.equal(a, b.detach()) for a, b in zip(named.parameters(), _model(0).parameters(), strict=True))


@case
def optimizer_state_broadcast_from_the_root(hvd, torch):
    model = _synced_model(hvd)
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (hvd.rank() + 1))
    for _ in range(hvd.rank() + 1):  # rank 1 takes more steps on other data
        model(_rank_batches(hvd)[0]).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert opt.param_groups[0]["lr"] == 0.01
    states = hvd.allgather_object(opt.state_dict()["state"])
    for pid, state in states[0].items():
        for key, value in state.items():
            assert torch.equal(value, states[1][pid][key]), key
    # A fresh optimizer gets its state initialised first (Horovod's zero-gradient step), then broadcast.
    fresh = torch.optim.Adam(_synced_model(hvd).parameters(), lr=0.5 + hvd.rank())
    hvd.broadcast_optimizer_state(fresh, root_rank=0)
    assert fresh.param_groups[0]["lr"] == 0.5 and fresh.state_dict()["state"]


@case
def allreduce_functions(hvd, torch):
    import warnings

    x = torch.tensor([1.0, 2.0]) * (hvd.rank() + 1)  # rank 0: [1, 2], rank 1: [2, 4]
    assert torch.equal(hvd.allreduce(x), torch.tensor([1.5, 3.0]))
    assert torch.equal(x, torch.tensor([1.0, 2.0]) * (hvd.rank() + 1))  # out of place
    assert torch.equal(hvd.allreduce(x, op=hvd.Sum), torch.tensor([3.0, 6.0]))
    assert torch.equal(hvd.allreduce(x, op=hvd.Min), torch.tensor([1.0, 2.0]))
    assert torch.equal(hvd.allreduce(x, op=hvd.Max), torch.tensor([2.0, 4.0]))
    with warnings.catch_warnings(record=True):
        assert torch.equal(hvd.allreduce(x, average=False), torch.tensor([3.0, 6.0]))
    assert torch.equal(hvd.allreduce(x, prescale_factor=2.0, postscale_factor=0.5, name="scaled"),
                       torch.tensor([1.5, 3.0]))
    y = x.clone()
    assert hvd.allreduce_(y, op=hvd.Sum) is y and torch.equal(y, torch.tensor([3.0, 6.0]))
    assert torch.equal(hvd.synchronize(hvd.allreduce_async(x)), torch.tensor([1.5, 3.0]))
    h = hvd.allreduce(x, compression=hvd.Compression.fp16)
    assert h.dtype == torch.float32 and torch.equal(h, torch.tensor([1.5, 3.0]))
    counts = torch.tensor([3, -3]) * (hvd.rank() + 1)  # integers: average truncates toward zero, as Horovod
    assert hvd.allreduce(counts).tolist() == [4, -4] and hvd.allreduce(counts, op=hvd.Sum).tolist() == [9, -9]
    pair = hvd.grouped_allreduce([x, x * 2], op=hvd.Sum)
    assert torch.equal(pair[0], torch.tensor([3.0, 6.0])) and torch.equal(pair[1], torch.tensor([6.0, 12.0]))
    leaf = x.clone().requires_grad_()
    hvd.allreduce(leaf).sum().backward()
    assert torch.equal(leaf.grad, torch.ones(2))


@case
def allgather_concatenates_uneven_first_dims(hvd, torch):
    mine = torch.full((hvd.rank() + 1, 2), float(hvd.rank()))
    gathered = hvd.allgather(mine)
    assert gathered.shape == (3, 2)
    assert torch.equal(gathered[:, 0], torch.tensor([0.0, 1.0, 1.0]))
    ints = hvd.allgather(torch.tensor([hvd.rank()] * (hvd.rank() + 2)))
    assert ints.tolist() == [0, 0, 1, 1, 1]


@case
def broadcast_functions(hvd, torch):
    x = torch.tensor([float(hvd.rank() + 1)])
    assert torch.equal(hvd.broadcast(x, root_rank=1), torch.tensor([2.0]))
    assert torch.equal(x, torch.tensor([float(hvd.rank() + 1)]))
    assert hvd.broadcast_(x, root_rank=0) is x and torch.equal(x, torch.tensor([1.0]))
    obj = hvd.broadcast_object({"epoch": 3, "rank": hvd.rank()} if hvd.rank() == 1 else None, root_rank=1)
    assert obj == {"epoch": 3, "rank": 1}
    assert hvd.allgather_object(("r", hvd.rank())) == [("r", 0), ("r", 1)]


@case
def join_returns_the_same_last_rank_everywhere(hvd, torch):
    last = hvd.join()
    assert last in (0, 1) and hvd.allgather_object(last) == [last, last]


@case
def int16_is_reduced_exactly_with_wraparound(hvd, torch):
    # gloo has no int16: carried in int32 and cast back, with int16's own overflow.
    x = torch.tensor([30000, -7, 1 + hvd.rank()], dtype=torch.int16)
    out = hvd.allreduce(x, op=hvd.Sum)
    assert out.dtype == torch.int16
    assert out.tolist() == [-5536, -14, 3], out
    assert hvd.allgather(x).tolist() == [30000, -7, 1, 30000, -7, 2]


@case
def mismatched_ranks_raise_horovods_errors(hvd, torch):
    for bad, message in [
        (lambda: hvd.allreduce(torch.ones(3) if hvd.rank() == 0 else torch.ones(3, dtype=torch.int32)),
         "Mismatched data types: One rank had type HOROVOD_FLOAT32, but another rank had type HOROVOD_INT32."),
        (lambda: hvd.allreduce(torch.ones(3 + hvd.rank())),
         "Mismatched ALLREDUCE tensor shapes: One rank sent a tensor of shape [3], but another rank sent a tensor "
         "of shape [4]."),
        (lambda: hvd.broadcast(torch.ones(2), root_rank=hvd.rank()),
         "Mismatched BROADCAST root ranks: One rank specified root rank 0, but another rank specified root rank 1."),
    ]:  # fmt: skip
        try:
            bad()
        except hvd.HorovodInternalError as exc:
            assert isinstance(exc, RuntimeError) and str(exc) == message, exc
        else:
            raise AssertionError(f"no error for: {message}")
    assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [2.0, 2.0]  # and the job goes on


@case
def handles_are_asynchronous_and_matched_by_name(hvd, torch):
    # Rank 1 starts the two allreduces in the opposite order: Horovod matches them by name, not by call order.
    names = ["a", "b"] if hvd.rank() == 0 else ["b", "a"]
    handles = {n: hvd.allreduce_async(torch.tensor([float(ord(n) + hvd.rank())]), name=n, op=hvd.Sum)
               for n in names}  # fmt: skip
    assert hvd.synchronize(handles["a"]).item() == 2 * ord("a") + 1
    assert hvd.synchronize(handles["b"]).item() == 2 * ord("b") + 1
    try:
        hvd.allreduce_async(torch.ones(1), name="dup")
        hvd.allreduce_async(torch.ones(1), name="dup")
    except ValueError as exc:
        assert "same name as another tensor that is currently being processed" in str(exc)
    else:
        raise AssertionError("a second pending operation with the same name was accepted")
    hvd.barrier()


@case
def process_sets_and_new_collectives(hvd, torch):
    # Every rank registers the same sets in the same order (Horovod's contract).
    first, second = hvd.add_process_set([0]), hvd.add_process_set(hvd.ProcessSet([1]))
    mine, other = (first, second) if hvd.rank() == 0 else (second, first)
    assert mine.size() == 1 and mine.rank() == 0 and not other.included()
    assert hvd.allreduce(torch.tensor([5.0]), process_set=mine, op=hvd.Sum).item() == 5.0
    try:
        hvd.allreduce(torch.ones(1), process_set=other)
    except ValueError as exc:
        assert "is not a member of the provided process set" in str(exc)
    else:
        raise AssertionError("an operation on a process set without this rank was accepted")
    assert hvd.remove_process_set(mine) and hvd.remove_process_set(other)
    # alltoall with uneven splits, reducescatter (Horovod's split of the first dimension), grouped allgather
    x = torch.arange(3.0) + 10 * hvd.rank()
    out, received = hvd.alltoall(x, torch.tensor([1, 2] if hvd.rank() == 0 else [2, 1], dtype=torch.int32))
    assert out.tolist() == ([0.0, 10.0, 11.0] if hvd.rank() == 0 else [1.0, 2.0, 12.0])
    assert received.tolist() == ([1, 2] if hvd.rank() == 0 else [2, 1])
    rs = hvd.reducescatter(torch.arange(5.0), op=hvd.Sum)
    assert rs.tolist() == ([0.0, 2.0, 4.0] if hvd.rank() == 0 else [6.0, 8.0])
    a, b = hvd.grouped_allgather([torch.ones(1) * hvd.rank(), torch.ones(hvd.rank() + 1, 2)])
    assert a.tolist() == [0.0, 1.0] and b.shape == (3, 2)


@case
def broadcast_object_with_none_elsewhere(hvd, torch):
    # Horovod names the transfer after the type (dict on the root, NoneType elsewhere) and stalls; one name here.
    got = hvd.broadcast_object({"step": 7} if hvd.rank() == 0 else None, root_rank=0)
    assert got == {"step": 7}


@case
def checks_can_be_turned_off(hvd, torch):
    # TORSH_HOROVOD_CHECKS=0 (read at init) skips comparing the ranks' requests: different prescale factors are
    # then each rank's own business instead of Horovod's "Mismatched prescale" error.
    from torsh.horovod import _basics

    ctl = _basics._state.controller
    try:
        hvd.allreduce(torch.ones(1), op=hvd.Sum, prescale_factor=1.0 + hvd.rank(), name="factors")
    except hvd.HorovodInternalError as exc:
        assert "Mismatched prescale and/or postscale factors" in str(exc)
    else:
        raise AssertionError("mismatched prescale factors were not reported")
    ctl.checks = False
    try:
        assert hvd.allreduce(torch.ones(1), op=hvd.Sum, prescale_factor=1.0 + hvd.rank(), name="factors").item() == 3
    finally:
        ctl.checks = True


def _worker() -> None:
    import torch

    import torsh.horovod as hvd

    hvd.init()
    results = {}
    for name, fn in CASES.items():
        try:
            fn(hvd, torch)
            results[name] = "ok"
        except Exception:  # report every case, not only the first failure
            results[name] = traceback.format_exc()
    everyone = hvd.allgather_object(results)
    if hvd.rank() == 0:
        Path(os.environ["TORSH_TEST_REPORT"]).write_text(json.dumps(everyone))
    hvd.shutdown()


def _horovodrun_env_worker() -> None:
    """Started with horovodrun's Gloo variables only (no RANK / MASTER_*)."""
    import torch

    import torsh.horovod as hvd

    hvd.init()
    out = {"rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(), "local_size": hvd.local_size(),
           "cross_rank": hvd.cross_rank(), "cross_size": hvd.cross_size(),
           "sum": hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item()}  # fmt: skip
    Path(os.environ["TORSH_TEST_REPORT"] + f".{hvd.rank()}").write_text(json.dumps(out))
    hvd.shutdown()


# --------------------------------------------------------------------------------------------------
# pytest side


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_",
                                                                      "HOROVOD_", "TORCHELASTIC", "GROUP_"))}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("hvd") / "report.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_free_port()),
           str(HERE), "--worker"]  # fmt: skip
    proc = subprocess.run(cmd, env=_env(TORSH_TEST_REPORT=str(out)), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0 and out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks(report, name):
    for rank, results in enumerate(report):
        assert results[name] == "ok", f"rank {rank}:\n{results[name]}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _HorovodKV(http.server.BaseHTTPRequestHandler):
    """The GET/PUT /<scope>/<key> protocol of horovodrun's Gloo rendezvous server."""

    store: dict = {}

    def do_GET(self):  # noqa: N802
        value = self.store.get(self.path)
        self.send_response(404 if value is None else 200)
        self.send_header("Content-Length", str(len(value or b"")))
        self.end_headers()
        self.wfile.write(value or b"")

    def do_PUT(self):  # noqa: N802
        self.store[self.path] = self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.mark.slow
def test_init_under_horovodrun_gloo_environment(tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _HorovodKV)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    report = tmp_path / "hvd"
    procs = []
    try:
        procs += [subprocess.Popen([sys.executable, str(HERE), "--horovodrun-env"], env=_env(
            HOROVOD_RANK=str(r), HOROVOD_SIZE="2", HOROVOD_LOCAL_RANK=str(r), HOROVOD_LOCAL_SIZE="2",
            HOROVOD_CROSS_RANK="0", HOROVOD_CROSS_SIZE="1", HOROVOD_HOSTNAME="localhost",
            HOROVOD_GLOO_RENDEZVOUS_ADDR="127.0.0.1", HOROVOD_GLOO_RENDEZVOUS_PORT=str(server.server_port),
            HOROVOD_CONTROLLER="gloo", HOROVOD_CPU_OPERATIONS="gloo", TORSH_TEST_REPORT=str(report)),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]  # fmt: skip
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        server.shutdown()
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-2000:] for o in outputs)
    for r in (0, 1):
        got = json.loads(Path(f"{report}.{r}").read_text())
        assert got == {"rank": r, "size": 2, "local_rank": r, "local_size": 2, "cross_rank": 0, "cross_size": 1,
                       "sum": 3.0}  # fmt: skip


@pytest.mark.slow
def test_single_process_without_a_launcher():
    code = ("import torch, torsh.horovod as hvd\n"
            "try:\n    hvd.size()\nexcept ValueError as e:\n    assert 'hvd.init()' in str(e)\n"
            "hvd.init(); assert (hvd.size(), hvd.rank(), hvd.local_size(), hvd.cross_size()) == (1, 0, 1, 1)\n"
            "m = torch.nn.Linear(2, 1); o = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=1.0))\n"
            "m(torch.ones(1, 2)).sum().backward(); g = m.weight.grad.clone(); o.step()\n"
            "assert torch.equal(m.weight.grad, g)\n"
            "assert hvd.allgather(torch.ones(2, 3)).shape == (2, 3)\n"
            "hvd.shutdown(); assert not hvd.is_initialized()\n"
            "try:\n    hvd.elastic\nexcept AttributeError as e:\n    assert 'torchrun --nnodes' in str(e)\n"
            "else:\n    raise SystemExit('hvd.elastic gave no error')\n")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


if __name__ == "__main__":
    if "--worker" in sys.argv:
        _worker()
    elif "--horovodrun-env" in sys.argv:
        _horovodrun_env_worker()
