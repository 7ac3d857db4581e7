"""One live run a checkpoint.dir, as one a run folder (tests/test_checkpoint.py::test_a_second_run_on_the_same_folder_*):
an object store's prefix is locked by an object created by a conditional write (launcher/checkpoint/prefix_lock.py),
against a real S3 API server on loopback (moto's, tests/s3.py); a local folder outside the run folder by its own
record lock. A second run is refused with one line naming the first; a lock whose run is gone is taken over."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from launcher.checkpoint import layout, prefix_lock, storage
from launcher.cli import main
from launcher.errors import UserError
from tests.conftest import QUICKSTART, REPO, SMALL
from tests.pace import until

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")
from tests.s3 import BUCKET, s3  # noqa: E402,F401 - the S3 server, shared

HOST = socket.gethostname()


def lock_of(store, prefix):
    """The lock object's holder, or None."""
    try:
        return json.loads(store.client.get_object(Bucket=BUCKET, Key=f"{prefix}/.lock")["Body"].read())
    except store.client.exceptions.NoSuchKey:
        return None


def locked_by(store, prefix, **holder):
    """A lock object as a run elsewhere would have left it."""
    about = {"host": "elsewhere", "pid": 1, "run_dir": "/runs/other", "slurm_job": None, "since": "2026-01-01 00:00:00",
             **holder}
    store.client.put_object(Bucket=BUCKET, Key=f"{prefix}/.lock", Body=json.dumps(about).encode())


@pytest.mark.slow  # over 3 s on a quiet machine: left out of the fast tier (-m 'not slow')
def test_a_second_run_on_a_prefix_in_use_is_refused_and_the_first_runs_rerun_takes_it_over(s3, tmp_path, capsys,
                                                                                           own_processes):
    """Two processes, two seeds, one s3:// prefix: the second stops before it trains (exit 2, one line naming the
    prefix and the first run) and writes nothing there. The first killed (its lock left behind), its rerun on
    this machine takes the lock over, saying so, and releases it at its end."""
    url, first = f"s3://{BUCKET}/shared", tmp_path / "first"
    args = [str(QUICKSTART), *SMALL, f"checkpoint.dir={url}"]
    log = open(tmp_path / "first.log", "w")
    running = subprocess.Popen([sys.executable, "-m", "launcher", *args, "seed=1", "trainer.max_steps=1000000",
                                f"run_dir={first}"], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = until(180)
        while lock_of(s3, "shared") is None:
            assert running.poll() is None and time.monotonic() < deadline, (tmp_path / "first.log").read_text()
            time.sleep(0.2)
        capsys.readouterr()
        assert main([*args, "seed=2", "trainer.max_steps=20", "checkpoint.every=10", f"run_dir={tmp_path / 'second'}"]) == 2
        out, err = capsys.readouterr()
        assert "training" not in out and len(err.strip().splitlines()) == 1, out + err
        assert f"checkpoint.dir: {url} is in use by another run (pid {running.pid} on {HOST}, run folder {first}, since " in err
        assert "wait for it to end, or give this run its own checkpoint.dir" in err
        assert s3.objects("shared") == [".lock"] and not (tmp_path / "second" / "recipe.yaml").exists()
    finally:
        running.send_signal(signal.SIGKILL)
        running.wait()
        log.close()
    assert lock_of(s3, "shared")["pid"] == running.pid  # a killed run cannot remove it
    assert main([*args, "seed=1", "trainer.max_steps=10", "checkpoint.every=10", f"run_dir={first}"]) == 0
    assert (f"checkpoint.dir: {url} was locked by pid {running.pid} on {HOST}, run folder {first}, since "
            in capsys.readouterr().out)
    assert s3.objects("shared") == [f"step_10/{name}" for name in ("manifest.json", "model.pt", "state.pt")]


@pytest.mark.slow  # over 3 s on a quiet machine: left out of the fast tier (-m 'not slow')
def test_a_lock_from_another_machine_is_refused_while_heard_from_and_taken_over_once_stale(s3, tmp_path, capsys,
                                                                                          monkeypatch):
    url = f"s3://{BUCKET}/elsewhere"
    locked_by(s3, "elsewhere")
    args = [str(QUICKSTART), *SMALL, "trainer.max_steps=2", f"checkpoint.dir={url}", f"run_dir={tmp_path}"]
    assert main(args) == 2
    assert (f"checkpoint.dir: {url} is in use by another run (pid 1 on elsewhere, run folder /runs/other, since "
            f"2026-01-01 00:00:00, heard from ") in capsys.readouterr().err
    monkeypatch.setattr(prefix_lock, "STALE", 0.0)  # its heartbeat as old as a dead run's
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"checkpoint.dir: {url} was locked by pid 1 on elsewhere, run folder /runs/other, since " in out
    assert "whose heartbeat stopped " in out and lock_of(s3, "elsewhere") is None


def test_a_requeued_slurm_job_takes_its_own_lock_over_and_another_job_is_refused(s3, tmp_path, monkeypatch):
    locked_by(s3, "requeued", slurm_job="4242")
    folder = storage.location(f"s3://{BUCKET}/requeued")
    monkeypatch.setenv("SLURM_JOB_ID", "4243")
    with pytest.raises(UserError, match=r"is in use by another run \(pid 1 on elsewhere, run folder /runs/other, "
                                        r"Slurm job 4242, since"):
        prefix_lock.take(folder, str(tmp_path))
    monkeypatch.setenv("SLURM_JOB_ID", "4242")  # the same job, requeued onto another node
    lock, said = prefix_lock.take(folder, str(tmp_path))
    try:
        assert "this Slurm job (4242) before its requeue: taken over by this run" in said
        assert lock_of(s3, "requeued")["pid"] == os.getpid()
    finally:
        lock.release()
    assert lock_of(s3, "requeued") is None


def test_the_heartbeat_rewrites_the_lock_and_a_lock_taken_over_fails_every_later_save(s3, tmp_path, monkeypatch):
    """A lock that another run took over (this run unheard of for STALE seconds) is never written over: the
    heartbeat stops, each save of this run fails with one line before writing anything, and its release leaves
    the other run's lock."""
    monkeypatch.setattr(prefix_lock, "HEARTBEAT", 0.05)
    folder = storage.location(f"s3://{BUCKET}/beating")
    lock, said = prefix_lock.take(folder, str(tmp_path))
    try:
        assert said is None
        first = lock.etag
        deadline = until(30)
        while lock.etag == first:  # rewritten (a new heartbeat time, a new ETag)
            assert time.monotonic() < deadline
            time.sleep(0.05)
        layout.prepare(folder, 10)  # held: a save goes on
        s3.client.delete_object(Bucket=BUCKET, Key="beating/.lock")  # deleted by hand: made again by the next beat
        while lock_of(s3, "beating") is None:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        locked_by(s3, "beating", pid=2)  # another run took it over
        while lock.lost is None:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with pytest.raises(UserError, match=rf"^checkpoint.dir: {folder} was taken over by another run \(pid 2 on "
                                            r"elsewhere.*this run writes nothing more there$"):
            layout.prepare(folder, 20)
    finally:
        lock.release()
    assert lock_of(s3, "beating")["pid"] == 2



def test_a_beat_answered_after_the_release_removed_the_lock_does_not_make_it_again(s3, tmp_path, monkeypatch):
    """release() waits a while for a beat under way, then goes on: it removes the lock (its ETag still the one it
    knows) while the store has not yet answered the beat. That answer, "not found", is the release's doing, not a
    deletion by hand: the lock is not made again, so that no run elsewhere is refused for STALE seconds by the
    lock of a run that has ended."""
    import threading

    monkeypatch.setattr(prefix_lock, "HEARTBEAT", 0.05)
    folder = storage.location(f"s3://{BUCKET}/outlived")
    lock, _ = prefix_lock.take(folder, str(tmp_path))
    put, beating, answered = prefix_lock._put, threading.Event(), threading.Event()

    def late(folder, holder, **condition):  # a store that answers a beat late
        if "IfMatch" in condition:
            beating.set()
            assert answered.wait(30)
        return put(folder, holder, **condition)

    monkeypatch.setattr(prefix_lock, "_put", late)
    try:
        assert beating.wait(30)
        lock._stop.set()  # release() under way, its wait for the beat over:
        s3.client.delete_object(Bucket=BUCKET, Key="outlived/.lock")  # it removed the lock
    finally:
        answered.set()
    lock._beating.join(30)
    assert not lock._beating.is_alive() and lock_of(s3, "outlived") is None
    lock.release()

def test_a_local_checkpoint_dir_in_use_by_another_run_is_refused(tmp_path, capsys):
    """checkpoint.dir a local folder outside the run folder: locked as a run folder is; missing, it is made."""
    elsewhere = tmp_path / "made" / "checkpoints"
    args = [str(QUICKSTART), *SMALL, "trainer.max_steps=2", f"checkpoint.dir={elsewhere}"]
    assert main([*args, f"run_dir={tmp_path / 'a'}"]) == 0
    holder = subprocess.Popen([sys.executable, "-c", (  # another process, as a second run would be
        "import fcntl, os, sys\n"
        f"fd = os.open({str(elsewhere / '.lock')!r}, os.O_RDWR | os.O_CREAT)\n"
        "fcntl.lockf(fd, fcntl.LOCK_EX)\n"
        "print('held', flush=True); sys.stdin.read()\n")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        capsys.readouterr()
        code = main([*args, f"run_dir={tmp_path / 'b'}"])  # it would continue the first one's checkpoints
    finally:
        holder.communicate("")
    err = capsys.readouterr().err.splitlines()
    assert code == 2 and len(err) == 1 and f"checkpoint.dir: {elsewhere} is in use by another run (pid " in err[0], err
    assert "give this one its own folder (checkpoint.dir=...)" in err[0]


def test_a_store_that_refuses_the_lock_is_one_line_before_training(s3, tmp_path, capsys, monkeypatch):
    """Credentials that may read the bucket but not write it: the lock's write is refused, exit 2, one line,
    before the first step (not a traceback, nor three failed saves at the end)."""
    from tests.flaky_store import FlakyStore

    store = FlakyStore(os.environ["AWS_ENDPOINT_URL"])
    monkeypatch.setenv("AWS_ENDPOINT_URL", store.url)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    store.rules = {r"/\.lock": "refuse"}
    url = f"s3://{BUCKET}/read-only"
    try:
        code = main([str(QUICKSTART), *SMALL, f"checkpoint.dir={url}", f"run_dir={tmp_path}"])
    finally:
        store.close()
    out, err = capsys.readouterr()
    assert code == 2 and "training" not in out and len(err.strip().splitlines()) == 1, out + err
    assert (f"checkpoint.dir: cannot write {url}/.lock, the lock that keeps a second run out of {url} (Access Denied); "
            f"check the credentials' rights on the bucket") in err, err


FORGED = {"host": "elsewhere\nlauncher: done: step 80\x1b]0;pwned\x07", "pid": "1\r\x1b[2K", "run_dir": "/runs/\u202eother",
          "slurm_job": None, "since": "2026-01-01\x1b[31m"}


def test_a_forged_locks_fields_are_shown_escaped_and_a_lock_not_json_says_so(s3, tmp_path, capsys, monkeypatch):
    """A lock is the store's text, which anyone with the bucket's credentials may write: its fields reach the
    console escaped (no line of their own, no terminal escape), refused or taken over; a lock that is not a
    launcher's JSON says so rather than naming "pid None"."""
    s3.client.put_object(Bucket=BUCKET, Key="forged/.lock", Body=json.dumps(FORGED).encode())
    url = f"s3://{BUCKET}/forged"
    assert main([str(QUICKSTART), *SMALL, "trainer.max_steps=2", f"checkpoint.dir={url}", f"run_dir={tmp_path}"]) == 2
    out, err = capsys.readouterr()
    assert len(err.strip().splitlines()) == 1 and "\x1b" not in out + err and "\r" not in err and "\u202e" not in err, err
    assert (f"is in use by another run (pid 1\\r\\x1b[2K on elsewhere\\nlauncher: done: step 80\\x1b]0;pwned\\x07, run "
            f"folder /runs/\\u202eother, since 2026-01-01\\x1b[31m, heard from ") in err, err
    monkeypatch.setattr(prefix_lock, "STALE", 0.0)
    folder = storage.location(url)
    lock, said = prefix_lock.take(folder, str(tmp_path))
    lock.release()
    assert "\x1b" not in said and "\n" not in said and "elsewhere\\nlauncher: done: step 80\\x1b]0;pwned\\x07" in said

    monkeypatch.setattr(prefix_lock, "STALE", 300.0)
    for body, why in [(b"\x1b]0;pwned\x07\nnot json", "19 bytes, not JSON (Expecting value: line 1 column 1 (char 0))"),
                      (b"[1, 2]", "JSON, but a list, not the mapping of a holder's fields"),
                      (b'{"who": "me"}', "JSON without a holder's host and pid (keys: who)"),
                      (json.dumps({"host": "h", "pid": 1, prefix_lock.UNREADABLE: "\x1b]0;pwned\x07"}).encode(),
                       "\\x1b]0;pwned\\x07")]:
        s3.client.put_object(Bucket=BUCKET, Key="forged/.lock", Body=body)
        with pytest.raises(UserError) as refused:
            prefix_lock.take(folder, str(tmp_path))
        line = str(refused.value)
        assert f"{url} is in use by another run (a lock that is not a launcher's: {why}, heard from " in line, line
        assert "None" not in line and "\x1b" not in line


def test_a_forged_local_lock_is_shown_escaped(tmp_path, capsys):
    """The same of a local folder's lock file, held by another process: its text is shown escaped."""
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / ".lock").write_text("pid 7 on host\nlauncher: done\x1b]0;pwned\x07")
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys\n"
        f"fd = os.open({str(folder / '.lock')!r}, os.O_RDWR)\n"
        "fcntl.lockf(fd, fcntl.LOCK_EX)\n"
        "print('held', flush=True); sys.stdin.read()\n")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(UserError) as refused:
            from launcher import folder_lock
            folder_lock.take(folder)
    finally:
        holder.communicate("")
    assert "(pid 7 on host\\nlauncher: done\\x1b]0;pwned\\x07)" in str(refused.value), str(refused.value)
