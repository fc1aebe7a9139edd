"""Files that submission unpickles: written owner-only, refused when someone else could
have written them (``nvrx.submission.private_files``)."""

from __future__ import annotations

import errno
import os
import stat
import struct
from pathlib import Path

import pytest

from nvrx.submission.call_spec import dump_spec, load_spec
from nvrx.submission.private_files import check_private, make_private_dir, write_private
from nvrx.submission.run_callable import read_outcome, result_path, write_outcome
from nvrx.submission.submit import Executor


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_specs_and_results_are_written_owner_only(tmp_path: Path) -> None:
    spec = dump_spec(tmp_path / "specs" / "a.pkl", len, ([1, 2],), {})
    assert (_mode(spec), _mode(spec.parent)) == (0o600, 0o700)
    assert load_spec(spec) == (len, ([1, 2],), {})
    write_outcome(tmp_path / "results" / "42", 0, ("success", 3))
    written = result_path(tmp_path / "results" / "42", 0)
    assert (_mode(written), _mode(written.parent)) == (0o600, 0o700)
    assert read_outcome(tmp_path / "results" / "42", 0) == ("success", 3)


@pytest.mark.parametrize("where", ["file", "directory"])
def test_a_pickle_others_could_write_is_not_loaded(tmp_path: Path, where: str) -> None:
    spec = dump_spec(tmp_path / "specs" / "a.pkl", len, (), {})
    opened = spec if where == "file" else spec.parent
    opened.chmod(_mode(opened) | stat.S_IWOTH)
    with pytest.raises(PermissionError, match=f"its {where} .* is writable by others") as err:
        load_spec(spec)
    assert f"chmod go-w {opened}" in str(err.value)


def test_a_result_others_could_write_is_not_loaded(tmp_path: Path) -> None:
    write_outcome(tmp_path, 1, ("success", "x"))
    result_path(tmp_path, 1).chmod(0o620)
    with pytest.raises(PermissionError, match="writable by others"):
        read_outcome(tmp_path, 1)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_pickle_of_another_user_is_not_loaded(tmp_path: Path) -> None:
    spec = dump_spec(tmp_path / "specs" / "a.pkl", len, (), {})
    os.chown(spec, 65534, 65534)  # nobody
    with pytest.raises(PermissionError, match="belongs to uid 65534, not to this user"):
        check_private(spec)


def test_a_new_executor_folder_is_owner_only_whatever_the_umask(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o755)
    previous = os.umask(0o022)
    try:
        new = Executor(tmp_path / "jobs" / "new", cluster="local").folder
        kept = Executor(shared, cluster="local").folder
    finally:
        os.umask(previous)
    assert new == tmp_path / "jobs" / "new" and _mode(new) == 0o700
    assert kept == shared and _mode(kept) == 0o755


def _give_default_acl(directory: Path) -> None:
    """``setfacl -d -m u::rwx,g::rwx,g:<gid>:rwx,m::rwx,o::--- directory`` (a team's project
    folder), written as the kernel's extended attribute: setfacl need not be installed."""
    undefined = 0xFFFFFFFF
    entries = [(0x01, 7, undefined), (0x04, 7, undefined), (0x08, 7, os.getgid())]
    entries += [(0x10, 7, undefined), (0x20, 0, undefined)]
    value = struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in entries)
    try:
        os.setxattr(directory, "system.posix_acl_default", value)
    except (AttributeError, OSError) as exc:
        pytest.skip(f"no POSIX ACLs here ({directory}: {exc})")


def test_a_job_folder_under_a_default_acl_gets_owner_only_files(tmp_path: Path) -> None:
    """A default ACL overrides the umask: submitit's result pickle, written under umask 0o077
    in a job folder that kept its ACL, was -rw-rw---- and refused by results()."""
    _give_default_acl(tmp_path)
    folder = tmp_path / "12345"
    folder.mkdir()  # submitit makes the job folder: it inherits the default ACL
    make_private_dir(folder)
    assert "system.posix_acl_default" not in os.listxattr(folder)
    previous = os.umask(0o077)
    try:  # as submitit writes its pickle, in the node task's umask
        pickle = folder / "12345_0_result.pkl"
        os.close(os.open(pickle, os.O_CREAT | os.O_WRONLY, 0o666))
    finally:
        os.umask(previous)
    assert _mode(pickle) == 0o600 and _mode(folder) == 0o700
    check_private(pickle)


@pytest.mark.parametrize("code", [errno.EPERM, errno.EACCES, errno.EINVAL, errno.ENOSYS])
def test_a_file_system_that_refuses_to_remove_an_acl_it_does_not_hold_writes_the_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    """NFSv4 or GPFS ACLs, or no extended attributes at all, answer the removal of a POSIX
    ACL with other errors than "no such attribute": where none is there, nothing to remove,
    and every rank's result is still written (before: each rank failed at its very end)."""

    def refuse(path: object, name: str) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "removexattr", refuse)
    written = write_private(tmp_path / "results" / "rank0.pkl", b"x")
    assert written.read_bytes() == b"x" and (written.parent.stat().st_mode & 0o777) == 0o700
