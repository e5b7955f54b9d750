#!/usr/bin/env python3
"""The image's build context: its SHA-256, and a reproducible tar of it. The one definition of both,
used by docker/build-image.sh and by the Ansible role bigmem_image (which runs it on the controller).

    build_context.py [ROOT] [--tar OUT]

Prints the SHA-256 over the relative paths, modes and contents of the context's files (CONTEXT_PATHS,
folders recursively, what .dockerignore drops skipped). The image carries it as the label
org.bigmem-train.context-sha256, so any tool finds an image built from the same files. With --tar, also
writes those files and the wheelhouse (PACKED_ONLY, when present) to OUT as a tar with fixed owners and
times, so the same context gives the same bytes. ROOT defaults to the repository this script is in.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tarfile
import tempfile
from pathlib import Path

# What docker/Dockerfile copies (the files .dockerignore lets through), the base image's script, and
# this script (so a copy of the context can hash and pack itself).
CONTEXT_PATHS = (
    "pyproject.toml",
    "README.md",
    "src",
    "templates",
    ".dockerignore",
    "docker/Dockerfile",
    "docker/requirements.lock",
    "docker/build-base-image.sh",
    "docker/build_context.py",
)
# Sent with the context when present but not hashed: the wheelhouse holds exactly the wheels whose
# hashes docker/requirements.lock pins (pip installs with --require-hashes), so the lock stands for it.
PACKED_ONLY = (".whl",)
SKIP_DIRS = {"__pycache__", ".pytest_cache", ".mypy_cache", ".git"}
SKIP_SUFFIXES = (".pyc", ".pyo")


def context_files(
    root: Path, paths: tuple[str, ...] = CONTEXT_PATHS, optional: tuple[str, ...] = ()
) -> list[Path]:
    """The files under PATHS (a missing one is an error) and OPTIONAL (a missing one is skipped), sorted."""
    files: set[Path] = set()
    for name in paths + optional:
        top = root / name
        if not top.exists() and not top.is_symlink():
            if name in optional:
                continue
            raise SystemExit(f"build_context.py: {top} does not exist (is {root} the repository root?)")
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
    # A private partial file: several hosts of one play may pack the same context at the same time.
    handle, partial = tempfile.mkstemp(dir=out.parent, prefix=out.name + ".", suffix=".partial")
    try:
        with (
            os.fdopen(handle, "wb") as raw,
            tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar,
        ):
            for relative in files:
                tar.add(root / relative, arcname=str(relative), recursive=False, filter=normalize)
        os.chmod(partial, 0o644)
        os.replace(partial, out)
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, nargs="?", default=Path(__file__).resolve().parents[1])
    parser.add_argument("--tar", type=Path, help="also write the context (and the wheelhouse) to this tar")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    print(context_hash(root, context_files(root)))
    if args.tar:
        write_tar(root, context_files(root, optional=PACKED_ONLY), args.tar)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
