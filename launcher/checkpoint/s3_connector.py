"""The heavy traffic of s3:// checkpoints through s3torchconnector (the `s3` extra: AWS's S3 connector for
PyTorch, a client on the AWS Common Runtime): DCP's shards written and read by its DCP storage, model.pt and
state.pt streamed up and down by its client. Measured against s3fs (`python -m launcher.bench --saves`,
launcher/bench/saves/s3_clients.py) it saves both formats and loads shards faster, with less memory; it loads a
whole file slower from moto's loopback server only, whose every ranged GET reads the whole object (this
client fetches a large object as parallel 8 MiB ranges, as S3 serves best). Listings, deletions, manifests
and every other fsspec URL stay with fsspec and s3fs (storage.py).

It talks to the store s3fs found: the endpoint s3fs resolved (AWS_ENDPOINT_URL, AWS_ENDPOINT_URL_S3, the
AWS config files), the bucket's region as the store gives it, AWS_MAX_ATTEMPTS where set; its credentials
come from the same standard places (the AWS SDK's chain), read by the client itself: nothing here holds
them. A process makes one client for each such setting and checks once that it signs its requests, since
without credentials the client's first upload fails with a misleading message (and a panic at exit).

Where s3torchconnector is not installed, s3:// goes through s3fs alone (slower, equally safe): a run
says so once (storage.reachable). `pip uninstall s3torchconnector` asks for that on purpose (a store that
its client cannot talk to); the two clients read each other's checkpoints.

Imported only where an s3:// URL is used; s3torchconnector itself only where it carries one."""

from __future__ import annotations

import contextlib
import errno
import functools
import importlib.util
import re
import threading
from typing import Any, Dict, Iterator, Optional, Tuple

from launcher.errors import first_line

PROTOCOLS = ("s3", "s3a")
NO_CREDENTIALS = ("no credentials for the object store; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or "
                  "AWS_PROFILE, or run where an instance role gives them)")
INSTALL = "pip install 'launcher[s3]'"


@functools.lru_cache(maxsize=1)
def installed() -> bool:
    return importlib.util.find_spec("s3torchconnector") is not None


def carries(remote: Any) -> bool:
    """Whether s3torchconnector moves this Remote's objects (an s3:// URL, the client installed, and the
    Remote's `client` not s3fs)."""
    return remote.protocol in PROTOCOLS and remote.client != "s3fs" and installed()


def declined_note(remote: Any) -> Optional[str]:
    """The line a run says when s3:// goes through s3fs because s3torchconnector is missing, or None."""
    if remote.protocol in PROTOCOLS and remote.client == "auto" and not installed():
        return (f"s3:// checkpoints go through s3fs: s3torchconnector, the faster client, is not installed ({INSTALL} "
                f"installs both)")
    return None


def upload(remote: Any) -> Any:
    """A stream that writes the object whole once closed (a multipart upload, its parts sent as it fills;
    left incomplete, and so absent, where the block it is used in raises)."""
    bucket, key = _bucket_key(remote)
    made = client(remote)
    with _as_os_errors(str(remote)):
        return _Upload(made.put_object(bucket, key))


def download(remote: Any) -> bytes:
    """The object's bytes, its parts fetched side by side."""
    bucket, key = _bucket_key(remote)
    made = client(remote)
    with _as_os_errors(str(remote)), made.get_object(bucket, key) as reader:
        return reader.read()


@contextlib.contextmanager
def _as_os_errors(where: Optional[str] = None) -> Iterator[None]:
    """s3torchconnector's S3Exception raised as as_os_error's OSError."""
    try:
        yield
    except Exception as e:
        if type(e).__name__ != "S3Exception":  # its module is imported only where it is used: told by name
            raise
        raise as_os_error(e, where) from None


def dcp_writer(remote: Any) -> Any:
    """s3torchconnector's DCP writer of a folder's URL, on this module's client (its own takes no endpoint)."""
    from s3torchconnector.dcp import S3StorageWriter
    from s3torchconnector.dcp.s3_file_system import S3FileSystem

    made = client(remote)
    writer = S3StorageWriter(made.region, str(remote))
    writer.fs = S3FileSystem(made.region, s3_client=made)
    return writer


@functools.lru_cache(maxsize=1)
def dcp_reader() -> type:
    """s3torchconnector's DCP reader, made from a folder's Remote, on this module's client: the items a load
    asks for fetched by ranged GETs, adjacent ones in one, no byte between them (its default fills gaps of up
    to 32 MB: a rank resharding a checkpoint would fetch other ranks' parts, the run state read at resume
    fetched again with the model)."""
    from s3torchconnector import S3ReaderConstructor
    from s3torchconnector.dcp import S3StorageReader
    from s3torchconnector.dcp.s3_file_system import S3FileSystem

    class Reader(S3StorageReader):
        def __init__(self, folder: Any):
            made = client(folder)
            super().__init__(made.region, str(folder), reader_constructor=S3ReaderConstructor.dcp_optimized(max_gap_size=0))
            self.fs = S3FileSystem(made.region, s3_client=made, reader_constructor=self._reader_constructor)

    return Reader


def client(remote: Any) -> Any:
    """This process's s3torchconnector client for the store that the Remote's s3fs resolved, checked once to
    sign its requests (an OSError where it cannot: no credentials, no bucket, no store answering)."""
    settings = _settings(remote)
    with _lock:
        made = _clients.get(settings)
    if made is None:
        made = _made(settings, remote)
        with _lock:
            made = _clients.setdefault(settings, made)
    return made


_clients: Dict[Tuple[Any, ...], Any] = {}  # one client (its threads, its connections) a setting, a process
_regions: Dict[Tuple[Optional[str], str], str] = {}  # (endpoint, bucket) -> region, as the store said
_lock = threading.Lock()


def _settings(remote: Any) -> Tuple[Any, ...]:
    """(endpoint or None for AWS's own, region, path-style addressing, attempts or None) as s3fs resolved them."""
    fs = remote.fs
    fs.connect()  # s3fs's client, made from the environment and the AWS config files
    meta = fs.s3.meta
    endpoint = meta.endpoint_url
    aws = bool(re.search(r"(^|\.)amazonaws\.com(\.cn)?$", _host(endpoint)))
    endpoint = None if aws else endpoint  # AWS's: the client finds the region's endpoint itself
    bucket = _bucket_key(remote)[0]
    region = _regions.get((endpoint, bucket))
    if region is None:
        region = _bucket_region(fs, bucket) or meta.region_name or "us-east-1"
        _regions[(endpoint, bucket)] = region
    style = (meta.config.s3 or {}).get("addressing_style")
    path_style = style == "path" or (not aws and style != "virtual")  # MinIO, Ceph, moto: path-style
    attempts = (meta.config.retries or {}).get("total_max_attempts")
    return endpoint, region, path_style, attempts


def _bucket_region(fs: Any, bucket: str) -> Optional[str]:
    """The bucket's region as the store gives it (HEAD bucket), or None where it says nothing."""
    try:
        answer = fs.call_s3("head_bucket", Bucket=bucket)
    except Exception:  # noqa: BLE001 - absent, refused: the client's check below says which
        return None
    return answer.get("BucketRegion") or answer.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("x-amz-bucket-region")


def _made(settings: Tuple[Any, ...], remote: Any) -> Any:
    from s3torchconnector import S3ClientConfig
    from s3torchconnector._s3client import S3Client

    _quiet_at_fork()
    endpoint, region, path_style, attempts = settings
    config = S3ClientConfig(force_path_style=path_style, **({"max_attempts": attempts} if attempts else {}))
    made = S3Client(region, endpoint=endpoint, s3client_config=config)
    bucket, key = _bucket_key(remote)
    try:  # a HEAD of a key that need not exist: answered, the client signs and reaches the bucket
        with _as_os_errors(f"{remote.protocol}://{bucket}"):
            made.head_object(bucket, f"{key}/.launcher-probe".lstrip("/"))
    except FileNotFoundError as e:
        if e.strerror != "no such object":
            raise
    return made


@functools.lru_cache(maxsize=1)
def _quiet_at_fork() -> None:
    """At every fork of this process (a data loader's workers starting), s3torchconnector drops its clients and
    waits up to 0.5 s for its threads; where an upload is running then (a background save), it prints a traceback
    and a warning that the child may hang if it uses S3. The launcher's children never do: the wait stays, the
    traceback and warning go (s3torchconnector 1.5.0's module global, looked up at each fork)."""
    from s3torchconnector._s3client import _s3client as module

    join = module.join_all_managed_threads

    def joined(timeout: float) -> None:
        try:
            join(timeout)
        except RuntimeError:  # "Failed to join managed threads": the upload goes on, in this process alone
            pass

    module.join_all_managed_threads = joined


def as_os_error(e: BaseException, where: Optional[str] = None) -> OSError:
    """s3torchconnector's S3Exception as the OSError a disk's failure would be, its text made one short line:
    the store's error code and message, or the runtime's error name and description."""
    text = first_line(e)
    if "No signing credentials" in text:
        return PermissionError(errno.EACCES, NO_CREDENTIALS, where)
    if "bucket does not exist" in text or "<Code>NoSuchBucket</Code>" in text:
        return FileNotFoundError(errno.ENOENT, "no such bucket", where)
    if "object was not found" in text or "<Code>NoSuchKey</Code>" in text:
        return FileNotFoundError(errno.ENOENT, "no such object", where)
    if "Forbidden" in text or "<Code>AccessDenied</Code>" in text:
        message = re.search(r"<Message>([^<]*)</Message>", text) or re.search(r"Forbidden: (.*)", text)
        return PermissionError(errno.EACCES, message.group(1).strip() if message else "Access Denied", where)
    served = re.search(r"<Code>([^<]*)</Code>\s*<Message>([^<]*)</Message>", text)
    runtime = re.search(r"aws-c-\w+: (AWS_\w+), ([^.]*)", text)
    if served:
        detail = f"{served.group(2)} ({served.group(1)})"
    elif runtime:
        detail = f"{runtime.group(2)} ({runtime.group(1)})"
    else:
        detail = re.sub(r"^(Client|Service) error: ", "", text)[:200]
    return OSError(errno.EIO, f"S3Exception: {detail}")


class _Upload:
    """s3torchconnector's writer, its failures raised as OSErrors (as a disk's are: files.py tells them apart)."""

    def __init__(self, writer: Any):
        self.writer = writer

    def write(self, data: Any) -> int:
        with _as_os_errors():
            return self.writer.write(data)

    def tell(self) -> int:
        return self.writer.tell()

    def close(self) -> None:
        with _as_os_errors():  # the upload did not complete: nothing stored
            self.writer.close()

    def __enter__(self) -> "_Upload":
        return self

    def __exit__(self, kind: Any, *rest: Any) -> None:
        if kind is None:  # else left incomplete: the store keeps nothing of it
            self.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.writer, name)


def _bucket_key(remote: Any) -> Tuple[str, str]:
    bucket, _, key = remote.key.partition("/")
    return bucket, key


def _host(url: Optional[str]) -> str:
    return re.sub(r"^\w+://", "", url or "").split("/")[0].split(":")[0]
