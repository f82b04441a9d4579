"""Where tpudist's program cache keeps its bytes: a local folder, or any fsspec filesystem.

Both storages offer the same few operations (``read``, ``write_atomic``, ``touch``, ``listing``,
``remove``): :class:`tpudist.runtime.program_cache.ProgramCache` decides what to store, these only how. A
write goes to a temporary name in the same folder and is renamed into place, so concurrent writers
race harmlessly and a reader never opens half a file.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: evictions there go unlocked
    fcntl = None

log = logging.getLogger(__name__)

TMP_PREFIX = ".tmp-"


def _tmp_name() -> str:
    return f"{TMP_PREFIX}{os.getpid()}-{threading.get_ident()}-{os.urandom(4).hex()}"


class Local:
    """A folder of this machine (or a network filesystem mounted here)."""

    def __init__(self, path: str):
        self.path = Path(path).expanduser()

    def join(self, name: str) -> str:
        return str(self.path / name)

    def read(self, name: str) -> bytes | None:
        try:
            return (self.path / name).read_bytes()
        except FileNotFoundError:
            return None

    def write_atomic(self, name: str, data: bytes) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        # os.open with 0o666 honours the umask (mkstemp's 0600 would hide entries from other users
        # of a shared cache); the random part keeps concurrent writers apart.
        tmp = self.path / _tmp_name()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self.path / name)  # atomic within one folder, on NFS too
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def touch(self, name: str) -> None:
        try:
            os.utime(self.path / name)  # the access time eviction orders by
        except OSError:  # removed meanwhile, or a read-only shared cache: not worth failing for
            pass

    @contextlib.contextmanager
    def exclusive(self):
        """Held by one process of this machine at a time (a ``flock`` on the folder itself, so no
        extra file appears in it): evictions list and remove under it. A listing reads the names,
        then stats each; another process removing entries in between made one see a fraction of
        the folder (stressed: 0 of 10 entries), call it small, and put past the bound unlisted.
        Where the filesystem refuses the lock (some network mounts), evictions go unlocked."""
        if fcntl is None:
            yield
            return
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            yield
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError as e:
                log.debug("tpudist.runtime.program_cache: cannot lock %s (%s); evicting unlocked", self.path, e)
            yield
        finally:
            os.close(fd)  # closing releases the lock

    def listing(self) -> list[tuple[str, int, float]]:
        """(name, size, mtime) of every file, temporary ones included."""
        out = []
        try:
            entries = list(os.scandir(self.path))
        except FileNotFoundError:
            return out
        for e in entries:
            try:
                st = e.stat()
            except FileNotFoundError:
                continue
            out.append((e.name, st.st_size, st.st_mtime))
        return out

    def remove(self, name: str) -> bool:
        try:
            (self.path / name).unlink()
            return True
        except OSError:  # another process evicted it first, or a read-only share
            return False


class Fsspec:
    """Any fsspec filesystem. Writes go to a temporary name and are moved into place (object
    stores make each object visible whole anyway); the checksum catches what a backend does not."""

    def __init__(self, url: str):
        import fsspec

        self.fs, self.path = fsspec.core.url_to_fs(url)
        self.path = self.path.rstrip("/")
        self.url = url

    def join(self, name: str) -> str:
        return f"{self.path}/{name}"

    def read(self, name: str) -> bytes | None:
        try:
            return self.fs.cat_file(self.join(name))
        except FileNotFoundError:
            return None

    def write_atomic(self, name: str, data: bytes) -> None:
        tmp = self.join(_tmp_name())
        self.fs.makedirs(self.path, exist_ok=True)
        self.fs.pipe_file(tmp, data)
        try:
            self.fs.mv(tmp, self.join(name))
        except BaseException:
            self.fs.rm_file(tmp)
            raise

    @contextlib.contextmanager
    def exclusive(self):
        yield  # no portable lock across an object store's clients: evictions go unlocked

    def touch(self, name: str) -> None:
        pass  # fsspec has no portable way to bump a time without rewriting: eviction goes by write time

    def listing(self) -> list[tuple[str, int, float]]:
        try:
            infos = self.fs.ls(self.path, detail=True)
        except FileNotFoundError:
            return []
        out = []
        for info in infos:
            if info.get("type") == "directory":
                continue
            modified = info.get("mtime") or info.get("LastModified") or info.get("created") or 0
            if hasattr(modified, "timestamp"):
                modified = modified.timestamp()
            out.append((info["name"].rstrip("/").rsplit("/", 1)[-1], int(info.get("size") or 0), float(modified)))
        return out

    def remove(self, name: str) -> bool:
        try:
            self.fs.rm_file(self.join(name))
            return True
        except OSError:  # another process evicted it first, or no permission
            return False


def storage_for(root: str) -> Local | Fsspec:
    if "://" not in root:
        return Local(root)
    try:
        import fsspec  # noqa: F401
    except ImportError:
        raise ValueError(f"TPUDIST_CACHE_DIR={root!r} is a URL, which needs fsspec: pip install fsspec, "
                         "or give a path (a network filesystem mounted on every host)") from None
    from fsspec.implementations.local import LocalFileSystem

    store = Fsspec(root)
    if isinstance(store.fs, LocalFileSystem):
        return Local(store.path)  # file://: atomic rename and utime, which fsspec does not promise
    return store
