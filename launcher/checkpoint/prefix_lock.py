"""An object-store prefix's lock (`<prefix>/.lock`): the promise of a run folder's (launcher/folder_lock.py) for
checkpoint.dir=s3://...: one live run writes there, a second is refused with one line naming the first.

An object store has no record locks, so the lock is an object created by a conditional write (PutObject with
`If-None-Match: *`: AWS S3, MinIO, Ceph and moto store it only where no object is): whoever creates it holds it.
It names its holder (host, pid, run folder, Slurm job) and the run rewrites it every HEARTBEAT seconds (with
`If-Match` its own ETag: a lock another run took over is never written over). A run that ends removes it. (A
store that ignores the condition lets two runs create it: the lock is as good as the store's conditional writes.)

A run killed cannot remove it, so a lock is taken over, with one line saying so, where its holder is gone:
  - its pid has ended on this host (a rerun after a crash, torchrun restarting its workers), or is this process;
  - it is this Slurm job's (a requeued job, on whichever node);
  - its heartbeat stopped STALE seconds ago, as the store's own clock tells (its Last-Modified against the Date
    of its answer): a run that died on another machine.
A lock lost while the run holds it (taken over after STALE seconds without a heartbeat: a store out of reach
that long, a process stopped) makes each later save fail with one line, and three the run (exit 7): nothing is
written over the run that took it."""

from __future__ import annotations

import email.utils
import json
import os
import socket
import threading
import time
from typing import Any, Dict, Optional, Tuple

from launcher.checkpoint import storage
from launcher.errors import UserError, a_kind, first_line, shown

NAME = ".lock"
HEARTBEAT = 30.0  # seconds between two rewrites of a held lock
STALE = 300.0  # seconds without a rewrite after which a lock's run is taken for gone
UNREADABLE = "(unreadable)"  # the key of a lock's fields that says it is not a launcher's
CONFLICT = ("PreconditionFailed", "ConditionalRequestConflict")  # 412; 409 where two conditional writes race

_held: Dict[str, "Lock"] = {}  # this process's locks, by prefix


class Lock:
    """A held lock: its heartbeat runs on a thread until release()."""

    def __init__(self, folder: Any, etag: str, about: Dict[str, Any]):
        self.folder, self.etag, self.about = folder, etag, about
        self.lost: Optional[str] = None  # who took it over, once they have
        self._stop = threading.Event()
        self._beating = threading.Thread(target=self._beat, name="launcher-prefix-lock", daemon=True)
        self._beating.start()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT):
            try:
                try:
                    self.etag = _put(self.folder, self._now(), IfMatch=self.etag)
                except FileNotFoundError:  # deleted by hand: this run's again, unless another has made it since
                    if self._stop.is_set():  # or by release(), done waiting for this beat: not made again
                        return
                    self.etag = _put(self.folder, self._now(), IfNoneMatch="*")
            except Exception as e:  # noqa: BLE001 - the store out of reach: the next beat tries again
                if _conflict(e):
                    self.lost = _holder_now(self.folder)
                    return

    def _now(self) -> Dict[str, Any]:
        return {**self.about, "heartbeat": _now()}

    def release(self) -> None:
        """Stop the heartbeat and remove the lock if it is still this run's (a store out of reach keeps it: the
        rules above free it)."""
        self._stop.set()
        self._beating.join(timeout=10)  # a beat still waiting on a store gone: its lock stays, for the rules above
        _held.pop(str(self.folder), None)
        try:
            if _s3(self.folder, "head_object")["ETag"] == self.etag:  # (a HEAD: nothing of it fetched)
                _s3(self.folder, "delete_object")
        except Exception:  # noqa: BLE001 - gone already, or the store out of reach: left to the rules above
            pass


def take(folder: Any, run_dir: str) -> Tuple[Lock, Optional[str]]:
    """The lock of `folder` (a Remote of s3://), held by this run until released, and a line to say where a gone
    run's lock was taken over (else None). A UserError where a live run holds it, or the store refuses it."""
    try:
        return _take(folder, run_dir)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - boto's and fsspec's errors, told apart by storage.store_error
        cause = storage.store_error(e)
        if cause is None:
            raise
        raise UserError(f"checkpoint.dir: cannot write {folder / NAME}, the lock that keeps a second run out of "
                        f"{folder} ({cause.strerror or first_line(cause)}); check the credentials' rights on the "
                        f"bucket (writes, and conditional ones: If-None-Match)") from None


def _take(folder: Any, run_dir: str) -> Tuple[Lock, Optional[str]]:
    about = {"host": socket.gethostname(), "pid": os.getpid(), "run_dir": str(run_dir),
             "slurm_job": os.environ.get("SLURM_JOB_ID"), "since": _now()}
    for _ in range(3):  # another run may create or take it between our look and our write: look again
        held = _hold(folder, about, IfNoneMatch="*")
        if held is not None:
            return held, None
        found = _read(folder)
        if found is None:
            continue  # removed since: create it again
        holder, etag, age = found
        gone = _gone(holder, age)
        if gone is None:
            raise UserError(f"checkpoint.dir: {folder} is in use by another run ({_holder(holder)}, heard from "
                            f"{age:.0f} s ago); wait for it to end, or give this run its own checkpoint.dir. HINT: a "
                            f"lock whose run died elsewhere is taken over once {STALE:.0f} s pass without its heartbeat")
        held = _hold(folder, about, IfMatch=etag)
        if held is not None:
            return held, (None if gone == "this process" else
                          f"checkpoint.dir: {folder} was locked by {_holder(holder)}, {gone}: taken over by this run")
    raise UserError(f"checkpoint.dir: {folder}: its lock ({NAME}) changed hands three times while this run tried to "
                    f"take it; another run is starting there: give this run its own checkpoint.dir")


def _hold(folder: Any, about: Dict[str, Any], **condition: str) -> Optional[Lock]:
    """The lock written where `condition` holds, and held from now on; None where it does not."""
    try:
        etag = _put(folder, {**about, "heartbeat": _now()}, **condition)
    except Exception as e:  # noqa: BLE001 - boto's ClientError behind s3fs's OSError
        if _conflict(e):
            return None
        raise
    _held[str(folder)] = lock = Lock(folder, etag, about)
    return lock


def check(folder: Any) -> None:
    """A UserError where this process held `folder`'s lock and another run has taken it over since."""
    lock = _held.get(str(folder))
    if lock is not None and lock.lost:
        raise UserError(f"checkpoint.dir: {folder} was taken over by another run ({lock.lost}) after this run's "
                        f"heartbeat stopped for {STALE:.0f} s; this run writes nothing more there")


def _gone(holder: Dict[str, Any], age: float) -> Optional[str]:
    """Why the lock's run is gone (a phrase), or None while it may live."""
    here = holder.get("host") == socket.gethostname()
    if here and holder.get("pid") == os.getpid():
        return "this process"
    if here and isinstance(holder.get("pid"), int) and not _alive(holder["pid"]):
        return "which has ended"
    job = os.environ.get("SLURM_JOB_ID")
    if job and holder.get("slurm_job") == job:
        return f"this Slurm job ({job}) before its requeue"
    if age >= STALE:
        return f"whose heartbeat stopped {age:.0f} s ago"
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's: alive
        return True
    return True


def _holder(holder: Dict[str, Any]) -> str:
    """Who holds a lock, as a phrase. Its fields are the store's text, written by anyone: shown escaped, so that
    a forged lock can neither add a line nor steer the terminal."""
    if UNREADABLE in holder:
        return f"a lock that is not a launcher's: {shown(holder[UNREADABLE], 300)}"  # (a forged one may name it)
    job = f", Slurm job {shown(holder['slurm_job'], 40)}" if holder.get("slurm_job") else ""
    return (f"pid {shown(holder.get('pid'), 20)} on {shown(holder.get('host'), 80)}, run folder "
            f"{shown(holder.get('run_dir'))}{job}, since {shown(holder.get('since'), 40)}")


def _holder_now(folder: Any) -> str:
    """Who holds the lock now, as a phrase (a store out of reach: "another run")."""
    try:
        found = _read(folder)
    except Exception:  # noqa: BLE001 - the store out of reach
        found = None
    return _holder(found[0]) if found else "another run"


def _holder_of(body: bytes) -> Dict[str, Any]:
    """The lock's fields, or {UNREADABLE: why} where it is not a launcher's (not JSON, not a mapping of its fields,
    damaged): then no holder to name, and the age alone decides whether it is taken over."""
    try:
        holder = json.loads(body)
    except (ValueError, RecursionError) as e:
        return {UNREADABLE: f"{len(body)} bytes, not JSON ({shown(first_line(e), 80)})"}
    if not isinstance(holder, dict):
        return {UNREADABLE: f"JSON, but {a_kind(holder)}, not the mapping of a holder's fields"}
    if not {"host", "pid"} <= holder.keys():
        return {UNREADABLE: f"JSON without a holder's host and pid (keys: {shown(', '.join(map(str, holder)), 80)})"}
    return holder


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")


def _conflict(e: BaseException) -> bool:
    """A conditional write refused: the lock exists (create), or is another's now (rewrite)."""
    cause = e.__cause__ if e.__cause__ is not None else e  # s3fs raises boto's ClientError as an OSError
    code = (getattr(cause, "response", None) or {}).get("Error", {}).get("Code")
    return code in CONFLICT


def _bucket_key(folder: Any) -> Tuple[str, str]:
    bucket, _, prefix = folder.key.partition("/")
    return bucket, f"{prefix}/{NAME}".lstrip("/")


def _s3(folder: Any, method: str, **kwargs: Any) -> Dict[str, Any]:
    bucket, key = _bucket_key(folder)
    return folder.fs.call_s3(method, Bucket=bucket, Key=key, **kwargs)


def _put(folder: Any, holder: Dict[str, Any], **condition: str) -> str:
    """The lock written, where `condition` holds: its new ETag."""
    body = json.dumps(holder).encode()
    return _s3(folder, "put_object", Body=body, ContentType="application/json", **condition)["ETag"]


def _read(folder: Any) -> Optional[Tuple[Dict[str, Any], str, float]]:
    """The lock's holder, ETag and age in seconds by the store's clock, from one GET; None where there is none."""
    from fsspec.asyn import sync

    fs = folder.fs
    bucket, key = _bucket_key(folder)

    async def get() -> Tuple[bytes, Dict[str, Any]]:
        answer = await fs._call_s3("get_object", Bucket=bucket, Key=key)
        try:
            return await answer["Body"].read(), answer
        finally:
            answer["Body"].close()

    try:
        body, answer = sync(fs.loop, get)
    except FileNotFoundError:
        return None
    holder = _holder_of(body)
    date = (answer.get("ResponseMetadata", {}).get("HTTPHeaders", {}) or {}).get("date")
    store_now = email.utils.parsedate_to_datetime(date).timestamp() if date else time.time()
    return holder, answer["ETag"], max(0.0, store_now - answer["LastModified"].timestamp())
