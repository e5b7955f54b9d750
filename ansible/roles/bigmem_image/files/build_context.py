#!/usr/bin/env python3
"""Hash, or pack into a reproducible tar, the image's build context (runs on the controller).

    build_context.py ROOT PATH... [--optional PATH...] [--tar OUT]

Prints the SHA-256 over the relative paths, modes and contents of the files under the given paths
(folders recursively; caches and bytecode skipped). With --tar, also writes those files to OUT as a
tar with fixed owners and times, so the same context gives the same bytes (and Ansible's copy is a no-op).
A missing PATH is an error; a missing --optional PATH is skipped.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tarfile
from pathlib import Path

SKIP_DIRS = {"__pycache__", ".pytest_cache", ".mypy_cache", ".git"}
SKIP_SUFFIXES = (".pyc", ".pyo")


def context_files(root: Path, paths: list[str], optional: list[str]) -> list[Path]:
    files: set[Path] = set()
    for name in paths + optional:
        top = root / name
        if not top.exists() and not top.is_symlink():
            if name in optional:
                continue
            raise SystemExit(f"build context: {top} does not exist")
        if top.is_dir() and not top.is_symlink():
            for folder, dirs, names in os.walk(top):
                dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info"))
                # A symlinked folder (src/bigmem_train/templates -> ../../templates) is kept as a link.
                files.update(Path(folder, d) for d in dirs if Path(folder, d).is_symlink())
                files.update(Path(folder, n) for n in names if not n.endswith(SKIP_SUFFIXES))
        else:
            files.add(top)
    return sorted(path.relative_to(root) for path in files)


def context_hash(root: Path, files: list[Path]) -> str:
    digest = hashlib.sha256()
    for relative in files:
        path = root / relative
        digest.update(str(relative).encode() + b"\0")
        if path.is_symlink():
            digest.update(b"L" + os.readlink(path).encode())
        else:
            digest.update(b"X" if os.access(path, os.X_OK) else b"F")
            digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def write_tar(root: Path, files: list[Path], out: Path) -> None:
    def normalize(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = "root"
        info.mtime = 0
        info.mode = 0o755 if info.isdir() or info.mode & 0o100 else 0o644
        return info

    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial")
    with tarfile.open(partial, "w", format=tarfile.PAX_FORMAT) as tar:
        for relative in files:
            tar.add(root / relative, arcname=str(relative), recursive=False, filter=normalize)
    partial.replace(out)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path)
    parser.add_argument("paths", nargs="+")
    parser.add_argument("--optional", nargs="*", default=[])
    parser.add_argument("--tar", type=Path)
    args = parser.parse_args(argv)
    root = args.root.resolve()
    files = context_files(root, args.paths, args.optional)
    print(context_hash(root, files))
    if args.tar:
        write_tar(root, files, args.tar)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
