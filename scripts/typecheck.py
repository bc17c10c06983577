"""Type-check draftsmith's rooms with mypy, through the package layout the wheel installs.

pyproject.toml maps `draftsmith.{train,models,data,eval}` onto top-level folders (`package-dir`), a
layout mypy cannot resolve from the source tree: it would see `train/loop.py` as a module `loop` and
`from draftsmith.train.config import ...` as a missing one. So this builds, from that same mapping,
a view of the package as installed (`.typecheck/draftsmith/`, symlinks into the checkout, rebuilt
every run), runs mypy on it with the settings of `[tool.mypy]`, and prints every finding under its
path in the checkout (`train/loop.py:12: error: ...`). Exit status: mypy's.

    .venv/bin/python scripts/typecheck.py
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import tomllib
from mypy import api

ROOT = Path(__file__).resolve().parents[1]
VIEW = ROOT / ".typecheck"


def build_view() -> dict[str, str]:
    """Symlink every package of pyproject's `packages` where the wheel puts it; returns the prefix
    map view path -> checkout path, longest first, to print findings where they live."""
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dir: dict[str, str] = tool["package-dir"]
    shutil.rmtree(VIEW / "draftsmith", ignore_errors=True)
    prefixes = {}
    for package in sorted(tool["packages"], key=len):
        # A package's folder: its own package-dir entry, else its parent's folder plus its last name.
        name, rest = package, []
        while name not in package_dir:
            name, _, last = name.rpartition(".")
            rest.insert(0, last)
        source = ROOT / package_dir[name] / Path(*rest)
        dest = VIEW / Path(*package.split("."))
        if dest.exists():  # already inside a symlinked parent (a subpackage in its parent's folder)
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        if package == "draftsmith":  # its folder also holds subpackages mapped elsewhere: link files only
            dest.mkdir()
            for f in source.glob("*.py"):
                (dest / f.name).symlink_to(f)
        else:
            dest.symlink_to(source, target_is_directory=True)
        prefixes[str(dest.relative_to(VIEW))] = str(source.relative_to(ROOT))
    return dict(sorted(prefixes.items(), key=lambda kv: -len(kv[0])))


def main() -> int:
    prefixes = build_view()
    os.chdir(VIEW)  # mypy finds `-p draftsmith` (and keeps its cache) here
    out, err, status = api.run(["--config-file", str(ROOT / "pyproject.toml"), "-p", "draftsmith"])
    for line in out.splitlines():
        for view, real in prefixes.items():
            if line.startswith(view + "/"):
                line = real + line[len(view) :]
                break
        print(line)
    sys.stderr.write(err)
    return status


if __name__ == "__main__":
    sys.exit(main())
