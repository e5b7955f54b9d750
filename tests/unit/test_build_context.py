"""docker/build_context.py: the one definition of the image's build context, used by
docker/build-image.sh and the Ansible role bigmem_image."""

import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "docker" / "build_context.py"


def context_copy(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    for name in (
        "pyproject.toml",
        "README.md",
        ".dockerignore",
        "docker/Dockerfile",
        "docker/requirements.lock",
        "docker/build-base-image.sh",
        "docker/build_context.py",
        "src/bigmem_train/__init__.py",
        "templates/train.yaml.j2",
    ):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, root / name)
    return root


def context_hash(root: Path, *extra: str) -> str:
    result = subprocess.run([sys.executable, str(SCRIPT), str(root), *extra], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_both_users_call_the_one_script():
    build_image = (REPO / "docker" / "build-image.sh").read_text()
    role = (REPO / "ansible" / "roles" / "bigmem_image" / "tasks" / "build.yml").read_text()
    assert '"$here/build_context.py"' in build_image and "hashlib" not in build_image
    assert role.count("/docker/build_context.py") == 2  # the hash and the tar


def test_hash_follows_content_and_ignores_caches_and_the_wheelhouse(tmp_path):
    root = context_copy(tmp_path)
    first = context_hash(root)
    assert len(first) == 64 and first == context_hash(root)
    (root / "src" / "bigmem_train" / "__pycache__").mkdir()
    (root / "src" / "bigmem_train" / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"\0")
    (root / ".whl").mkdir()
    (root / ".whl" / "a-1-py3-none-any.whl").write_bytes(b"wheel")
    assert context_hash(root) == first
    (root / "templates" / "train.yaml.j2").write_text("changed\n")
    assert context_hash(root) != first


def test_tar_is_reproducible_and_carries_the_wheelhouse(tmp_path):
    root = context_copy(tmp_path)
    (root / ".whl").mkdir()
    (root / ".whl" / "a-1-py3-none-any.whl").write_bytes(b"wheel")
    one, two = tmp_path / "one.tar", tmp_path / "two.tar"
    assert context_hash(root, "--tar", str(one)) == context_hash(root, "--tar", str(two))
    assert one.read_bytes() == two.read_bytes()
    with tarfile.open(one) as tar:
        members = {member.name: member for member in tar.getmembers()}
    assert ".whl/a-1-py3-none-any.whl" in members and "docker/build-base-image.sh" in members
    assert all(member.uid == 0 and member.mtime == 0 for member in members.values())
    assert not list(tmp_path.glob("*.partial"))


def test_a_missing_context_file_is_a_one_line_error(tmp_path):
    root = context_copy(tmp_path)
    (root / "docker" / "Dockerfile").unlink()
    result = subprocess.run([sys.executable, str(SCRIPT), str(root)], capture_output=True, text=True)
    assert result.returncode != 0
    assert result.stderr.strip().count("\n") == 0 and "docker/Dockerfile does not exist" in result.stderr
