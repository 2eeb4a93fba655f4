"""Build kvoffload's C extensions (``[[tool.setuptools.ext-modules]]`` of pyproject.toml)
outside pip, with extra compiler and linker flags, into a folder of their own.

    python scripts/build_extensions.py --into build/sanitize --with-package \\
        --cflags "-fsanitize=address,undefined -fno-omit-frame-pointer" \\
        --ldflags "-fsanitize=address,undefined"

``--into DIR`` puts each extension at its module path under DIR (``DIR/kvoffload/...so``);
``--with-package`` first copies the Python sources of ``src/kvoffload`` there (no built
extension, no bytecode), so that ``PYTHONPATH=DIR`` imports that package, these builds
included, ahead of the editable install in ``src/`` (which stays as it is). ``--only NAME``
builds the named extensions alone. ``--inplace`` builds into ``src/`` as pip does, each
file replaced in one rename (a process importing it meanwhile sees the old or the new).

Every extension is built (``optional`` is ignored): a failure fails the script.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def extensions(cflags: list[str], ldflags: list[str], only: set[str]):
    from setuptools import Extension

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["ext-modules"]
    return [
        Extension(
            spec["name"],
            [str(ROOT / s) for s in spec["sources"]],
            depends=[str(ROOT / d) for d in spec.get("depends", [])],
            extra_compile_args=[*spec.get("extra-compile-args", []), *cflags],
            extra_link_args=ldflags,
        )
        for spec in config
        if not only or spec["name"] in only or spec["name"].rsplit(".", 1)[-1] in only
    ]


def build(exts, build_lib: Path, build_temp: Path) -> list[str]:
    from setuptools.dist import Distribution

    dist = Distribution({"name": "kvoffload", "ext_modules": exts})
    cmd = dist.get_command_obj("build_ext")
    cmd.build_lib = str(build_lib)
    cmd.build_temp = str(build_temp)
    cmd.force = True
    cmd.ensure_finalized()
    cmd.run()
    return cmd.get_outputs()


def copy_package(into: Path) -> None:
    target = into / "kvoffload"
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(
        ROOT / "src" / "kvoffload", target, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyc")
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--into", type=Path)
    where.add_argument("--inplace", action="store_true")
    parser.add_argument("--with-package", action="store_true")
    parser.add_argument("--cflags", default="")
    parser.add_argument("--ldflags", default="")
    parser.add_argument("--only", action="append", default=[])
    args = parser.parse_args(argv)
    exts = extensions(shlex.split(args.cflags), shlex.split(args.ldflags), set(args.only))
    if not exts:
        parser.error(f"no extension named {args.only}")
    if args.into:
        args.into.mkdir(parents=True, exist_ok=True)
        if args.with_package:
            copy_package(args.into)
        outputs = build(exts, args.into, args.into / ".temp")
    else:
        with tempfile.TemporaryDirectory() as tmp:
            built = build(exts, Path(tmp) / "lib", Path(tmp) / "temp")
            outputs = []
            for path in built:
                target = ROOT / "src" / Path(path).relative_to(Path(tmp) / "lib")
                staged = target.with_name(target.name + ".new")
                shutil.copy2(path, staged)
                os.replace(staged, target)
                outputs.append(str(target))
    for path in outputs:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
