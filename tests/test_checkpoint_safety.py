"""Loading a checkpoint never runs code from it, and a corrupt or missing one is a clear error.

A payload (a pickle whose ``__reduce__`` creates a marker file) is planted in every file a load reads; the load
must fail with :class:`CheckpointError` naming the file and the marker must never appear. Each plant is first
shown to be live: the stock reader (plain pickle) does run it.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import pickle
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from torsh.engine.checkpoint import io as checkpoint_io  # noqa: E402
from torsh.engine.checkpoint.save_load import CheckpointError, load_checkpoint, save_checkpoint  # noqa: E402

TAG = "global_step2"


class _Payload:
    """Unpickling this creates ``marker`` (a stand-in for arbitrary code)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _job(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return {"model": model, "optimizer": opt, "lr_scheduler": None, "loss_scaler": None}


def _save(root: Path, tag: str = TAG) -> Path:
    save_checkpoint(root, tag, **_job(), engine_state={"global_steps": 2}, client_state={"epoch": 1},
                    save_latest=True)  # fmt: skip
    return root / tag


def _load(root: Path, tag=None, **kwargs):
    return load_checkpoint(root, tag, **_job(1), **kwargs)


def _reseal(ckpt: Path) -> None:
    """Rewrite the manifest so that the planted file passes the checksums (as an attacker would)."""
    manifest = checkpoint_io.write_manifest(ckpt, [checkpoint_io.hash_share(ckpt, 0, 1)])
    (ckpt / checkpoint_io.MANIFEST).write_bytes(manifest)


def _torch_payload(marker: Path, wrap=lambda p: p) -> bytes:
    buffer = io.BytesIO()
    torch.save(wrap(_Payload(marker)), buffer)
    return buffer.getvalue()


def _expect_refused(root: Path, marker: Path, names: str, **kwargs) -> None:
    with pytest.raises(CheckpointError) as info:
        _load(root, **kwargs)
    assert names in str(info.value), str(info.value)
    assert not marker.exists(), "the payload ran"


# ---- planted payloads -----------------------------------------------------------------------------------


def _plant_in_bytes_item(ckpt: Path, marker: Path, fqn: str = "optim.param_groups.0.lr") -> Path:
    """Append a payload to the shard and point the item ``fqn`` at it (rewriting .metadata as DCP writes it)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    metadata = pickle.loads((ckpt / ".metadata").read_bytes())  # our own file, trusted here
    index = MetadataIndex(fqn)
    info = metadata.storage_data[index]
    shard = ckpt / info.relative_path
    payload = _torch_payload(marker)
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(payload)
    metadata.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(payload))
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    return shard


def _stock_dcp_load(ckpt: Path) -> None:
    """What torch.distributed.checkpoint does on its own (the unsafe reader), to show a plant is live."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    job = _job(1)
    model_sd, optim_sd = get_state_dict(job["model"], job["optimizer"])
    try:
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=ckpt)
    except BaseException:  # noqa: BLE001 - only the marker matters
        pass


def test_payload_as_the_whole_metadata_file_does_not_run(tmp_path):
    ckpt, marker = _save(tmp_path / "c"), tmp_path / "marker"
    (ckpt / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    _reseal(ckpt)
    _expect_refused(tmp_path / "c", marker, str(ckpt / ".metadata"))
    _stock_dcp_load(ckpt)
    assert marker.exists()  # the plant is live: plain pickle runs it


def test_payload_nested_inside_valid_metadata_does_not_run(tmp_path):
    ckpt, marker = _save(tmp_path / "c"), tmp_path / "marker"
    metadata = pickle.loads((ckpt / ".metadata").read_bytes())
    metadata.planner_data = {"x": _Payload(marker)}
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    _reseal(ckpt)
    _expect_refused(tmp_path / "c", marker, ".metadata")
    with pytest.raises(CheckpointError, match="refused to load io.open"):  # the refused global is named
        checkpoint_io.read_dcp_metadata(ckpt / ".metadata")


def test_payload_in_a_shards_non_tensor_item_does_not_run(tmp_path):
    ckpt, marker = _save(tmp_path / "c"), tmp_path / "marker"
    shard = _plant_in_bytes_item(ckpt, marker)
    _reseal(ckpt)
    _expect_refused(tmp_path / "c", marker, f"{shard} (item optim.param_groups.0.lr)")
    _stock_dcp_load(ckpt)
    assert marker.exists()


def test_payload_in_engine_states_does_not_run(tmp_path):
    ckpt, marker = _save(tmp_path / "c"), tmp_path / "marker"
    (ckpt / "engine_states.pt").write_bytes(_torch_payload(marker, lambda p: {"engine": p}))
    _reseal(ckpt)
    _expect_refused(tmp_path / "c", marker, str(ckpt / "engine_states.pt"))


def test_payload_in_rng_states_does_not_run(tmp_path):
    ckpt, marker = _save(tmp_path / "c"), tmp_path / "marker"
    (ckpt / "rng_states" / "rank0.pt").write_bytes(_torch_payload(marker))
    _reseal(ckpt)
    _expect_refused(tmp_path / "c", marker, str(ckpt / "rng_states" / "rank0.pt"), load_rng_states=True)


def test_payload_in_latest_does_not_run(tmp_path):
    _save(tmp_path / "c")
    marker = tmp_path / "marker"
    (tmp_path / "c" / "latest").write_bytes(pickle.dumps(_Payload(marker)))
    _expect_refused(tmp_path / "c", marker, str(tmp_path / "c" / "latest"))


def test_payload_in_manifest_is_just_bad_json(tmp_path):
    ckpt, marker = _save(tmp_path / "c"), tmp_path / "marker"
    (ckpt / "manifest.json").write_bytes(pickle.dumps(_Payload(marker)))
    _expect_refused(tmp_path / "c", marker, str(ckpt / "manifest.json"))


# ---- integrity ------------------------------------------------------------------------------------------


def _flip(path: Path, start: int, count: int = 64) -> None:
    data = bytearray(path.read_bytes())
    for i in range(start, min(start + count, len(data))):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def test_flipped_bytes_in_a_shard_are_an_error_naming_the_file(tmp_path):
    ckpt = _save(tmp_path)
    shard = next(ckpt.glob("*.distcp"))
    _flip(shard, shard.stat().st_size // 2)
    with pytest.raises(CheckpointError, match=str(shard)) as info:
        _load(tmp_path)
    assert "checksum" in str(info.value)
    assert isinstance(info.value, Exception)


@pytest.mark.parametrize("name", [".metadata", "engine_states.pt", "rng_states/rank0.pt"])
def test_a_changed_file_is_an_error_naming_it(tmp_path, name):
    ckpt = _save(tmp_path)
    _flip(ckpt / name, 10, 1)
    with pytest.raises(CheckpointError, match=str(ckpt / name)):
        _load(tmp_path)


def test_a_truncated_file_is_an_error_naming_it(tmp_path):
    ckpt = _save(tmp_path)
    shard = next(ckpt.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=f"{shard} has 100 bytes"):
        _load(tmp_path)


def test_missing_metadata_is_an_error(tmp_path):
    ckpt = _save(tmp_path)
    (ckpt / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=f"{ckpt}.*incomplete.*\\.metadata missing"):
        _load(tmp_path)
    with pytest.raises(CheckpointError, match="incomplete"):
        _load(tmp_path, TAG)


def test_removed_manifest_is_an_error(tmp_path):
    ckpt = _save(tmp_path)
    (ckpt / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="manifest.json"):
        _load(tmp_path)


@pytest.mark.parametrize("content", [b"", b"global_step9", b"../global_step2", b"\xff\xfe", b"latest", b"a\x00b"])
def test_bad_latest_is_an_error_naming_it(tmp_path, content):
    _save(tmp_path)
    (tmp_path / "latest").write_bytes(content)
    with pytest.raises(CheckpointError, match=str(tmp_path / ("latest" if content != b"global_step9" else ""))):
        _load(tmp_path)


def test_explicit_tag_that_does_not_exist_is_an_error(tmp_path):
    _save(tmp_path)
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'global_step9'}.*does not exist"):
        _load(tmp_path, "global_step9")
    with pytest.raises(ValueError, match="'latest' is the name of the file"):
        _load(tmp_path, "latest")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes need a POSIX system")
def test_latest_that_is_a_fifo_is_an_error_not_a_hang(tmp_path):
    os.mkfifo(tmp_path / "latest")
    with pytest.raises(CheckpointError, match="not a regular file"):
        _load(tmp_path)


def test_no_checkpoint_at_all_still_returns_nones(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="torsh.engine.checkpoint.save_load"):
        assert _load(tmp_path / "nothing") == (None, None, None)
    assert "latest" in caplog.text


def test_old_checkpoint_without_manifest_loads_and_its_dcp_errors_are_exceptions(tmp_path, caplog):
    """A checkpoint written before checksums (format 1) still loads; a broken shard in it raises CheckpointError
    (DCP's own CheckpointException is a BaseException and would pass ``except Exception``)."""
    ckpt = _save(tmp_path)
    (ckpt / "manifest.json").unlink()
    states = torch.load(ckpt / "engine_states.pt", weights_only=True)
    torch.save({**states, "format": 1}, ckpt / "engine_states.pt")
    with caplog.at_level(logging.WARNING, logger="torsh.engine.checkpoint.save_load"):
        assert _load(tmp_path)[0] == str(ckpt)
    assert "not verified" in caplog.text
    shard = next(ckpt.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=str(ckpt)):
        _load(tmp_path)


@pytest.mark.parametrize("tag", ["latest", ".hidden", "a/b", "a\\b", "..", "x\ny", " pad", "t" * 201])
def test_unsafe_tags_are_refused_at_save(tmp_path, tag):
    with pytest.raises(ValueError, match="checkpoint tag .* is not allowed"):
        _save(tmp_path, tag)
    assert not (tmp_path / "latest").exists()


def test_saving_under_latest_names_the_pointer(tmp_path):
    with pytest.raises(ValueError, match="points at the newest checkpoint"):
        _save(tmp_path, "latest")
