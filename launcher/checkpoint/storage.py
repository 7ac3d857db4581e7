"""Where checkpoints live: a local folder, a pathlib.Path (a file:// URL names one too), or a folder of an
object store named by a URL, s3://bucket/prefix, a Remote (fsspec's other URLs too: memory:// in tests; a run
names s3:// alone, checked by `reachable`).

A Remote offers the few Path methods that checkpoints use (/, name, parent, suffix, exists, is_file, is_dir,
iterdir, glob, open, read_text, read_bytes, write_bytes), plus size(), listing() (sizes and ETags) and remove(),
so that the code that reads a manifest or lists step folders reads both; and upload() and download() for the
large objects (model.pt, state.pt). What differs is said where it differs (layout.py): a local checkpoint is
made complete by a rename, a remote one by its manifest, written last, since an object store has no rename.
fsspec and its S3 file system (s3fs, the `s3` extra) are imported only when a URL is used; on s3:// the large
objects and DCP's shards go through s3torchconnector (s3_connector.py, in the same extra) where it is installed.

Credentials and endpoints come from where the AWS SDK reads them (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
AWS_ENDPOINT_URL for S3-compatible stores, AWS_PROFILE and its files, an instance role): nothing here
writes them anywhere."""

from __future__ import annotations

import errno
import fnmatch
import posixpath
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

from launcher.checkpoint import s3_connector
from launcher.errors import UserError, first_line


LOCAL = "file://"


def is_url(where: Any) -> bool:
    """Whether `where` names an object store's folder (a file:// URL is a local folder)."""
    return isinstance(where, Remote) or ("://" in str(where) and not str(where).startswith(LOCAL))


def location(where: Any, client: str = "auto", key: str = "") -> Union[Path, "Remote"]:
    """A Path (file:///path, file://localhost/path, as fsspec reads them, too), or a Remote for a URL (its s3://
    objects moved through `client`: Remote's). `key`: the recipe's key that names it, for a mistake's line."""
    if isinstance(where, (Path, Remote)):
        return where
    if str(where).startswith(LOCAL):
        host, slash, path = str(where)[len(LOCAL):].partition("/")
        if host not in ("", "localhost"):  # file://host/path: not a folder of this machine (nor host/path here)
            raise UserError(f"{key + ': ' if key else ''}{where}: a file:// URL names a folder of this machine (file:///path or "
                            f"file://localhost/path), not one on {host}; {USE}")
        return Path(slash + path)
    if not is_url(where):
        _not_a_url(str(where), key)
    return Remote(str(where), client=client) if is_url(where) else Path(where)


# A scheme (two characters at least: C:/ is a drive elsewhere) and its colon, not followed by //: s3:/b/x, s3:b/x.
_SCHEME_LIKE = re.compile(r"([A-Za-z][A-Za-z0-9+.-]+):(/*)(.*)", re.DOTALL)


def _not_a_url(where: str, key: str) -> None:
    """Refuse a path that begins as a URL does but is not one (s3:/bucket/x, one slash): it would be a local
    folder `./s3:/bucket/x`, and the run would seem to save to the store while writing here."""
    m = _SCHEME_LIKE.fullmatch(where)
    if m is None:
        return
    scheme, rest = m.group(1), m.group(3)
    url = f"{LOCAL}/{rest}" if scheme.lower() == "file" else f"{scheme}://{rest}"
    raise UserError(f"{key + ': ' if key else ''}{where}: begins as a URL does ({scheme}:) without the // that "
                    f"follows a URL's scheme, so it would be the local folder ./{where}; write {url} if a URL is "
                    f"meant, or ./{where} for a local folder of that name")


def is_remote(where: Any) -> bool:
    return isinstance(where, Remote)


def size(where: Union[Path, "Remote"]) -> int:
    return where.size() if is_remote(where) else where.stat().st_size


def same(a: Union[Path, "Remote"], b: Union[Path, "Remote"]) -> bool:
    """The same folder (local ones resolved first)."""
    if is_remote(a) or is_remote(b):
        return str(a) == str(b)
    return Path(a).resolve() == Path(b).resolve()


class Remote:
    """A file or folder of an object store, by URL. Its children share its file system object and its
    `client` for s3://'s large objects: auto (s3torchconnector where installed, else s3fs), or s3fs (the
    benchmark compares them: launcher/bench/saves/s3_clients.py)."""

    def __init__(self, url: str, fs: Any = None, client: str = "auto"):
        self.url = url.rstrip("/")
        self.protocol, _, self.key = self.url.partition("://")
        self._fs, self.client = fs, client

    @property
    def fs(self) -> Any:
        if self._fs is None:
            self._fs = _filesystem(self.protocol, str(self))
        return self._fs

    def __truediv__(self, name: str) -> "Remote":
        return Remote(f"{self.url}/{name}", self._fs, self.client)

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"Remote({self.url!r})"

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Remote) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)

    @property
    def name(self) -> str:
        return posixpath.basename(self.key)

    @property
    def suffix(self) -> str:
        return posixpath.splitext(self.name)[1]

    @property
    def parent(self) -> "Remote":
        return Remote(f"{self.protocol}://{posixpath.dirname(self.key)}", self._fs, self.client)

    def exists(self) -> bool:
        return self.fs.exists(self.key)

    def is_file(self) -> bool:
        return self.fs.isfile(self.key)

    def is_dir(self) -> bool:
        return self.fs.isdir(self.key)

    def iterdir(self) -> List["Remote"]:
        """The objects and prefixes right under this one."""
        try:
            listed = self.fs.ls(self.key, detail=False)
        except FileNotFoundError:
            return []
        names = {posixpath.basename(p.rstrip("/")) for p in listed}
        return [self / n for n in sorted(names) if n]

    def listing(self) -> Dict[str, Dict[str, Any]]:
        """The objects right under this prefix, by name: their size and the store's ETag (None where the store
        gives none), from one listing, nothing downloaded. An S3 store computes an object's ETag from the bytes
        it received, so an object replaced or changed has another."""
        try:
            listed = self.fs.ls(self.key, detail=True)
        except FileNotFoundError:
            return {}
        return {posixpath.basename(e["name"].rstrip("/")): {"size": e.get("size"), "etag": e.get("ETag") or e.get("etag")}
                for e in listed if e.get("type") != "directory"}

    def glob(self, pattern: str) -> List["Remote"]:
        return [p for p in self.iterdir() if fnmatch.fnmatch(p.name, pattern)]

    def open(self, mode: str = "rb") -> Any:
        return self.fs.open(self.key, mode)

    def read_bytes(self) -> bytes:
        try:
            return self.fs.cat_file(self.key)
        except FileNotFoundError:
            raise _missing(self) from None

    def read_text(self) -> str:
        return self.read_bytes().decode()

    def write_bytes(self, data: bytes) -> None:
        """A small object (a manifest) in one request."""
        self.fs.pipe_file(self.key, data)

    def upload(self) -> Any:
        """A stream that writes a large object, stored whole once closed (s3torchconnector's multipart upload
        where it carries this URL, else fsspec's)."""
        return s3_connector.upload(self) if s3_connector.carries(self) else self.open("wb")

    def download(self) -> bytes:
        """A large object's bytes (s3torchconnector's parts fetched side by side where it carries this URL)."""
        return s3_connector.download(self) if s3_connector.carries(self) else self.read_bytes()

    def size(self) -> int:
        try:
            return self.fs.size(self.key)
        except FileNotFoundError:
            raise _missing(self) from None

    def remove(self) -> None:
        """This object, or every object under this prefix; gone already is fine."""
        try:
            self.fs.rm(self.key, recursive=True)
        except FileNotFoundError:
            pass


def _missing(where: Remote) -> FileNotFoundError:
    return FileNotFoundError(errno.ENOENT, "no such object", str(where))


def fresh(protocol: str) -> Dict[str, Any]:
    """fsspec's options for a file system of its own, listing afresh: fsspec's shared instances are keyed by
    their arguments, not by the environment they read credentials and the endpoint from when made."""
    return {"skip_instance_cache": True, **({"use_listings_cache": False} if protocol in ("s3", "s3a") else {})}


def _filesystem(protocol: str, url: str) -> Any:
    """A file system object of its own (not fsspec's shared instance: credentials are read when it is made),
    listing afresh each time (another process may have written since)."""
    try:
        import fsspec
    except ImportError:
        raise UserError(f"checkpoint.dir: {url} needs fsspec; pip install 'launcher[s3]'") from None
    try:
        return fsspec.filesystem(protocol, **fresh(protocol))
    except ImportError as e:
        package = "s3fs; pip install 'launcher[s3]'" if protocol in ("s3", "s3a") else f"its package ({first_line(e)})"
        raise UserError(f"checkpoint.dir: {url} needs {package}") from None
    except ValueError as e:  # fsspec: "Protocol not known"
        raise UserError(f"checkpoint.dir: {url}: {first_line(e)}; {USE}") from None


def reachable(folder: Remote, key: str = "checkpoint.dir") -> Optional[str]:
    """One line naming `key`, before anything trains, where the URL names no store a checkpoint can live in
    (supported), or the store cannot be reached: no such bucket, no credentials, no endpoint answering. Returns a
    line to say, or None: that s3:// goes through s3fs alone."""
    supported(folder, key)
    bucket = folder.key.split("/")[0]
    try:
        if folder.protocol in s3_connector.PROTOCOLS:
            folder.fs.info(bucket)  # the bucket itself (HEAD): absent, or refused, says so
            if s3_connector.carries(folder):
                s3_connector.client(folder)  # and the client of the large objects signs its requests
        else:
            folder.fs.exists(folder.key)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - boto's and fsspec's errors, told apart by name
        raise UserError(f"{key}: {folder}: {_why(e, bucket)}") from None
    return s3_connector.declined_note(folder)


STORES = ("s3", "s3a")
USE = "use a local folder (a path, or file:///path) or s3://bucket/prefix (S3 and S3-compatible stores)"
# A key's characters that both clients read as written: s3fs takes `?versionId=` as a version, `?`, `*` and `[` as
# a glob when it deletes, and DCP's fsspec writer `::` as a chain of file systems, where s3torchconnector and
# boto write the literal key. AWS's "safe characters" (less `*`), the letters of any script, and = , + (the run
# names of a sweep).
_KEY = re.compile(r"[\w!\-.'()=,+]+")
_BUCKET = re.compile(r"[A-Za-z0-9._-]+")  # AWS's rules, and the uppercase and _ of its old buckets and other stores
KEY_CHARACTERS = "letters, digits and _ - . ! ' ( ) = , + between slashes"


def supported(folder: Remote, key: str) -> None:
    """Refuse (one line naming `key`) a URL of another scheme than s3:// (memory:// is this process's own: every
    checkpoint would end with it), and an S3 key that the two clients would read differently."""
    scheme = folder.protocol
    if scheme == "memory":
        lost = ("every checkpoint in it would be lost when the run ends" if key == "checkpoint.dir"
                else "it holds nothing another process wrote")
        raise UserError(f"{key}: {folder}: memory:// lives in this process alone, and {lost}; {USE}")
    if scheme not in STORES:
        raise UserError(f"{key}: {folder}: {scheme}:// is not a place for checkpoints; {USE}")
    bucket, _, prefix = folder.key.partition("/")
    if not _BUCKET.fullmatch(bucket):
        odd = sorted({c for c in bucket if not _BUCKET.fullmatch(c)})
        held = f"holds {' '.join(c if c.isprintable() and not c.isspace() else repr(c) for c in odd)}" if odd \
            else "is empty"
        raise UserError(f"{key}: {folder}: the bucket's name {held}; a bucket is named by letters, digits, . - and _ "
                        f"(AWS: 3 to 63 lowercase letters, digits, . and -), as s3://bucket/prefix")
    odd = sorted({c for c in prefix if c != "/" and not _KEY.fullmatch(c)})
    if odd:
        held = " ".join(c if c.isprintable() and not c.isspace() else repr(c) for c in odd)
        raise UserError(f"{key}: {folder}: the key holds {held}; name a prefix of {KEY_CHARACTERS}, which both S3 "
                        f"clients read as written (s3fs takes ?versionId= as a version and ? * [ as a glob)")
    if prefix and {"", ".", ".."} & set(prefix.split("/")):
        raise UserError(f"{key}: {folder}: the key has an empty part (//), or . or .. between slashes, which some "
                        f"S3 clients rewrite; name a prefix of {KEY_CHARACTERS}")


def _why(e: BaseException, bucket: str) -> str:
    kind = type(e).__name__
    text = first_line(e)
    if kind == "NoCredentialsError" or "Unable to locate credentials" in text or s3_connector.NO_CREDENTIALS in text:
        return s3_connector.NO_CREDENTIALS
    if isinstance(e, FileNotFoundError) or "NoSuchBucket" in text:
        return f"no bucket {bucket!r} there; create it, or name an existing one (AWS_ENDPOINT_URL names the store)"
    if isinstance(e, PermissionError) or "AccessDenied" in text or "InvalidAccessKeyId" in text:
        return f"access to bucket {bucket!r} refused ({text[:120]}); check the credentials in AWS_*"
    return f"cannot reach the object store ({kind}: {text[:160]}); check AWS_ENDPOINT_URL and the network"


STORE_CLIENTS = ("botocore", "aiobotocore", "aiohttp", "s3fs", "fsspec", "urllib3", "gcsfs", "google",
                 "s3torchconnector", "s3torchconnectorclient")


def store_error(e: BaseException) -> Optional[OSError]:
    """An object store's failure as the OSError a disk's would be (the store gone, a connection closed mid-upload,
    a request refused), or None for anything else. boto's, aiohttp's and s3torchconnector's errors are told by
    their module: their packages are imported only where a URL is used."""
    if isinstance(e, OSError):
        return e
    if type(e).__name__ == "S3Exception":  # s3torchconnector's, for every failure: its text says which
        return s3_connector.as_os_error(e)
    if any(getattr(kind, "__module__", "").split(".")[0] in STORE_CLIENTS for kind in type(e).__mro__[:-2]):
        return OSError(errno.EIO, f"{type(e).__name__}: {first_line(e)[:200]}")
    return None


def removed(where: Union[Path, Remote]) -> None:
    """A local folder or a remote prefix deleted (gone already, or partly: what is left goes)."""
    if is_remote(where):
        where.remove()
    else:
        import shutil

        shutil.rmtree(where, ignore_errors=True)
