"""The run directory under damage and I/O faults (issue 37 items 3, 4, 6 and the lock's pid).

Each test reproduces a fault a user can cause by hand — a step directory that
is not a checkpoint, a damaged or truncated log, a full disk, a read-only
directory — and checks the one-line message and the state the run directory is
left in.

Faults on the file system itself: a full disk is a small tmpfs this test
mounts (root only, skipped otherwise); a read-only ``checkpoints/`` is a
read-only bind mount of it (root; otherwise ``chmod``, which denies an
ordinary user); a log that cannot be written is its file descriptor pointed at
``/dev/full`` (every write fails with ``ENOSPC``, as on a full disk).
"""

import errno
import json
import os
import shutil
import subprocess
import sys

import pytest
from _controller_args import make_controller, resume_controller  # noqa: E402

import adaptjax
from adaptjax import RunDirectoryError, RunDirectoryLocked
from adaptjax.controller._run_lock import RunLock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import controller_job as job  # noqa: E402


def _one_line(excinfo):
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    return msg


def _rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _kwargs(**overrides):
    return job.job_kwargs(policies=[], **overrides)


@pytest.fixture(scope="module")
def thirty_steps(tmp_path_factory):
    """A run directory with checkpoints 10, 20 and 30 (copy it before changing it)."""
    run_dir = tmp_path_factory.mktemp("thirty") / "run"
    ctrl = make_controller(run_dir=run_dir, **_kwargs())
    ctrl.run(30)
    ctrl.close()
    return run_dir


@pytest.fixture
def run_dir(thirty_steps, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(thirty_steps, copy)
    return copy


# --- the lock names its holder ---------------------------------------------------------


def test_a_lock_whose_pid_is_not_written_yet_is_read_again(tmp_path, monkeypatch):
    """The holder takes the lock, then writes its pid: a reader in between must not say
    "pid unknown". The holder here writes its pid right after the reader's first read."""
    import fcntl

    holder = os.open(tmp_path / ".adaptjax.lock", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(holder, fcntl.LOCK_EX)  # locked, pid not written yet: the window
    real_pread, reads = os.pread, []

    def pread(fd, n, offset):
        out = real_pread(fd, n, offset)
        if not reads:
            os.pwrite(holder, b"4242\n", 0)  # the holder finishes writing its pid now
        reads.append(out)
        return out

    monkeypatch.setattr(os, "pread", pread)
    try:
        with pytest.raises(RunDirectoryLocked) as e:
            RunLock(tmp_path)
        assert "(pid 4242)" in _one_line(e)
        assert reads[0] == b"", "the first read fell in the window"
    finally:
        os.close(holder)


# --- item 3: a numbered directory that is not a checkpoint -------------------------------


def _no_state(run_dir):
    shutil.rmtree(run_dir / "checkpoints" / "30" / "state")
    return 30, 20, "no state item"


def _no_meta(run_dir):
    shutil.rmtree(run_dir / "checkpoints" / "30" / "meta")
    return 30, 20, "no meta item"


def _junk_ahead(run_dir):
    os.makedirs(run_dir / "checkpoints" / "40")
    (run_dir / "checkpoints" / "40" / "notes.txt").write_text("junk")
    return 40, 30, "no state or meta item"


def _file_named_like_a_step(run_dir):
    (run_dir / "checkpoints" / "40").write_text("junk")
    return 40, 30, "a file"


@pytest.mark.parametrize("damage", [_no_state, _no_meta, _junk_ahead, _file_named_like_a_step])
def test_a_step_directory_that_is_not_a_checkpoint_is_quarantined_so_its_step_is_written(
    run_dir, damage, caplog
):
    bad, resumed_at, why = damage(run_dir)
    with pytest.warns(UserWarning, match=f"skipped checkpoint {bad}: .*{why}") as record:
        ctrl = resume_controller(run_dir, **_kwargs())
    assert sum(f"checkpoint {bad}" in str(w.message) for w in record) == 1
    assert len(record) == 1, [str(w.message) for w in record]
    # Orbax's "Metadata file does not exist" for the junk: said once, by the warning above
    assert [r.getMessage() for r in caplog.records if r.levelno >= 30] == []
    assert ctrl.step == resumed_at
    assert os.path.exists(run_dir / "quarantine" / str(bad))  # kept, never deleted
    assert not os.path.exists(run_dir / "checkpoints" / str(bad))
    (skip,) = [e for e in ctrl.log.events if e["kind"] == "checkpoint_skipped"]
    assert skip["skipped_step"] == bad
    ctrl.run(40)  # today: Orbax's StepAlreadyExistsError at the step of the stray directory
    ctrl.close()
    assert adaptjax.RunCheckpoints(run_dir / "checkpoints").all_steps()[-1] == 40
    assert [r["step"] for r in _rows(run_dir / "metrics.jsonl")] == list(range(1, 41))


# --- item 4: damaged and missing log rows ---------------------------------------------------


@pytest.mark.parametrize("name", ["events.jsonl", "metrics.jsonl"])
def test_a_line_of_bytes_that_is_not_utf8_json_is_dropped_with_one_warning(run_dir, name):
    before = (run_dir / name).read_bytes()
    with open(run_dir / name, "ab") as f:
        f.write(b"\xff\xfe\n")  # printf '\xff\xfe\n' >> RUN/events.jsonl
    with pytest.warns(UserWarning, match=f"dropped 1 damaged line of .*{name}") as record:
        ctrl = resume_controller(run_dir, **_kwargs())
    assert len(record) == 1, [str(w.message) for w in record]
    ctrl.close()
    after = (run_dir / name).read_bytes()
    assert b"\xff" not in after
    assert after.startswith(before)  # every row before the damaged line is kept


def test_a_damaged_row_in_the_middle_is_reported_with_the_step_it_leaves_missing(run_dir):
    path = run_dir / "metrics.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    lines[4] = b'{"step": 5, "loss": \x80\x81}\n'  # step 5's row, bytes flipped
    path.write_bytes(b"".join(lines))
    with pytest.warns(UserWarning) as record:
        ctrl = resume_controller(run_dir, **_kwargs())
    messages = [str(w.message) for w in record]
    assert messages == [  # one damaged thing, one warning
        f"resume: dropped 1 damaged line of {path} (not whole UTF-8 JSON rows); it lacks the "
        "rows of 1 step up to the checkpoint's step 30 (5): they were lost before this resume "
        "and are not recomputed"
    ]
    ctrl.close()
    assert [r["step"] for r in _rows(path)] == [s for s in range(1, 31) if s != 5]


@pytest.mark.parametrize("keep", [12, 0, None], ids=["truncated", "emptied", "deleted"])
def test_metrics_rows_missing_before_the_checkpoint_are_reported_in_one_warning(run_dir, keep):
    path = run_dir / "metrics.jsonl"
    if keep is None:
        path.unlink()
    else:
        path.write_bytes(b"".join(path.read_bytes().splitlines(keepends=True)[:keep]))
    first = 1 if keep is None else keep + 1
    missing = 30 - first + 1
    with pytest.warns(UserWarning, match="lacks the rows") as record:
        ctrl = resume_controller(run_dir, **_kwargs())
    assert len(record) == 1
    msg = str(record[0].message)
    assert f"lacks the rows of {missing} steps up to the checkpoint's step 30 ({first}-30)" in msg
    assert "\n" not in msg
    ctrl.run(32)
    ctrl.close()
    assert [r["step"] for r in _rows(path)] == list(range(1, first)) + [31, 32]


@pytest.mark.parametrize("cut", [2, 30, "all but the brace"])  # 2: "}\n"
def test_a_truncated_last_event_is_dropped_with_one_warning(run_dir, cut):
    """A last line cut short whose step is the checkpoint's, or cannot be read: an event of
    the run lost (a resume recomputes only the steps after the checkpoint)."""
    path = run_dir / "events.jsonl"
    data = path.read_bytes()
    last = data[data.rindex(b"\n", 0, -1) + 1:]
    assert json.loads(last)["step"] == 30
    keep = 1 if cut == "all but the brace" else len(last) - cut
    path.write_bytes(data[: len(data) - len(last) + keep])
    with pytest.warns(UserWarning) as record:
        ctrl = resume_controller(run_dir, **_kwargs())
    assert [str(w.message) for w in record] == [
        f"resume: dropped 1 damaged line of {path} (not whole UTF-8 JSON rows)"
    ]
    ctrl.close()
    assert path.read_bytes().startswith(data[: len(data) - len(last)])


def test_a_torn_last_line_is_dropped_without_a_warning(run_dir):
    with open(run_dir / "metrics.jsonl", "ab") as f:
        f.write(b'{"step": 31, "lo')  # killed in the middle of a row
    ctrl = resume_controller(run_dir, **_kwargs())  # warnings are errors here
    ctrl.close()
    assert [r["step"] for r in _rows(run_dir / "metrics.jsonl")] == list(range(1, 31))


# --- issue 48 item 6: a refused resume leaves no unfinished save behind ---------------------


def _unfinished(run_dir, step=10):
    tmp = run_dir / "checkpoints" / f"{step}.orbax-checkpoint-tmp-1765000000"
    (tmp / "state").mkdir(parents=True)
    (tmp / "state" / "d").write_bytes(b"half a checkpoint")
    return tmp


def test_a_refused_resume_removes_the_unfinished_saves_it_finds(tmp_path):
    from adaptjax.controller._run_dir import check_resumable

    first, second = _unfinished(tmp_path, 10), _unfinished(tmp_path, 20)
    with pytest.raises(ValueError) as e:
        check_resumable(str(tmp_path))
    assert _one_line(e) == (
        f"no complete checkpoint in {tmp_path / 'checkpoints'} to resume from (removed the "
        f"unfinished saves {first.name}, {second.name}); start a new run with Controller(...) "
        "instead"
    )
    assert os.listdir(tmp_path / "checkpoints") == []
    RunLock(tmp_path).release()  # released


def test_a_refused_resume_leaves_the_saves_of_a_live_owner_alone(tmp_path):
    from adaptjax.controller._run_dir import check_resumable

    tmp = _unfinished(tmp_path)
    owner = RunLock(tmp_path)  # its save of step 10 may be in flight
    try:
        with pytest.raises(ValueError) as e:
            check_resumable(str(tmp_path))
        assert _one_line(e) == (f"no complete checkpoint in {tmp_path / 'checkpoints'} to resume "
                                "from; start a new run with Controller(...) instead")
        assert tmp.is_dir()
    finally:
        owner.release()


def test_nothing_to_resume_from_and_nothing_left(tmp_path):
    from adaptjax.controller._run_dir import check_resumable

    with pytest.raises(ValueError, match="no complete checkpoint in .* to resume from; start"):
        check_resumable(str(tmp_path / "never-made"))
    assert not (tmp_path / "never-made").exists()
    (tmp_path / "checkpoints" / "10").mkdir(parents=True)
    check_resumable(str(tmp_path))  # a step to resume from (or to quarantine): no refusal


@pytest.mark.slow
def test_a_resume_after_a_kill_in_the_first_save_is_refused_with_nothing_left(tmp_path):
    from _handshake import Gate

    run_dir, gate = tmp_path / "run", Gate(tmp_path / "gate")
    proc = subprocess.Popen(
        [sys.executable, "-u", job.__file__, str(run_dir), "45", "--hold-in-save", "10",
         "--gate", gate.directory], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        assert gate.wait_at(alive=lambda: proc.poll() is None)[0] == "save 10"
    finally:
        proc.kill()  # kill -9 inside the first save: its temporary directory stays
        proc.wait()
    assert [n for n in os.listdir(run_dir / "checkpoints") if "tmp" in n] != []
    with pytest.raises(ValueError, match="no complete checkpoint in .* to resume from"):
        resume_controller(run_dir, **_kwargs())
    assert os.listdir(run_dir / "checkpoints") == []


# --- item 6: I/O errors on the run directory ------------------------------------------------


def _mount(*args):
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root and mount(8) to mount a small tmpfs or a read-only bind mount")
    done = subprocess.run(["mount", *args], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount here ({done.stderr.strip()}); the test needs its own mount")


@pytest.fixture
def mounts():
    """``mount(*args, at=path)`` mounts for this test only; all are unmounted after it."""
    points = []

    def mount(*args, at):
        _mount(*args, str(at))
        points.append(str(at))

    yield mount
    for point in reversed(points):
        subprocess.run(["umount", "-l", point], check=False)


def _fill(disk, leave):
    """Fills the file system of ``disk`` until ``leave`` bytes are free."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        while True:
            os.write(fd, b"\0" * 65536)
    except OSError:
        pass
    finally:
        os.close(fd)
    os.truncate(filler, max(0, os.path.getsize(filler) - leave))
    return filler


def _fill_inodes(disk, leave):
    """Uses up the inodes of the file system of ``disk`` but ``leave`` (bytes stay free)."""
    filler = disk / "inodes"
    filler.mkdir()
    n = 0
    try:
        while True:
            (filler / str(n)).touch()
            n += 1
    except OSError:
        pass
    for i in range(n - leave, n):
        (filler / str(i)).unlink()
    return filler


@pytest.fixture
def full_disk(tmp_path, mounts):
    """A run on a small tmpfs, checkpoint 10 written; then the disk is full.

    ``full_disk`` leaves 48 KiB free: a checkpoint of the job takes about
    90 KiB there and its log rows a few KiB, so the logs of steps 11-20 fit and
    checkpoint 20 does not. ``no_inodes`` leaves bytes free but 3 inodes: the
    logs grow in place, and checkpoint 20 fails once Orbax's threads create its
    files (no check before a save counts inodes).
    """
    disk = tmp_path / "disk"
    disk.mkdir()
    mounts("-t", "tmpfs", "-o", "size=2m,nr_inodes=400", "tmpfs", at=disk)
    ctrl = make_controller(run_dir=disk / "run", **_kwargs())
    ctrl.run(10)
    yield ctrl, disk / "run"
    ctrl.close()


def _left_in(run_dir):
    ckpts = run_dir / "checkpoints"
    return sorted(n for n in os.listdir(ckpts) if not n.isdigit())


def test_a_full_disk_stops_the_run_at_the_save_that_cannot_fit_in_one_line(full_disk, capfd):
    ctrl, run_dir = full_disk
    filler = _fill(run_dir.parent, leave=48 << 10)
    capfd.readouterr()
    with pytest.raises(RunDirectoryError) as e:
        ctrl.run(40)
    msg = _one_line(e)
    assert msg.startswith(f"cannot write {run_dir / 'checkpoints' / '20'}: no space left on device")
    assert "KiB free" in msg and "resume" in msg
    assert (e.value.errno, e.value.filename) == (errno.ENOSPC, str(run_dir / "checkpoints" / "20"))
    assert ctrl.step == 20, "raised at the save that failed"
    ctrl.close()  # no second raise
    err = capfd.readouterr().err
    assert "Event loop is closed" not in err and "Traceback" not in err, err
    assert _left_in(run_dir) == []
    RunLock(run_dir).release()  # the run directory was released
    assert adaptjax.RunCheckpoints(run_dir / "checkpoints").all_steps() == [10]
    os.remove(filler)  # space again: the run resumes where it was checkpointed
    resumed = resume_controller(run_dir, **_kwargs())
    assert resumed.step == 10
    resumed.run(20)
    resumed.close()
    assert [r["step"] for r in _rows(run_dir / "metrics.jsonl")] == list(range(1, 21))


@pytest.mark.parametrize("inodes", [3, 4], ids=["as-it-starts", "in-orbax-threads"])
def test_a_save_that_fails_after_it_started_is_named_and_discarded(full_disk, inodes):
    """No inode left for checkpoint 20: its directories cannot be made (3 inodes left, in
    save() itself), or Orbax's threads cannot create its files (4 left, after save()
    returned). Either error (an OSError; a multi-line one from Orbax's thread) becomes one
    line naming the step, the incomplete save is discarded, and the run resumes."""
    ctrl, run_dir = full_disk
    filler = _fill_inodes(run_dir.parent, leave=inodes)
    with pytest.raises(RunDirectoryError) as e:
        ctrl.run(40)
    msg = _one_line(e)
    assert msg.startswith(f"cannot write {run_dir / 'checkpoints' / '20'}: no space left on device")
    assert "no inode free" in msg
    assert (e.value.errno, e.value.filename) == (errno.ENOSPC, str(run_dir / "checkpoints" / "20"))
    assert 20 <= ctrl.step <= 30, "raised once the save is known to have failed"
    ctrl.close()  # no second raise, and the incomplete save is discarded
    assert _left_in(run_dir) == []
    assert adaptjax.RunCheckpoints(run_dir / "checkpoints").all_steps() == [10]
    logged = [e["step"] for e in _rows(run_dir / "events.jsonl") if e["kind"] == "checkpoint"]
    assert logged == [10]
    shutil.rmtree(filler)
    resumed = resume_controller(run_dir, **_kwargs())
    assert resumed.step == 10
    resumed.close()


def test_a_log_that_cannot_be_written_is_named_and_close_does_not_raise_again(tmp_path):
    ctrl = make_controller(run_dir=tmp_path / "run", **_kwargs())
    ctrl.run(10)
    full = os.open("/dev/full", os.O_WRONLY)  # every write: ENOSPC, as on a full disk
    os.dup2(full, ctrl.log._metrics.fileno())
    os.close(full)
    with pytest.raises(RunDirectoryError) as e:
        ctrl.run(20)
    msg = _one_line(e)
    assert msg.startswith(f"cannot write {tmp_path / 'run' / 'metrics.jsonl'}: no space left")
    metrics = str(tmp_path / "run" / "metrics.jsonl")
    assert (e.value.errno, e.value.filename) == (errno.ENOSPC, metrics)
    ctrl.close()  # no second raise
    RunLock(tmp_path / "run").release()  # the run directory was released
    assert adaptjax.RunCheckpoints(tmp_path / "run" / "checkpoints").all_steps() == [10]


def _read_only(path, mounts, request):
    """Makes ``path`` read-only: a read-only bind mount (root: chmod would not stop root),
    else ``chmod``."""
    if os.geteuid() == 0:
        mounts("--bind", str(path), at=path)
        mounts("-o", "remount,bind,ro", at=path)
    else:
        os.chmod(path, 0o555)
        request.addfinalizer(lambda: os.chmod(path, 0o755))
    assert not os.access(path, os.W_OK)


def test_a_read_only_checkpoint_directory_mid_run_is_named_at_the_save(tmp_path, mounts,
                                                                      request):
    ctrl = make_controller(run_dir=tmp_path / "run", **_kwargs())
    ctrl.run(10)
    ckpts = tmp_path / "run" / "checkpoints"
    _read_only(ckpts, mounts, request)
    with pytest.raises(RunDirectoryError) as e:
        ctrl.run(30)
    msg = _one_line(e)
    assert msg.startswith(f"cannot write {ckpts / '20'}: ")
    assert "read-only file system" in msg or "permission denied" in msg
    assert e.value.errno in (errno.EROFS, errno.EACCES) and e.value.filename == str(ckpts / "20")
    assert ctrl.step == 20
    ctrl.close()
    RunLock(tmp_path / "run").release()


def test_an_unwritable_checkpoint_directory_is_found_at_construction(run_dir, mounts,
                                                                     request):
    _read_only(run_dir / "checkpoints", mounts, request)
    events = (run_dir / "events.jsonl").read_bytes()
    with pytest.raises(RunDirectoryError) as e:
        resume_controller(run_dir, **_kwargs())
    msg = _one_line(e)
    why = "read-only file system" if os.geteuid() == 0 else "permission denied"
    assert msg == (f"{run_dir / 'checkpoints'} is not writable ({why}); make it writable or "
                   "choose another run_dir")
    assert e.value.errno == (errno.EROFS if os.geteuid() == 0 else errno.EACCES)
    assert e.value.filename == str(run_dir / "checkpoints")
    assert (run_dir / "events.jsonl").read_bytes() == events  # nothing written


def test_a_read_only_run_directory_is_a_run_directory_error_at_construction(tmp_path, mounts,
                                                                           request):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    _read_only(run_dir, mounts, request)
    with pytest.raises(RunDirectoryError) as e:
        make_controller(run_dir=run_dir, **_kwargs())
    assert _one_line(e) == (f"run_dir {run_dir} is not writable ({run_dir} is not a writable "
                            "directory); choose a run_dir you can write to")
    assert e.value.errno == (errno.EROFS if os.geteuid() == 0 else errno.EACCES)
    assert e.value.filename == str(run_dir)
    assert os.listdir(run_dir) == []


def test_a_run_directory_under_a_file_is_a_run_directory_error(tmp_path):
    blocker = tmp_path / "afile"
    blocker.write_text("keep me")
    with pytest.raises(RunDirectoryError) as e:
        make_controller(run_dir=blocker / "run", **_kwargs())
    assert _one_line(e) == (f"run_dir {blocker / 'run'} is not writable ({blocker} is not a "
                            "writable directory); choose a run_dir you can write to")
    assert (e.value.errno, e.value.filename) == (errno.ENOTDIR, str(blocker))
    assert blocker.read_text() == "keep me"


def test_a_file_where_the_run_writes_a_directory_is_named(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "quarantine").write_text("not a directory")
    with pytest.raises(RunDirectoryError) as e:
        make_controller(run_dir=tmp_path / "run", **_kwargs())
    where = tmp_path / "run" / "quarantine"
    assert _one_line(e) == (f"{where} is not writable (a file, not a directory); make it "
                            "writable or choose another run_dir")
    assert (e.value.errno, e.value.filename) == (errno.ENOTDIR, str(where))
