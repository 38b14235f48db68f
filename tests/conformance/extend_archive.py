"""Build an extended copy of DeepSpeed's test archive: the shared archive's files plus more of ``tests/unit``.

The shared ``deepspeed-tests-edaa722.tar.gz`` holds the first 30 test files ``make conformance`` ran. This script
writes an archive of the same shape (top folder ``deepspeed-tests-edaa722/``, DeepSpeed's ``LICENSE``) with every
file of the shared one plus more test files taken from a DeepSpeed git repository at the same commit, each with
the helpers it imports (``from unit.x import ...``, relative imports, recursively) and the ``__init__.py`` of its
folders. Nothing is copied into this repository: the archive is written where ``--output`` says (by default into
``.venv/conformance/``), and ``make conformance CONFORMANCE_ARCHIVE=<it>`` runs from it.

Which files are added: every file named by a ``#file`` line of ``tests/deepspeed_unit_results.tsv`` that the shared
archive lacks, and any given with ``--files``::

    python tests/conformance/extend_archive.py --repo <DeepSpeed clone or bare git dir>
"""

from __future__ import annotations

import argparse
import ast
import io
import subprocess
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path, PurePosixPath

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from run_deepspeed import ARCHIVE, RESULTS_DIR, Expected  # noqa: E402

COMMIT = "edaa7221267243c7be7fb49c5d5f5c4fb97b4641"
TOP = "deepspeed-tests-edaa722"
OUTPUT = RESULTS_DIR / "deepspeed-tests-edaa722-extended.tar.gz"


def imported_helpers(path: str, source: str) -> set[str]:
    """Repository paths (``tests/unit/...py``) of the ``unit`` modules a test file imports, as candidates: a module
    ``unit.a.b`` may be the file ``tests/unit/a/b.py`` or the package ``tests/unit/a/b/__init__.py``."""
    here = PurePosixPath(path).parent
    names: set[tuple[str, ...]] = set()
    for node in ast.walk(ast.parse(source, filename=path)):
        if isinstance(node, ast.Import):
            names |= {tuple(alias.name.split(".")) for alias in node.names if alias.name.split(".")[0] == "unit"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the file's folder, up level - 1 folders
                base = here.parents[node.level - 2] if node.level > 1 else here
                parts = base.relative_to("tests").parts + tuple((node.module or "").split(".") if node.module else ())
            elif (node.module or "").split(".")[0] == "unit":
                parts = tuple(node.module.split("."))
            else:
                continue
            names.add(parts)
            names |= {parts + (alias.name,) for alias in node.names if alias.name != "*"}  # `import module`
    out = set()
    for parts in names:
        out.add("tests/" + "/".join(parts) + ".py")
        out.add("tests/" + "/".join(parts) + "/__init__.py")
    return out


def closure(files: list[str], read: Callable[[str], str | None]) -> dict[str, str]:
    """The files and every helper they import, recursively, with the ``__init__.py`` of their folders: path ->
    text. ``read`` gives a repository path's text at the commit, or None where there is no such file."""
    found: dict[str, str] = {}
    todo = list(files)
    while todo:
        path = todo.pop()
        if path in found:
            continue
        text = read(path)
        if text is None:
            if path in files:
                raise SystemExit(f"{path} is not in the repository at {COMMIT}")
            continue  # a candidate name that is a package, or a module, not both
        found[path] = text
        todo += sorted(imported_helpers(path, text)) if path.endswith(".py") else []
        folder = PurePosixPath(path).parent
        while folder.name and str(folder) != "tests":
            todo.append(f"{folder}/__init__.py")
            folder = folder.parent
    return found


def git_reader(repo: Path, commit: str) -> Callable[[str], str | None]:
    def read(path: str) -> str | None:
        done = subprocess.run(["git", "-C", str(repo), "cat-file", "blob", f"{commit}:{path}"], capture_output=True,
                              text=True)  # fmt: skip
        return done.stdout if done.returncode == 0 else None

    return read


def build(repo: Path, base: Path, output: Path, extra: list[str], commit: str = COMMIT) -> list[str]:
    """Write the extended archive; the repository paths added, sorted."""
    with tarfile.open(base) as tar:
        members = [(m, tar.extractfile(m).read() if m.isfile() else None) for m in tar.getmembers()]
    have = {m.name.removeprefix(TOP + "/") for m, _ in members}
    read = git_reader(repo, commit)
    wanted = [f"tests/{name}" for name in extra if f"tests/{name}" not in have]
    added = {p: t for p, t in closure(wanted, read).items() if p not in have}
    if "LICENSE" not in have:
        added["LICENSE"] = read("LICENSE")
    mtime = int(subprocess.run(["git", "-C", str(repo), "show", "-s", "--format=%ct", commit], capture_output=True,
                               text=True, check=True).stdout)  # fmt: skip
    output.parent.mkdir(parents=True, exist_ok=True)
    folders = {str(p) for path in added for p in PurePosixPath(f"{TOP}/{path}").parents if str(p) != "."}
    with tarfile.open(output, "w:gz") as tar:
        for member, data in members:
            tar.addfile(member, io.BytesIO(data) if data is not None else None)
        for folder in sorted(folders - {m.name.rstrip("/") for m, _ in members}):
            info = tarfile.TarInfo(folder)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, mtime
            tar.addfile(info)
        for path in sorted(added):
            data = added[path].encode()
            info = tarfile.TarInfo(f"{TOP}/{path}")
            info.size, info.mode, info.mtime = len(data), 0o644, mtime
            tar.addfile(info, io.BytesIO(data))
    return sorted(added)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, required=True, help="a DeepSpeed git repository holding the commit")
    parser.add_argument("--base", type=Path, default=ARCHIVE, help="the archive to extend (default: the shared one)")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    parser.add_argument("--files", nargs="*", default=[], help="more test files (unit/...) to add")
    args = parser.parse_args(argv)
    extra = [*Expected().files, *args.files]
    added = build(args.repo, args.base, args.output, extra)
    tests = [p for p in added if PurePosixPath(p).name.startswith("test_")]
    print(f"{args.output}: {len(added)} files added ({len(tests)} test files) to {args.base.name}'s")
    for path in added:
        print("  " + path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
