"""Where `pieceworks quantize` writes: the checks on SRC and DST before anything is written (DST new or
empty, not SRC nor inside it, on a disk with room for the output), and the staging directory the run
writes into.

A run writes nothing into DST itself. It writes into a hidden staging directory beside DST (same parent,
so on the same file system), `.DSTNAME.quantize-HOST-PID.tmp`, and only when every file is complete (and
synced to disk) renames it to DST with one `os.rename`, which is atomic on POSIX: whatever kills the run
(an exception, Ctrl-C, SIGKILL, the OOM killer, a power loss), DST is either absent (or the empty
directory it was) or a complete checkpoint. A run that fails removes its staging directory and the
parent directories it created; one that is killed leaves its staging directory, and the next run into
the same DST on the same host removes it once its process is gone and no process holds its lock
(`Staging.clear_stale`; a run holds an flock on its staging directory while it writes, since a run's pid in
another PID namespace can look gone). Two runs racing into one DST both write their own staging directory;
the first rename wins and the other run fails with the DST named, leaving the winner's checkpoint
untouched.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import shutil
import socket
import stat
import threading
from pathlib import Path

from pieceworks.models.checkpoint import CheckpointReader

_ACTIVE: set[Path] = set()  # staging directories this process is writing (threads may run quantize too)
_ACTIVE_LOCK = threading.Lock()


def check_dirs(src: Path, dst: Path, reader: CheckpointReader) -> dict:
    config = reader.config()
    qc = config.get("quantization_config")
    if qc is not None or (src / "hf_quant_config.json").exists():
        method = qc.get("quant_method") if isinstance(qc, dict) else "modelopt"
        raise ValueError(
            f"{src}: already quantized (quant_method {method!r}); quantize needs a bf16, fp16 or fp32 "
            "checkpoint"
        )
    # Compared by inode after resolving, so symlinks, `..`, relative paths and bind mounts all count.
    src_stat = src.stat()
    real = dst.resolve()
    for i, d in enumerate((real, *real.parents)):
        if d.exists() and os.path.samestat(d.stat(), src_stat):
            if i == 0:
                raise ValueError(f"{dst}: the destination is the source {src} (quantize writes a new checkpoint "
                                 "and keeps the bf16 one); choose a new or empty directory outside SRC")
            raise ValueError(f"{dst}: the destination lies inside the source {src} (the NVFP4 checkpoint would be "
                             "mixed into the bf16 one: copying or uploading SRC takes it along); choose a directory "
                             "outside it")
    if dst.is_symlink() and not dst.exists():
        raise ValueError(f"{dst}: a symlink to {os.readlink(dst)}, which does not exist; create that directory or "
                         "choose another DST")
    if dst.exists() and not dst.is_dir():
        raise ValueError(f"{dst}: is a file; DST is the directory the checkpoint goes to: choose a new one")
    if dst.exists() and any(dst.iterdir()):
        raise ValueError(f"{dst}: exists and is not an empty directory; choose a new one")
    if dst.exists() and is_mount_point(real):
        raise ValueError(f"{dst}: an empty file system of its own (a mount point); quantize writes beside DST and "
                         "renames the finished checkpoint to DST, which cannot cross file systems: choose a new "
                         f"directory inside it, e.g. {dst / 'nvfp4'}")
    return config


def is_mount_point(real: Path) -> bool:
    """Whether the existing directory `real` is on another file system than its parent directory."""
    return real != real.parent and os.stat(real).st_dev != os.stat(real.parent).st_dev


def check_space(dst: Path, nbytes: int, others: list[Path] = ()) -> None:
    """Refuse before writing when the file system that would hold dst's staging directory (dst's parent's)
    has less than nbytes free. `others`: other runs' staging directories there, named in the error."""
    parent = dst.resolve().parent
    where = next(d for d in (parent, *parent.parents) if d.exists())
    usage = shutil.disk_usage(where)
    if usage.total and usage.free < nbytes:  # total 0: a file system that keeps no count
        hint = ""
        if others:
            hint = (f" ({others[0]} is left by another quantize run into the same DST, still running or on "
                    "another host: remove it if it is not)")
        raise ValueError(f"{dst}: the NVFP4 checkpoint needs {_size(nbytes)} and {where} has {_size(usage.free)} "
                         f"free{hint}; free some space or choose a DST on another disk")


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 10**8 else f"{nbytes / 1e6:.2f} MB"


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".index.json")
"""The source's weights in any format, and their indexes (`pytorch_model.bin` beside the safetensors, as many
repositories ship them; the quantized safetensors replace them all)."""


def copied_files(src: Path) -> list[Path]:
    """The source's files that go to the output as they are (tokenizer, generation config, ...); not its weights
    (`WEIGHT_SUFFIXES`), nor the record of pieceworks' demo-model cache (`pieceworks-cache.json`), which describes
    the source's own conversion. Subdirectories (e.g. `original/` with the consolidated weights) stay behind."""
    skip = {"config.json", "hf_quant_config.json", "pieceworks-cache.json"}
    return sorted(f for f in src.iterdir()
                  if f.is_file() and f.name not in skip and not f.name.endswith(WEIGHT_SUFFIXES))


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname()) or "localhost"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _locked_elsewhere(path: Path) -> bool:
    """Whether another open file description holds the flock of directory `path` (a run writing it)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        return e.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
    finally:
        os.close(fd)  # and with it the lock this test took
    return False


class Staging:
    """The hidden directory beside DST that a run writes into, renamed to DST when complete.

    `path` is `.DSTNAME.quantize-HOST-PID.tmp` in the parent of DST (after resolving symlinks, so an existing
    empty DST reached through a symlink is replaced where it lies).
    """

    def __init__(self, dst: Path):
        self.dst = dst
        self.real = dst.resolve()
        self._prefix = f".{self.real.name}.quantize-"
        self.path = self.real.parent / f"{self._prefix}{_host()}-{os.getpid()}.tmp"
        self._created: list[Path] = []
        self._published = False
        self._emptied: int | None = None  # the mode of the empty DST removed for the rename
        self._lock: int | None = None  # an fd of the staging directory holding its flock while the run writes

    def clear_stale(self) -> list[Path]:
        """Remove the staging directories of runs into this DST that were killed: this host's, whose process is
        gone (one with this process's own pid is from an earlier process that had it, unless this process is
        writing it now). Returns the others (running, or from another host, whose pids mean nothing here)."""
        pattern = re.compile(re.escape(self._prefix) + r"(.+)-([0-9]+)\.tmp")
        others = []
        try:
            entries = list(self.real.parent.iterdir())
        except OSError:  # the parent does not exist yet (or cannot be read: creating the staging dir will say)
            return []
        host = _host()
        for p in entries:
            m = pattern.fullmatch(p.name)
            if not m or p.is_symlink() or not p.is_dir():
                continue
            pid = int(m.group(2))
            with _ACTIVE_LOCK:
                active = p in _ACTIVE
            if m.group(1) == host and pid > 0 and not active and (pid == os.getpid() or not _pid_alive(pid)) \
                    and not _locked_elsewhere(p):
                shutil.rmtree(p, ignore_errors=True)
            else:
                others.append(p)
        return others

    def create(self) -> None:
        """Create the staging directory (and the missing parent directories of DST)."""
        with _ACTIVE_LOCK:
            if self.path in _ACTIVE:
                raise ValueError(f"{self.dst}: another quantize run in this process is writing it; wait for it or "
                                 "choose another DST")
            _ACTIVE.add(self.path)
        self._created = [d for d in (self.path, *self.path.parents) if not d.exists()]
        try:
            self.path.mkdir(parents=True)
        except OSError as e:
            self._forget()
            _rmdirs(self._created)
            raise ValueError(f"{self.dst}: cannot create the destination directory ({e.strerror}: {e.filename}); "
                             f"quantize writes into {self.path.name} beside it and renames that to DST when "
                             "complete: choose a DST in a directory where you can write") from None
        try:  # best effort: a file system without locks leaves the pid test alone
            self._lock = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._unlock()

    def publish(self) -> None:
        """Sync the staging directory's files to disk and rename it to DST (removing DST first when it is an
        empty directory). DST created or filled meanwhile (another run) is left as it is: ValueError."""
        _sync_tree(self.path)
        try:
            st = os.lstat(self.real)
        except FileNotFoundError:
            st = None
        if st is not None and stat.S_ISDIR(st.st_mode):
            try:
                os.rmdir(self.real)  # fails when something appeared in it meanwhile
                self._emptied = stat.S_IMODE(st.st_mode)
            except FileNotFoundError:
                pass
            except OSError as e:
                clash = e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR)
                raise self._clash() if clash else self._cannot_move(e) from None
        try:
            os.rename(self.path, self.real)
        except OSError as e:
            raise self._clash() if os.path.lexists(self.real) else self._cannot_move(e) from None
        self._published = True
        self._forget()
        if self._emptied is not None:
            try:
                os.chmod(self.real, self._emptied)  # DST keeps the mode it had
            except OSError:
                pass
        _sync_dir(self.real.parent)

    def discard(self) -> None:
        """After a failed run: remove the staging directory and the parent directories created for it. Best
        effort: the run's own error is the one to report."""
        if self._published:
            return
        shutil.rmtree(self.path, ignore_errors=True)
        if self._emptied is not None:  # the empty DST removed for the rename: put it back
            try:
                os.mkdir(self.real)
                os.chmod(self.real, self._emptied)
            except OSError:  # another run's DST is there now
                pass
        self._forget()
        _rmdirs([d for d in self._created if d != self.path])

    def _forget(self) -> None:
        self._unlock()
        with _ACTIVE_LOCK:
            _ACTIVE.discard(self.path)

    def _unlock(self) -> None:
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def _clash(self) -> ValueError:
        return ValueError(f"{self.dst}: was created or filled by someone else (another quantize run into the same "
                          "DST?) while this run was writing; it is left as it is and this run's output is removed: "
                          "choose a new DST, or remove that one and run again")

    def _cannot_move(self, e: OSError) -> ValueError:
        return ValueError(f"{self.dst}: cannot move the finished checkpoint from {self.path.name} to DST "
                          f"({e.strerror}); this run's output is removed: choose a DST in a directory where you "
                          "can write")


def _rmdirs(created: list[Path]) -> None:
    """Remove directories created for the run, deepest first, while they are empty."""
    for d in created:
        try:
            d.rmdir()
        except FileNotFoundError:  # never made (its parent's mkdir failed)
            continue
        except OSError:
            break


def _sync_tree(root: Path) -> None:
    """fsync every file under root and the directories, so a rename that survives a power loss names files whose
    bytes survived too."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _sync_dir(Path(dirpath))


def _sync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems cannot sync a directory
        pass
    finally:
        os.close(fd)
