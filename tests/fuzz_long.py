"""Structured fuzzing of every reader, writer, ``explain`` and ``snippet``, and of the file parsers.

Inputs are built from the dialects' real keys, not random dicts: the corpus files and migration examples of each
dialect are the seeds, the JSON Schemas in ``schemas/`` (and the launchers' flag tables) the vocabulary, and each
input is a seed with one to four mutations (a hostile value at a real key, a known key added with a value of the
wrong kind, a key dropped or misspelt, a subtree swapped in from another seed). Every successful read is written
to every dialect, read back, explained and turned into an FSDP2 snippet.

The property: nothing raises but the typed errors (``ConfigError``; ``LossyTranslationError``). The in-suite
tests (``tests/test_fuzz_*.py``) run a few hundred inputs through Hypothesis; ``make fuzz`` runs this module::

    python tests/fuzz_long.py --inputs 100000 [--timeout 10] [--dialect deepspeed ...] [--save DIR]

which reads each input in a worker process with a per-input timeout (a hang is an input that takes longer; the
worker is replaced), prints per reader the inputs, crashes and hangs, and saves crashing and hanging inputs as
regression fixtures (``tests/fixtures/fuzz_regressions/<dialect>/``, the smallest few of each crash class: the
same exception at the same place), replayed by the suite. Exit code 1 when anything crashed or hung.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import random
import shlex
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
REGRESSIONS = ROOT / "tests" / "fixtures" / "fuzz_regressions"
PARSER_FORMATS = ("json", "yaml", "toml")

# --------------------------------------------------------------------------------------------------
# vocabulary: hostile values, seeds, schema keys

INF, NAN = float("inf"), float("nan")
HOSTILE: tuple[Any, ...] = (
    0, -1, -5, 1, 2, 3, 7, 16, 64, 2000, 10**9, 10**11, 10**30, 2**64, -(10**30),
    0.0, 0.5, 2.0, 1.5, -0.5, 1e-300, 1e9, 1e30, 1e200, -1e30, INF, -INF, NAN,
    "", " ", "x", "abc", "auto", "none", "None", "null", "true", "false", "yes", "0", "1", "-1", "2.0", "1e200",
    "inf", "nan", "NaN", "$X", "${X:-1}", "<n>", "{n}", "a" * 300, "full_shard", "FULL_SHARD", "HYBRID_SHARD",
    "bf16", "fp16", "fp32", "cpu", "nvme", "torch.bfloat16", "/dev/zero", "a:b:c", "host:1e30", "h1:-1,h2:0",
    True, False, None, [], {}, [1], ["x"], [None], [["full_shard"]], [NAN, 8], [0, 8], [2, 4, 8], [-3, 0.5],
    {"a": 1}, {"enabled": "auto"}, {"enabled": True}, {"device": "cpu"}, {"x": {"y": {"z": [1, {"w": None}]}}},
)  # fmt: skip
DIALECT_DIRS = {"corpus", "migration_examples"}


@cache
def _adapters():
    from torsh import adapters

    return adapters


def readers() -> list[str]:
    """Every registered dialect."""
    return _adapters().names()


@cache
def seeds(dialect: str) -> tuple[Any, ...]:
    """Real inputs of a dialect: corpus files and migration examples (their parsed data; command lines for launch)."""
    if dialect == "launch":
        return tuple(_launch_seeds())
    adapters = _adapters()
    from torsh.errors import ConfigError
    from torsh.formats import load_file

    found: list[Any] = []
    for path in sorted(_seed_files()):
        try:
            data, _ = load_file(path)
            sniffed = adapters.sniff(data)
        except ConfigError:
            continue
        family = {"fsdp1": "fsdp", "fsdp2": "fsdp"}
        if sniffed == dialect or family.get(dialect) == family.get(sniffed, sniffed):
            found.append(data)
    if not found:  # a dialect without real files: an empty mapping, grown from the schema by the mutations
        found.append({})
    return tuple(found)


def _seed_files() -> list[Path]:
    files = list((ROOT / "tests" / "fixtures" / "corpus").rglob("*"))
    files += list((ROOT / "migration_examples").rglob("*"))
    suffixes = {".json", ".yaml", ".yml", ".toml", ".conf", ".hjson"}
    return [p for p in files if p.is_file() and p.suffix in suffixes and p.stat().st_size < 200_000]


def _launch_seeds() -> list[dict]:
    lines = json.loads((ROOT / "tests" / "fixtures" / "corpus" / "launch" / "lines.json").read_text())
    commands = [entry["command"] for entry in lines]
    for script in (ROOT / "migration_examples" / "launch").glob("*.sh"):
        text = script.read_text().replace("\\\n", " ")
        commands += [line.strip() for line in text.splitlines()
                     if line.strip().split(" ")[:1] in (["torchrun"], ["deepspeed"], ["horovodrun"], ["mpirun"])]
    hostfiles = [p.read_text() for p in (ROOT / "tests" / "fixtures" / "corpus" / "launch").glob("*hostfile*")]
    return [{"command": c, "hostfile": None} for c in commands] + [
        {"command": "deepspeed --hostfile hostfile train.py", "hostfile": h} for h in hostfiles]


@cache
def schema_keys(dialect: str) -> tuple[tuple[tuple[str, ...], dict], ...]:
    """Every (key path, sub-schema) a dialect's JSON Schema describes (object properties, recursively)."""
    from torsh import schemas

    schema = schemas.load(dialect) if dialect != "launch" else None
    if schema is None:
        return ()
    out: list[tuple[tuple[str, ...], dict]] = []
    defs = schema.get("$defs", {})

    def resolve(node: dict) -> dict:
        ref = node.get("$ref", "")
        return defs.get(ref.rsplit("/", 1)[-1], node) if ref.startswith("#/$defs/") else node

    def walk(node: Any, path: tuple[str, ...], depth: int) -> None:
        if not isinstance(node, dict) or depth > 6:
            return
        node = resolve(node)
        for alternative in node.get("anyOf", []) + node.get("oneOf", []) + node.get("allOf", []):
            walk(alternative, path, depth + 1)
        for key, sub in (node.get("properties") or {}).items():
            out.append(((*path, key), resolve(sub) if isinstance(sub, dict) else {}))
            walk(sub, (*path, key), depth + 1)

    walk(schema, (), 0)
    return tuple(out)


@cache
def launch_flags() -> dict[str, list[tuple[str, int]]]:
    from torsh.adapters import _cmdline

    return {launcher: [(flag, nargs) for flag, (_, nargs) in table.items()]
            for launcher, table in _cmdline.LAUNCHER_FLAGS.items()}  # fmt: skip


# --------------------------------------------------------------------------------------------------
# generation


def value_for(schema: dict, rnd: random.Random) -> Any:
    """A value for a key: often one the schema allows (an enum member, a number of the right kind), else hostile."""
    choice = rnd.random()
    if choice < 0.35:
        enum = schema.get("enum") or [a.get("const") for a in schema.get("anyOf", []) if "const" in a]
        if enum:
            return copy.deepcopy(rnd.choice(enum))
        kind = schema.get("type")
        kinds = kind if isinstance(kind, list) else [kind]
        if "integer" in kinds:
            return rnd.choice([0, 1, 2, 8, -1, 10**6, 10**12, 2**63])
        if "number" in kinds:
            return rnd.choice([0.0, 1e-8, 0.5, 1.0, 3.0, 1e6, -1.0, 1e300])
        if "boolean" in kinds:
            return rnd.random() < 0.5
        if "string" in kinds:
            return rnd.choice(["", "auto", "x", "cpu", "bf16", "none"])
    return copy.deepcopy(rnd.choice(HOSTILE))


def _paths(data: Any, prefix: tuple = ()) -> list[tuple]:
    out = []
    if isinstance(data, dict):
        for key, value in data.items():
            out.append((*prefix, key))
            out += _paths(value, (*prefix, key))
    elif isinstance(data, list):
        for i, value in enumerate(data[:8]):
            out.append((*prefix, i))
            out += _paths(value, (*prefix, i))
    return out


def _get(data: Any, path: tuple) -> Any:
    for part in path:
        data = data[part]
    return data


def _set(data: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    if not isinstance(data, (dict, list)):
        data = {}
    node = data
    for part in path:
        if isinstance(node, list) and not (isinstance(part, int) and part < len(node)):
            return data  # a key path that runs into a list: leave the input as it is
    for part in path[:-1]:
        child = node[part] if isinstance(node, list) else node.get(part)
        if not isinstance(child, (dict, list)):
            child = {}
            node[part] = child
        node = child
        if isinstance(node, list) and not (isinstance(path[-1], int) and path[-1] < len(node)):
            return data
    node[path[-1]] = value
    return data


def mutate(data: Any, dialect: str, rnd: random.Random) -> Any:
    """One structured mutation of parsed config data."""
    keys = schema_keys(dialect)
    paths = _paths(data)
    op = rnd.randrange(8)
    if op in (0, 1) and paths:  # a hostile or schema value at a real key of the seed
        path = rnd.choice(paths)
        schema = dict(keys).get(tuple(str(p) for p in path), {}) if keys else {}
        return _set(data, path, value_for(schema, rnd))
    if op in (2, 3) and keys:  # a known key of the dialect, set (creating its parents)
        path, schema = rnd.choice(keys)
        if not isinstance(data, dict):
            data = {}
        return _set(data, path, value_for(schema, rnd))
    if op == 4 and paths:  # drop a key
        path = rnd.choice(paths)
        parent = _get(data, path[:-1])
        if isinstance(parent, dict):
            parent.pop(path[-1], None)
        elif isinstance(parent, list) and path[-1] < len(parent):
            parent.pop(path[-1])
        return data
    if op == 5 and paths:  # wrap a value in a list or a mapping, or turn it into text
        path = rnd.choice(paths)
        value = _get(data, path)
        return _set(data, path, rnd.choice([[value], {"value": value}, str(value), [[value]]]))
    if op == 6 and paths:  # misspell a key
        path = rnd.choice(paths)
        parent = _get(data, path[:-1])
        if isinstance(parent, dict) and isinstance(path[-1], str) and path[-1]:
            key = path[-1]
            cut = rnd.randrange(len(key))
            parent[key[:cut] + key[cut + 1:] or "k"] = parent.pop(key)
        return data
    if op == 7:  # a subtree of another seed of the same dialect
        other = rnd.choice(seeds(dialect))
        other_paths = _paths(other)
        if other_paths and paths:
            donor = rnd.choice(other_paths)
            return _set(data, rnd.choice(paths)[:-1] + donor[-1:], copy.deepcopy(_get(other, donor)))
    if isinstance(data, dict) and keys:
        path, schema = rnd.choice(keys)
        return _set(data, path, value_for(schema, rnd))
    return data


def generate(dialect: str, rnd: random.Random) -> Any:
    """One fuzz input for a dialect's reader."""
    if dialect == "launch":
        return generate_launch(rnd)
    data = copy.deepcopy(rnd.choice(seeds(dialect)))
    if rnd.random() < 0.1:
        data = {}
    # Half the inputs carry a single mutation of a real (mostly valid) file: they get past validation and reach
    # the code behind it, where one bad value at one key is what crashes.
    for _ in range(1 if rnd.random() < 0.5 else rnd.randint(2, 4)):
        data = mutate(data, dialect, rnd)
    if rnd.random() < 0.03:
        data = copy.deepcopy(rnd.choice(HOSTILE))  # not a mapping at all
    return data


def generate_launch(rnd: random.Random) -> dict:
    """A launch command (string or argv) and maybe a hostfile, mutated from real command lines and hostfiles."""
    seed = rnd.choice(seeds("launch"))
    try:
        tokens = shlex.split(seed["command"])
    except ValueError:
        tokens = seed["command"].split()
    hostfile = seed["hostfile"]
    launcher = next((t for t in tokens if t in launch_flags()), "torchrun")
    for _ in range(rnd.randint(1, 4)):
        op = rnd.randrange(6)
        at = rnd.randrange(1, len(tokens) + 1) if tokens else 0
        if op in (0, 1):  # a known flag of the launcher with a value
            flag, nargs = rnd.choice(launch_flags()[launcher])
            values = [str(rnd.choice(HOSTILE)) for _ in range(nargs)]
            tokens[at:at] = [flag, *values] if rnd.random() < 0.8 or nargs != 1 else [f"{flag}={values[0]}"]
        elif op == 2 and len(tokens) > 1:  # a flag's value replaced
            i = rnd.randrange(1, len(tokens))
            tokens[i] = str(rnd.choice(HOSTILE))
        elif op == 3 and len(tokens) > 1:
            del tokens[rnd.randrange(1, len(tokens))]
        elif op == 4:
            tokens[at:at] = [rnd.choice(["A=1", "NCCL_DEBUG=INFO", "python", "-m", "--", ";", "|", "&&", "$X"])]
        else:
            lines = (hostfile or "node1 slots=8\n").splitlines() or ["node1"]
            lines[rnd.randrange(len(lines))] = rnd.choice([
                "node1 slots=1e30", "node2 slots=-1", "node3 slots=abc", "slots=4", "node4 slots=0",
                "node5 max_slots=2", "node6:1e30", "# c", "", "node7 slots=2 slots=3", "\x00",
                "node8 slots=" + "9" * 40,
            ])  # fmt: skip
            hostfile = "\n".join(lines) + "\n"
    command: Any = tokens if rnd.random() < 0.3 else " ".join(shlex.quote(t) for t in tokens)
    return {"command": command, "hostfile": hostfile}


def mutate_text(text: str, rnd: random.Random) -> str:
    """Character-level damage of a config file's text (for the parsers)."""
    pieces = ["[", "]", "{", "}", ",", ":", "\n", " ", "#", "//", "&a ", "*a", "<<: *a", "NaN", "Infinity", "1e999",
              "-", '"', "'", "\\", "\t", "!!python/object:os.system", "---", "...", "= ", "[[x]]", "0x", "\x00", "é"]
    for _ in range(rnd.randint(1, 6)):
        if not text:
            text = rnd.choice(pieces)
            continue
        i = rnd.randrange(len(text))
        op = rnd.randrange(4)
        if op == 0:
            text = text[:i] + rnd.choice(pieces) + text[i:]
        elif op == 1:
            text = text[:i] + text[i + rnd.randint(1, 20):]
        elif op == 2:
            j = min(len(text), i + rnd.randint(1, 200))
            text = text[:j] + text[i:j] * rnd.randint(1, 5) + text[j:]
        else:
            text = text[:i] + rnd.choice(pieces) * rnd.randint(1, 300) + text[i:]
    return text


@cache
def parser_seeds() -> tuple[tuple[str, str], ...]:
    """(format, text) of every seed file, and every seed dumped in the other formats."""
    from torsh.formats import dump_text, format_for

    out = []
    for path in _seed_files():
        fmt = format_for(path) or "json"
        out.append((fmt, path.read_text(encoding="utf-8", errors="replace")))
    return tuple(out) + tuple(("yaml", dump_text(d, "yaml")) for d in seeds("deepspeed")[:3])


# --------------------------------------------------------------------------------------------------
# checking


@dataclass
class Crash:
    """One exception that is not a typed config error."""

    dialect: str
    stage: str
    """read, write:<target>[:<version>], reread:<target>, explain, snippet, parse:<format>."""
    exception: str
    """Exception class name."""
    message: str
    where: str
    """Innermost frame inside the project (file:line)."""
    input: Any

    @property
    def key(self) -> tuple[str, str, str, str]:
        """What identifies a crash class: dialect, stage kind, exception and where."""
        return self.dialect, self.stage.split(":")[0], self.exception, self.where.rsplit(":", 1)[0]


def _typed_errors() -> tuple[type[BaseException], ...]:
    from torsh.errors import ConfigError
    from torsh.translate import LossyTranslationError

    return ConfigError, LossyTranslationError


def _where(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    inside = [f for f in frames if str(ROOT) in f.filename and not any(
        part in f.filename for part in ("/tests/", "/.venv/", "site-packages"))]
    frame = (inside or frames or [None])[-1]
    if frame is None:
        return "?"
    name = frame.filename.replace(str(ROOT) + "/", "")
    return f"{name}:{frame.lineno}"


def _call(crashes: list[Crash], dialect: str, stage: str, raw: Any, fn, *args, **kwargs) -> Any:
    try:
        return fn(*args, **kwargs)
    except _typed_errors():
        return None
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - anything else is a crash to report
        crashes.append(Crash(dialect, stage, type(exc).__name__, str(exc)[:300], _where(exc), raw))
        return None


def _writer_targets() -> list[tuple[str, str | None]]:
    adapters = _adapters()
    targets: list[tuple[str, str | None]] = [(name, None) for name in readers()]
    for name in readers():
        versions = getattr(adapters.get(name), "VERSIONS", ()) or ()
        targets += [(name, v) for v in list(versions)[1:] if name in ("launch", "accelerate", "fsdp")]
    return targets


def read_input(dialect: str, raw: Any):
    """Read one fuzz input with the dialect's reader (launch inputs carry their hostfile)."""
    adapters = _adapters()
    if dialect == "launch":
        return adapters.get("launch").read(raw["command"], hostfile=raw["hostfile"])
    return adapters.read(raw, dialect)


def check_input(dialect: str, raw: Any, *, writers: bool = True, world_size: int = 2) -> list[Crash]:
    """Every crash of one input: read, then (on success) write to every dialect, read back, explain, snippet."""
    crashes: list[Crash] = []
    translation = _call(crashes, dialect, "read", raw, read_input, dialect, copy.deepcopy(raw))
    if translation is None or not writers:
        return crashes
    cfg = translation.result
    adapters = _adapters()
    for target, version in _writer_targets():
        stage = f"write:{target}" + (f":{version}" if version else "")
        written = _call(crashes, dialect, stage, raw, adapters.write, cfg, target, version=version)
        if written is None:
            continue
        back = str(written.result) if target == "launch" else written.result
        reread_as = version if target == "fsdp" and version else target
        _call(crashes, dialect, f"reread:{target}" + (f":{version}" if version else ""), raw,
              adapters.read, back, reread_as)  # fmt: skip
    from torsh.adapters.fsdp import snippet
    from torsh.contract import explain

    _call(crashes, dialect, "explain", raw, explain, cfg, world_size)
    _call(crashes, dialect, "snippet", raw, snippet, cfg)
    return crashes


def check_text(fmt: str, text: str) -> list[Crash]:
    """Crashes of the file parser on one text."""
    from torsh.formats import parse_text

    crashes: list[Crash] = []
    _call(crashes, f"parse-{fmt}", f"parse:{fmt}", text, parse_text, text, fmt)
    return crashes


# --------------------------------------------------------------------------------------------------
# regression fixtures


def encode(value: Any) -> Any:
    """Input data as JSON: a mapping with keys that are not strings becomes ``{"__pairs__": [[key, value], ...]}``."""
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {k: encode(v) for k, v in value.items()}
        return {"__pairs__": [[encode(k), encode(v)] for k, v in value.items()]}
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in value]
    return value


def decode(value: Any) -> Any:
    """The inverse of :func:`encode`."""
    if isinstance(value, dict):
        if set(value) == {"__pairs__"}:
            return {_hashable(decode(k)): decode(v) for k, v in value["__pairs__"]}
        return {k: decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode(v) for v in value]
    return value


def _hashable(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key


def fixture_name(crash: Crash) -> str:
    text = json.dumps([crash.stage, encode(crash.input)], default=repr)
    digest = hashlib.sha256(text.encode()).hexdigest()
    return f"{crash.stage.replace(':', '-')}-{crash.exception}-{digest[:10]}.json"


def save_fixture(crash: Crash, folder: Path = REGRESSIONS) -> Path:
    """Keep a crashing input (JSON; NaN and infinity written as Python's json writes them)."""
    path = folder / crash.dialect / fixture_name(crash)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        path.write_text(json.dumps({**asdict(crash), "input": encode(crash.input)}, indent=1, default=repr) + "\n")
    return path


#: Fixtures kept per crash class (dialect, stage, exception, place): the smallest inputs. One class is one bug;
#: thousands of inputs hitting the same line add replay time, not coverage.
KEEP_PER_CLASS = 3


def prune_fixtures(folder: Path = REGRESSIONS, keep: int = KEEP_PER_CLASS) -> int:
    """Keep the ``keep`` smallest fixtures of each crash class; returns how many files were removed."""
    classes: dict[tuple, list[Path]] = {}
    for path in folder.glob("*/*.json"):
        data = json.loads(path.read_text())
        key = (data["dialect"], data["stage"], data["exception"], data["where"])
        classes.setdefault(key, []).append(path)
    removed = 0
    for paths in classes.values():
        for path in sorted(paths, key=lambda p: (p.stat().st_size, p.name))[keep:]:
            path.unlink()
            removed += 1
    return removed


def load_fixtures(folder: Path = REGRESSIONS) -> list[Crash]:
    out = []
    for path in sorted(folder.glob("*/*.json")):
        data = json.loads(path.read_text())
        out.append(Crash(**{**data, "input": decode(data["input"])}))
    return out


def replay(crash: Crash) -> list[Crash]:
    """Run a saved input again through the stage it crashed in (a read, or a read followed by the rest)."""
    if crash.dialect.startswith("parse-"):
        return check_text(crash.dialect.removeprefix("parse-"), crash.input)
    return check_input(crash.dialect, crash.input, writers=crash.stage != "read")


# --------------------------------------------------------------------------------------------------
# the long run


def _worker(conn) -> None:  # pragma: no cover - runs in a child process
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        job = conn.recv()
        if job is None:
            return
        kind, dialect, payload = job
        crashes = check_text(dialect, payload) if kind == "text" else check_input(dialect, payload)
        conn.send([asdict(c) for c in crashes])


class Runner:
    """Runs inputs in a worker process, replacing it when one input takes longer than ``timeout`` seconds."""

    def __init__(self, timeout: float):
        import multiprocessing

        self.ctx = multiprocessing.get_context("fork" if sys.platform != "win32" else "spawn")
        self.timeout = timeout
        self.process = None
        self.conn = None

    def _start(self) -> None:
        parent, child = self.ctx.Pipe()
        self.process = self.ctx.Process(target=_worker, args=(child,), daemon=True)
        self.process.start()
        self.conn = parent

    def run(self, kind: str, dialect: str, payload: Any) -> list[Crash] | None:
        """The crashes of one input, or None when it hung."""
        if self.process is None or not self.process.is_alive():
            self._start()
        self.conn.send((kind, dialect, payload))
        if self.conn.poll(self.timeout):
            try:
                return [Crash(**c) for c in self.conn.recv()]
            except EOFError:  # the worker died (e.g. memory exhausted): a crash of its own kind
                self._stop()
                return [Crash(dialect, "process", "WorkerDied", "the worker process exited", "?", payload)]
        self._stop()
        return None

    def _stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.join()
        self.process = None

    def close(self) -> None:
        if self.process is not None and self.process.is_alive():
            self.conn.send(None)
            self.process.join(5)
        self._stop()


def long_run(dialects: list[str], inputs: int, timeout: float, seed: int, save: Path | None,
             parsers: bool = True) -> dict[str, dict[str, int]]:  # fmt: skip
    """Fuzz each reader (and the parsers) with ``inputs`` inputs; returns per target its counts."""
    runner = Runner(timeout)
    results: dict[str, dict[str, int]] = {}
    targets = [("input", d) for d in dialects] + ([("text", f) for f in PARSER_FORMATS] if parsers else [])
    try:
        for kind, name in targets:
            rnd = random.Random(f"{seed}-{name}")
            counts = {"inputs": 0, "crashes": 0, "hangs": 0, "classes": 0}
            classes: set = set()
            started = time.monotonic()
            for _ in range(inputs):
                if kind == "text":
                    fmt, text = rnd.choice(parser_seeds())
                    payload = mutate_text(text, rnd)
                    crashes = runner.run("text", name, payload)
                else:
                    payload = generate(name, rnd)
                    crashes = runner.run("input", name, payload)
                counts["inputs"] += 1
                if crashes is None:
                    counts["hangs"] += 1
                    crashes = [Crash(name if kind == "input" else f"parse-{name}", "hang", "Timeout",
                                     f"over {timeout} s", "?", payload)]  # fmt: skip
                else:
                    counts["crashes"] += bool(crashes)
                for crash in crashes:
                    if crash.key not in classes:
                        classes.add(crash.key)
                        print(f"  new: {crash.dialect} {crash.stage} {crash.exception} at {crash.where}: "
                              f"{crash.message[:120]}", flush=True)  # fmt: skip
                    if save is not None:
                        try:
                            save_fixture(crash, save)
                        except (TypeError, ValueError, OSError) as exc:  # keep fuzzing; say what was not kept
                            print(f"  not saved ({exc}): {crash.input!r:.200}", flush=True)
            counts["classes"] = len(classes)
            results[name] = counts
            print(f"{name:<12} inputs {counts['inputs']:>7}  crashes {counts['crashes']:>6}  hangs {counts['hangs']:>4}"
                  f"  crash classes {counts['classes']:>3}  ({time.monotonic() - started:.0f} s)", flush=True)
    finally:
        runner.close()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inputs", type=int, default=100_000, help="inputs per reader and per parser")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds before an input counts as a hang")
    parser.add_argument("--dialect", action="append", help="fuzz only these readers (repeatable)")
    parser.add_argument("--no-parsers", action="store_true", help="skip the JSON/YAML/TOML parsers")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", type=Path, default=REGRESSIONS, help="folder for crashing inputs")
    parser.add_argument("--no-save", action="store_true", help="do not keep crashing inputs")
    args = parser.parse_args(argv)
    dialects = args.dialect or readers()
    results = long_run(dialects, args.inputs, args.timeout, args.seed, None if args.no_save else args.save,
                       parsers=not args.no_parsers)  # fmt: skip
    if not args.no_save:
        prune_fixtures(args.save)
    total = {k: sum(r[k] for r in results.values()) for k in ("inputs", "crashes", "hangs")}
    print(f"total        inputs {total['inputs']:>7}  crashes {total['crashes']:>6}  hangs {total['hangs']:>4}")
    return 1 if total["crashes"] or total["hangs"] else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "tests"))
    sys.exit(main())
