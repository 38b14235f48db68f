"""Hostile config files are refused quickly with a ConfigError: wrong file kinds, size, depth, alias bombs, numbers.

Every limit of ``torsh.formats`` has its hostile input here; each must fail fast (a timer guards the ones that used
to block or take minutes) and never with anything but ``ConfigError``.
"""

import os
import socket
import threading
import time

import pytest

from torsh import formats
from torsh.errors import ConfigError
from torsh.formats import MAX_ALIAS_NODES, MAX_BYTES, MAX_DEPTH, load_document, load_file, parse_text


def refused_quickly(call, needle: str, seconds: float = 5.0) -> str:
    """Run ``call`` in a thread; it must raise ConfigError containing ``needle`` within ``seconds``."""
    outcome: dict = {}

    def target():
        try:
            outcome["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - reported below
            outcome["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s (blocked or unbounded)"
    assert "error" in outcome, f"accepted: {outcome.get('value')!r:.200}"
    assert isinstance(outcome["error"], ConfigError), repr(outcome["error"])
    message = str(outcome["error"])
    assert needle in message, message
    assert time.monotonic() - started < seconds
    return message


# ---- file kinds and size


def test_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "ds_config.json"
    os.mkfifo(fifo)
    refused_quickly(lambda: load_file(fifo), "named pipe")


def test_character_device_is_refused_without_reading_it():
    refused_quickly(lambda: load_file("/dev/zero"), "character device")


def test_directory_is_refused(tmp_path):
    refused_quickly(lambda: load_file(tmp_path), "is a directory")


def test_socket_is_refused(tmp_path):
    path = tmp_path / "s.json"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind(str(path))
    except OSError as exc:  # pragma: no cover - a file system without sockets
        pytest.skip(f"cannot create a unix socket here: {exc}")
    try:
        refused_quickly(lambda: load_file(path), "socket")
    finally:
        server.close()


def test_missing_file_names_the_path(tmp_path):
    message = refused_quickly(lambda: load_file(tmp_path / "nope.json"), "no such file")
    assert "nope.json" in message


def test_file_over_the_size_limit_is_refused_with_the_limit_named(tmp_path):
    path = tmp_path / "big.json"
    with open(path, "wb") as handle:
        handle.truncate(MAX_BYTES + 1)  # sparse: no disk used
    message = refused_quickly(lambda: load_file(path), "10 MiB")
    assert "limit" in message


def test_text_over_the_size_limit_is_refused():
    refused_quickly(lambda: parse_text(" " * (MAX_BYTES + 1), "json"), "limit")


def test_size_limit_holds_for_a_file_growing_after_stat(tmp_path, monkeypatch):
    """The read itself is bounded (``st_size`` can lie, e.g. for /proc files): at most limit + 1 bytes are read."""
    path = tmp_path / "c.json"
    path.write_text('{"a": "' + "x" * 200 + '"}')
    with pytest.raises(ConfigError, match="limit"):
        formats.read_text(path, limit=100)


def test_symlink_to_a_regular_file_is_read(tmp_path):
    target = tmp_path / "real.json"
    target.write_text('{"train_batch_size": 8}')
    link = tmp_path / "link.json"
    link.symlink_to(target)
    assert load_file(link) == ({"train_batch_size": 8}, "json")


def test_symlink_to_a_device_is_refused(tmp_path):
    link = tmp_path / "zero.json"
    link.symlink_to("/dev/zero")
    refused_quickly(lambda: load_file(link), "character device")


def test_invalid_utf8_is_a_config_error(tmp_path):
    path = tmp_path / "bad.json"
    path.write_bytes(b'{"a": "\xff"}')
    refused_quickly(lambda: load_file(path), "UTF-8")


# ---- nesting depth


@pytest.mark.parametrize("fmt, make", [
    ("json", lambda n: "[" * n + "]" * n),
    ("json", lambda n: '{"a":' * n + "1" + "}" * n),
    ("json", lambda n: "{a: " + "[" * n + "]" * n + ",}"),  # hjson fallback
    ("yaml", lambda n: "[" * n + "]" * n),
    ("yaml", lambda n: "".join(" " * i + "a:\n" for i in range(min(n, 1000))) + " " * min(n, 1000) + "b: 1\n"),
    ("toml", lambda n: "a = " + "[" * n + "]" * n),
    ("toml", lambda n: "a = " + "{b = " * n + "1" + "}" * n),
])  # fmt: skip
@pytest.mark.parametrize("levels", [MAX_DEPTH + 1, 900, 5000])
def test_deep_nesting_is_refused(fmt, make, levels):
    refused_quickly(lambda: parse_text(make(levels), fmt), f"more than {MAX_DEPTH} levels")


@pytest.mark.parametrize("fmt", ["json", "yaml"])
def test_nesting_at_the_limit_is_accepted(fmt):
    data = parse_text("[" * MAX_DEPTH + "]" * MAX_DEPTH, fmt)
    for _ in range(MAX_DEPTH - 1):
        data = data[0]
    assert data == []


def test_deep_file_without_suffix_reports_the_depth_not_three_syntax_errors(tmp_path):
    path = tmp_path / "config"
    path.write_text("[" * 900 + "]" * 900)
    message = refused_quickly(lambda: load_file(path), "levels")
    assert "not valid JSON, YAML or TOML" not in message


# ---- YAML aliases


def _alias_bomb(width: int = 9, levels: int = 9) -> str:
    names = [f"l{i}" for i in range(levels)]
    lines = [f"{names[0]}: &{names[0]} [" + ", ".join(['"lol"'] * width) + "]"]
    for prev, name in zip(names, names[1:]):
        lines.append(f"{name}: &{name} [" + ", ".join([f"*{prev}"] * width) + "]")
    return "\n".join(lines) + "\n"


def test_yaml_alias_bomb_is_refused_before_construction():
    text = _alias_bomb()
    assert len(text) < 1024
    message = refused_quickly(lambda: parse_text(text, "yaml"), "aliases", seconds=2.0)
    assert f"{MAX_ALIAS_NODES:,}" in message


def test_yaml_alias_bomb_through_merge_keys_is_refused():
    lines = ["a0: &a0 {x: 1, y: 2, z: 3, w: 4, v: 5, u: 6, t: 7, s: 8}"]
    for i in range(1, 12):
        lines.append(f"a{i}: &a{i} {{p: *a{i - 1}, q: *a{i - 1}, r: *a{i - 1}, s: *a{i - 1}}}")
    refused_quickly(lambda: parse_text("\n".join(lines) + "\n", "yaml"), "aliases", seconds=2.0)


def test_recursive_yaml_alias_is_refused():
    refused_quickly(lambda: parse_text("a: &a [1, *a]\n", "yaml"), "recursive")


def test_ordinary_yaml_anchors_still_work():
    text = "base: &base {lr: 0.1, eps: 1.0e-8}\nfirst: *base\nsecond: {<<: *base, lr: 0.2}\n"
    data = parse_text(text, "yaml")
    assert data["first"] == {"lr": 0.1, "eps": 1e-8}
    assert data["second"]["lr"] == 0.2


# ---- numbers


@pytest.mark.parametrize("text, needle", [
    ('{"lr": NaN}', "NaN is not JSON"),
    ('{"lr": Infinity}', "Infinity is not JSON"),
    ('{"lr": -Infinity}', "-Infinity is not JSON"),
    ('{"lr": 1e400}', "too large"),
    ('{"lr": 1e400, // hjson\n}', "too large"),
    ('{"lr": ' + "9" * 5000 + "}", "not valid JSON"),
])  # fmt: skip
def test_non_finite_json_numbers_are_refused(text, needle):
    refused_quickly(lambda: parse_text(text, "json"), needle)


# ---- hjson note


def test_hjson_only_json_is_accepted_with_a_note(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{\n  // comment\n  "train_batch_size": 8,\n}\n')
    document = load_document(path)
    assert document.data == {"train_batch_size": 8}
    assert len(document.notes) == 1 and "json.load" in document.notes[0]
    plain = tmp_path / "plain.json"
    plain.write_text('{"train_batch_size": 8}')
    assert load_document(plain).notes == []


# ---- numbers in the core model: finite and within each field's meaningful range

from torsh.config import MAX_LOSS_SCALE, MAX_PROCESSES, TorshConfig  # noqa: E402

INF, NAN = float("inf"), float("nan")


@pytest.mark.parametrize("data, path", [
    ({"optimizer": {"lr": INF}}, "optimizer.lr"),
    ({"optimizer": {"lr": NAN}}, "optimizer.lr"),
    ({"optimizer": {"eps": INF}}, "optimizer.eps"),
    ({"optimizer": {"weight_decay": INF}}, "optimizer.weight_decay"),
    ({"optimizer": {"momentum": NAN}}, "optimizer.momentum"),
    ({"optimizer": {"betas": [NAN, 0.999]}}, "optimizer.betas.0"),
    ({"optimizer": {"betas": [0.9, -3]}}, "optimizer.betas.1"),
    ({"optimizer": {"betas": [0.9, 1.0]}}, "optimizer.betas.1"),
    ({"optimizer": {"betas": [1.5, 0.9]}}, "optimizer.betas.0"),
    ({"ddp": {"bucket_cap_mb": INF}}, "ddp.bucket_cap_mb"),
    ({"ddp": {"bucket_cap_mb": 1e300}}, "ddp.bucket_cap_mb"),
    ({"gradients": {"clip_max_norm": INF}}, "gradients.clip_max_norm"),
    ({"gradients": {"predivide_factor": NAN}}, "gradients.predivide_factor"),
    ({"communication": {"timeout_s": INF}}, "communication.timeout_s"),
    ({"communication": {"timeout_s": 1e300}}, "communication.timeout_s"),
    ({"communication": {"cycle_time_ms": NAN}}, "communication.cycle_time_ms"),
    ({"communication": {"fusion_threshold_bytes": 2**80}}, "communication.fusion_threshold_bytes"),
    ({"precision": {"loss_scaling": {"initial_scale": INF}}}, "precision.loss_scaling.initial_scale"),
    ({"precision": {"loss_scaling": {"initial_scale": 2.0**200}}}, "precision.loss_scaling.initial_scale"),
    ({"precision": {"loss_scaling": {"min_scale": NAN}}}, "precision.loss_scaling.min_scale"),
    ({"precision": {"loss_scaling": {"growth_factor": INF}}}, "precision.loss_scaling.growth_factor"),
    ({"scheduler": {"name": "WarmupLR", "warmup_max_lr": INF}}, "scheduler.warmup_max_lr"),
    ({"scheduler": {"name": "OneCycle", "cycle_min_lr": 0, "cycle_max_lr": 1, "cycle_max_mom": 1.2}},
     "scheduler.cycle_max_mom"),
    ({"sharding": {"stage": 3, "hybrid_shard_size": NAN}}, "sharding.hybrid_shard_size"),
    ({"sharding": {"stage": 3, "hybrid_shard_size": 0}}, "sharding.hybrid_shard_size"),
    ({"sharding": {"stage": 3, "hybrid_shard_size": -5}}, "sharding.hybrid_shard_size"),
    ({"launch": {"nproc_per_node": 0}}, "launch.nproc_per_node"),
    ({"launch": {"nproc_per_node": -1}}, "launch.nproc_per_node"),
    ({"launch": {"nproc_per_node": 10**6}}, "launch.nproc_per_node"),
    ({"launch": {"world_size": 10**8}}, "launch.world_size"),
    ({"launch": {"nnodes": 1e200}}, "launch.nnodes"),
    ({"launch": {"nnodes": 0}}, "launch.nnodes"),
    ({"launch": {"hosts": [{"name": "a", "slots": 1e30}]}}, "launch.hosts.0.slots"),
    ({"data": {"seed": 2**70}}, "data.seed"),
    ({"monitoring": {"profiler": {"module_depth": -5}}}, "monitoring.profiler.module_depth"),
])  # fmt: skip
def test_model_refuses_meaningless_numbers_naming_the_path(data, path):
    with pytest.raises(ConfigError) as info:
        TorshConfig.from_dict(data)
    assert path in [p.path for p in info.value.problems], str(info.value)


@pytest.mark.parametrize("data", [
    {"optimizer": {"betas": [0.0, 0.999], "lr": 0.0}},
    {"precision": {"loss_scaling": {"initial_scale": MAX_LOSS_SCALE}}},
    {"launch": {"world_size": MAX_PROCESSES, "nproc_per_node": 8, "nnodes": 2}},
    {"communication": {"timeout_s": 1800.0, "fusion_threshold_bytes": 64 * 2**20}},
    {"ddp": {"bucket_cap_mb": "auto"}, "optimizer": {"lr": "auto", "betas": "auto"}},
])  # fmt: skip
def test_model_accepts_the_edges_of_each_range(data):
    TorshConfig.from_dict(data)


@pytest.mark.parametrize("value", [NAN, INF, [1.0, -INF], {"x": NAN}])
def test_kept_keys_cannot_hold_non_finite_numbers(value):
    with pytest.raises(ConfigError, match="finite"):
        TorshConfig.from_dict({"extensions": {"deepspeed": {"some.key": value}}})


@pytest.mark.parametrize("text", ["1: x\n", "a: {2: y}\n", "yes: 1\n", "~: 1\n", "[1, 2]: 3\n"])
def test_yaml_keys_must_be_text(text):
    with pytest.raises(ConfigError, match="a key must be text"):
        parse_text(text, "yaml")


def test_quoted_yaml_keys_are_names():
    assert parse_text("'1': x\n'yes': 2\n", "yaml") == {"1": "x", "yes": 2}
