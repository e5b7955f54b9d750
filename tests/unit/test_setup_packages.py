"""scripts/setup.sh and scripts/apt-packages.txt: each README command finds the tools it runs installed."""

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def packages(*options: str) -> set[str]:
    """The Debian packages ``bash scripts/setup.sh OPTIONS`` installs, read with setup.sh's own awk program."""
    setup = (REPO / "scripts" / "setup.sh").read_text()
    sections = {"": "kit", "--ops": "kit ops", "--test": "kit ops test"}[" ".join(options)]
    program = setup.split('awk -v wanted=" $sections " \'', 1)[1].split("'", 1)[0]
    result = subprocess.run(
        ["awk", "-v", f"wanted= {sections} ", program, str(REPO / "scripts" / "apt-packages.txt")],
        capture_output=True,
        text=True,
        check=True,
    )
    return set(result.stdout.split())


def test_setup_ops_installs_what_building_the_image_runs():
    """`setup.sh --ops` then `docker/build-image.sh` on an offline machine failed with "debootstrap: command
    not found": the base image's builder came only with --test."""
    ops = packages("--ops")
    assert "docker.io" in ops
    assert "mmdebstrap" in ops and "debian-archive-keyring" in ops
    assert packages("--ops") <= packages("--test")


def test_base_image_without_a_bootstrapper_says_what_installs_it(tmp_path):
    """Without mmdebstrap or debootstrap the script stops at once with the setup command, not deep inside."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text("#!/bin/sh\nexit 1\n")  # no base image yet
    (bin_dir / "docker").chmod(0o755)
    for tool in ("id", "mktemp", "rm", "date"):
        (bin_dir / tool).symlink_to(
            f"/usr/bin/{tool}" if Path(f"/usr/bin/{tool}").exists() else f"/bin/{tool}"
        )
    result = subprocess.run(
        ["/bin/bash", str(REPO / "docker" / "build-base-image.sh")],
        capture_output=True,
        text=True,
        env={**os.environ, "PATH": str(bin_dir)},
    )
    assert result.returncode == 2, result.stderr
    assert "debootstrap is not installed" in result.stderr and "setup.sh --ops" in result.stderr
