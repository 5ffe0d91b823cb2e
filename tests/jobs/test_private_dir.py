"""The job's private directory (its protocol file's), made without tempfile's import: as
``tempfile.mkdtemp`` makes it, and removed without following what the command left in it."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from gpusd.jobs.child import private_dir, remove_private_dir


def test_it_is_a_new_private_directory_in_the_temporary_directory(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    made = {private_dir("0123456789ab") for _ in range(20)}
    assert len(made) == 20
    for path in made:
        st = os.lstat(path)
        assert Path(path).parent == tmp_path and os.path.basename(path).startswith("gpusd-job-0123456789ab-")
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "missing"))  # not there: the next place
    assert os.path.isdir(private_dir("0123456789ab"))


def test_removing_it_follows_no_link_the_command_left(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "data").write_text("keep")
    path = private_dir("0123456789ab")
    Path(path, "gpus.json").write_text("{}")
    os.symlink(outside, os.path.join(path, "link"))
    remove_private_dir(path)
    assert not os.path.lexists(path) and (outside / "data").read_text() == "keep"
    path = private_dir("0123456789ab")  # a directory the command made in it: removed as a whole
    os.makedirs(os.path.join(path, "sub", "deeper"))
    os.symlink(outside, os.path.join(path, "sub", "link"))
    remove_private_dir(path)
    assert not os.path.lexists(path) and (outside / "data").read_text() == "keep"
    remove_private_dir(path)  # gone already: nothing to do, no error


def test_a_link_put_in_its_place_is_not_followed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The directory replaced by a link to another before the job ends (a process of the command's
    left behind, say): nothing in the link's target is removed."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    victim = tmp_path / "victim"
    victim.mkdir()
    for name in ("a", "b"):
        (victim / name).write_text("keep")
    (victim / "sub").mkdir()
    path = private_dir("0123456789ab")
    os.rmdir(path)
    os.symlink(victim, path)
    remove_private_dir(path)
    assert sorted(p.name for p in victim.iterdir()) == ["a", "b", "sub"]


def test_a_file_gone_meanwhile_does_not_stop_the_rest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    path = private_dir("0123456789ab")
    for name in ("a", "b", "c"):
        Path(path, name).write_text("x")
    real = os.unlink

    def racing(name: str, *, dir_fd: int | None = None) -> None:
        if os.path.basename(name) == "a":  # removed by someone else just before
            real(name, dir_fd=dir_fd)
        real(name, dir_fd=dir_fd)

    monkeypatch.setattr(os, "unlink", racing)
    remove_private_dir(path)
    assert not os.path.lexists(path)
