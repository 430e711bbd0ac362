"""The staging folder (pipeline/model/ec_staging.py): a failed write is not staged and leaves
nothing behind; folders of processes that are gone are swept when a replica starts. The full
/dev/shm is a real tmpfs of 1 MiB where this test may mount one (root), else a folder whose
writes fail."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from cache_service.features import Features
from pipeline.model.ec_staging import FeatureStaging, staged_name


def features(rows: int) -> Features:
    return Features({"image_embeds": torch.ones(rows, 1024, dtype=torch.float32)}, {})  # rows * 4 KiB


@pytest.fixture
def full_shm(tmp_path):
    """A folder in a 1 MiB tmpfs (else one made read-only): what a full /dev/shm looks like."""
    where = tmp_path / "shm"
    where.mkdir()
    mounted = (
        os.geteuid() == 0
        and subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)], capture_output=True
        ).returncode
        == 0
    )
    yield where, mounted
    if mounted:
        subprocess.run(["umount", str(where)], check=True)


def test_a_write_that_does_not_fit_is_not_staged_and_leaves_nothing(full_shm):
    where, mounted = full_shm
    staging = FeatureStaging(where)
    assert staging.stage("small", features(16))  # 64 KiB fits
    if not mounted:  # no tmpfs here: a folder where every write fails
        staging.dir.chmod(0o500)
    try:
        assert staging.stage("big", features(512)) is False  # 2 MiB into 1 MiB (or a read-only folder)
        assert staging.failed == 1 and staging.staged == 1
        left = sorted(p.name for p in staging.dir.iterdir())
        assert left == [staged_name("small")]  # no .partial, no file under the big key
        staging.release(["big"])  # LLMDecode releases every key it tried: harmless
        assert staging.staged == 1
    finally:
        staging.dir.chmod(0o700)
        staging.close()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder anyway")
def test_a_read_only_folder_fails_like_a_full_one(tmp_path):
    staging = FeatureStaging(tmp_path)
    staging.dir.chmod(0o500)
    try:
        assert staging.stage("k", features(1)) is False and staging.failed == 1
    finally:
        staging.dir.chmod(0o700)


def test_folders_of_dead_processes_are_swept_when_a_replica_starts(tmp_path):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    dead_pid = int(dead.stdout)
    left_behind = tmp_path / f"iris-ec-{dead_pid}-abc123"
    left_behind.mkdir()
    (left_behind / "x.irf").write_bytes(b"features of a killed replica")
    (left_behind / "y.partial").write_bytes(b"half")
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        running = tmp_path / f"iris-ec-{alive.pid}-def456"
        running.mkdir()
        old_layout = tmp_path / "iris-ec-q1w2e3"  # no pid: its owner cannot be told, kept
        old_layout.mkdir()
        other = tmp_path / "not-ours"
        other.mkdir()

        staging = FeatureStaging(tmp_path)
        assert staging.swept == [left_behind] and not left_behind.exists()
        assert running.exists() and old_layout.exists() and other.exists() and staging.dir.exists()
        assert staging.dir.name.startswith(f"iris-ec-{os.getpid()}-")
        assert FeatureStaging(tmp_path).swept == []  # this process's own folder is alive
    finally:
        alive.kill()
        alive.wait()
