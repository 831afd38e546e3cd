"""Lazy reader for Hugging Face safetensors checkpoints (one file or shards with an index).

No tensor data is loaded up front: opening the reader parses the index and every shard's header
(memory-mapped through `safetensors.safe_open`), and `get` reads one tensor, so loading a model or
streaming it through the quantizer needs memory for about one tensor at a time.

Every problem with the files on disk is found when the reader opens, before any tensor is handed
out, and is a `CheckpointError` (a `ValueError`) that names the file and says what to do: a missing or
invalid index, an index entry whose shard is missing, a file the OS won't read (permission denied), a
truncated or corrupt shard, a tensor the index promises but the shard lacks.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from pieceworks.errors import CheckpointError
from pieceworks.util import checked_stat, unreadable

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

REDOWNLOAD = "re-download or re-export the checkpoint"

# safetensors header dtype names -> torch dtypes (the ones torch can hold).
_DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,  # MX formats' scales: read, so that the loader names the format it is not
}


def _open_error(path: Path, exc: Exception) -> CheckpointError:
    """The error for a safetensors file `safe_open` refused. safetensors reports a file the OS won't
    read as SafetensorError ("No such file or directory" for permission denied), so the file is opened
    here to tell an unreadable file from a truncated or corrupt one."""
    try:
        with path.open("rb"):
            pass
    except IsADirectoryError:
        pass
    except OSError as e:
        return unreadable(path, e)
    return CheckpointError(f"{path}: not a readable safetensors file, truncated or corrupt ({exc}); {REDOWNLOAD}")


class CheckpointReader:
    """Read tensors one at a time from `model.safetensors` or a sharded checkpoint.

    Args:
        model_dir: a directory with `model.safetensors`, or `model.safetensors.index.json` and the
            shards it names (the index wins when both exist, as in `transformers`).

    Raises:
        CheckpointError: no checkpoint in the directory; an invalid index; an index naming a shard
            that is not there, or a tensor its shard lacks; a file the OS won't read; a truncated or
            corrupt file (every shard's header is read here, so this fails before any tensor is
            handed out).
    """

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        st = checked_stat(self.model_dir)
        if st is None or not stat.S_ISDIR(st.st_mode):
            raise CheckpointError(f"{self.model_dir}: not a directory; pass a checkpoint directory")
        self._handles: dict[str, object] = {}
        self.read: set[str] = set()  # names `get` handed out: the loader refuses checkpoints with others
        index = self.model_dir / INDEX_FILE
        if checked_stat(index, where=self.model_dir) is not None:  # the directory can be searched
            self._weight_map = self._read_index(index)
            self._check_shards()
        elif checked_stat(self.model_dir / SINGLE_FILE) is not None:
            self._weight_map = {name: SINGLE_FILE for name in self._handle(SINGLE_FILE).keys()}
        else:
            raise CheckpointError(
                f"{self.model_dir}: no {SINGLE_FILE} or {INDEX_FILE}; pieceworks reads Hugging Face "
                "safetensors checkpoints (save with save_pretrained(..., safe_serialization=True))"
            )

    def _read_index(self, index: Path) -> dict[str, str]:
        try:
            data = json.loads(index.read_text())
            weight_map = data["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except PermissionError as e:
            raise unreadable(index, e) from None
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e}); {REDOWNLOAD}") from None
        odd = next(((n, f) for n, f in weight_map.items() if not isinstance(f, str) or not f), None)
        if odd is not None:
            raise CheckpointError(f"{index}: weight_map[{odd[0]!r}] is {odd[1]!r}, not a shard file name; {REDOWNLOAD}")
        outside = next(((n, f) for n, f in weight_map.items()
                        if Path(f).is_absolute() or ".." in Path(f).parts), None)
        if outside is not None:
            raise CheckpointError(f"{index}: weight_map[{outside[0]!r}] names {outside[1]!r}, outside the model "
                                  f"directory; shard names are file names in it. {REDOWNLOAD}")
        missing = sorted({f for f in weight_map.values() if not (self.model_dir / f).is_file()})
        if missing:
            example = next(n for n, f in weight_map.items() if f == missing[0])
            raise CheckpointError(
                f"{index}: names shard(s) that are not in {self.model_dir}: {', '.join(missing)} "
                f"(e.g. for tensor {example}); {REDOWNLOAD} (all shards)"
            )
        return dict(weight_map)

    def _check_shards(self) -> None:
        """Each shard holds the tensors the index maps to it; one it holds that the index puts in another shard is
        refused (two copies, which readers may take either of), one the index does not list is read as the shard's
        (as transformers reads shards), so that the loader's check for unused tensors sees it."""
        by_file: dict[str, list[str]] = {}
        for name, filename in self._weight_map.items():
            by_file.setdefault(filename, []).append(name)
        unlisted: dict[str, str] = {}
        for filename, names in by_file.items():
            present = self._handle(filename).keys()
            held = set(present)
            lacking = [n for n in names if n not in held]
            if lacking:
                raise CheckpointError(
                    f"{self.model_dir / filename}: lacks {len(lacking)} tensor(s) that {INDEX_FILE} "
                    f"maps to it (e.g. {lacking[0]}); {REDOWNLOAD}"
                )
            for n in present:
                other = self._weight_map.get(n, unlisted.get(n))
                if other is not None and other != filename:
                    raise CheckpointError(f"{self.model_dir}: tensor {n} is in both {filename} and {other} "
                                          f"({INDEX_FILE} maps it to {self._weight_map.get(n, 'neither')}); "
                                          f"{REDOWNLOAD}")
                if n not in self._weight_map:
                    unlisted[n] = filename
        self._weight_map.update(unlisted)

    def _handle(self, filename: str):
        h = self._handles.get(filename)
        if h is None:
            path = self.model_dir / filename
            st = checked_stat(path)
            if st is not None and not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
                raise CheckpointError(f"{path}: not a regular file; {REDOWNLOAD}")  # a FIFO's open would block
            try:
                h = safe_open(str(path), framework="pt", device="cpu")
            except PermissionError as e:
                raise unreadable(path, e) from None
            except (SafetensorError, OSError) as e:
                raise _open_error(path, e) from None
            self._handles[filename] = h
        return h

    def _slice(self, name: str):
        return self._handle(self.file_of(name)).get_slice(name)

    def names(self) -> list[str]:
        """All tensor names, in the order the index (or the file header) lists them."""
        return list(self._weight_map)

    def has(self, name: str) -> bool:
        """Whether the checkpoint holds tensor `name`."""
        return name in self._weight_map

    def file_of(self, name: str) -> str:
        """The shard file that holds `name` (relative to the model directory)."""
        try:
            return self._weight_map[name]
        except KeyError:
            raise KeyError(f"tensor {name} is not in the checkpoint at {self.model_dir}") from None

    def dtype(self, name: str) -> torch.dtype:
        """dtype of `name` from the file header, without loading it."""
        code = self._slice(name).get_dtype()
        if code not in _DTYPES:
            raise CheckpointError(f"{self.model_dir / self.file_of(name)}: tensor {name} is stored as {code}, which "
                                  f"pieceworks does not read ({', '.join(_DTYPES)} it does); {REDOWNLOAD}")
        return _DTYPES[code]

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of `name` from the file header, without loading it."""
        return tuple(self._slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        """Load one tensor (CPU), as stored.

        Raises:
            KeyError: no such tensor.
            CheckpointError: the file changed on disk since the reader opened it.
        """
        filename = self.file_of(name)
        try:
            t = self._handle(filename).get_tensor(name)
            self.read.add(name)
            return t
        except SafetensorError as e:
            raise CheckpointError(
                f"{self.model_dir / filename}: cannot read tensor {name} ({e}); {REDOWNLOAD}"
            ) from None

    def get_part(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Load rows (or columns, ...) [start, stop) of dimension `dim` of one tensor (CPU): only that
        slice is read from the file (`safe_open(...).get_slice`), as a tensor-parallel rank reads its shard.

        Raises:
            KeyError, CheckpointError: as `get`.
        """
        filename = self.file_of(name)
        try:
            sl = self._handle(filename).get_slice(name)
            index = tuple(slice(start, stop) if d == dim else slice(None) for d in range(len(sl.get_shape())))
            t = sl[index]
            self.read.add(name)
            return t
        except SafetensorError as e:
            raise CheckpointError(
                f"{self.model_dir / filename}: cannot read tensor {name} ({e}); {REDOWNLOAD}"
            ) from None

    def config(self) -> dict:
        """config.json as a dict.

        Raises:
            CheckpointError: config.json is missing or not valid JSON.
        """
        path = self.model_dir / "config.json"
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{path}: missing; a Hugging Face checkpoint needs its config.json") from None
        except ValueError as e:
            raise CheckpointError(f"{path}: not valid JSON ({e}); fix or re-download it") from None
        except OSError as e:
            raise unreadable(path, e) from None

    def __repr__(self) -> str:
        shards = len(set(self._weight_map.values()))
        return f"CheckpointReader({str(self.model_dir)!r}, {len(self._weight_map)} tensors, {shards} file(s))"


class RenamingReader:
    """A CheckpointReader read by the model's tensor names: `named(name)` is the checkpoint's name of each
    (Mixtral's experts, Phi-3's fused projections), and where `named` has `rows(name)` giving (start, stop), the
    tensor is those rows of the checkpoint's (q of Phi-3's qkv_proj). Everything else (`names`, `read`,
    `model_dir`, ...) is the reader's, in the checkpoint's names, as the loader's check for unused tensors compares
    them."""

    def __init__(self, reader: CheckpointReader, named) -> None:
        self.reader, self.named = reader, named
        self._slices = getattr(named, "rows", lambda name: None)
        self._checked: set[str] = set()

    def _rows(self, name: str) -> tuple[int, int] | None:
        """The rows of the fused tensor that `name` is, the fused tensor's row count checked against config.json's
        (other rows would be read as k or v without a word)."""
        rows = self._slices(name)
        fused = self.named(name) if rows is not None else None
        if rows is not None and fused not in self._checked:
            want, parts = self.named.total(name)
            got = self.reader.shape(fused)[0]
            if got != want:
                raise CheckpointError(f"{self.reader.model_dir}: {fused} has {got} rows, config.json's sizes give "
                                      f"{want} ({parts}); the checkpoint does not match its config.json: fix the "
                                      "config or re-download the model")
            self._checked.add(fused)
        return rows

    def __getattr__(self, attr: str):
        return getattr(self.reader, attr)

    def has(self, name: str) -> bool:
        return self.reader.has(self.named(name))

    def file_of(self, name: str) -> str:
        return self.reader.file_of(self.named(name))

    def dtype(self, name: str) -> torch.dtype:
        return self.reader.dtype(self.named(name))

    def shape(self, name: str) -> tuple[int, ...]:
        shape, rows = tuple(self.reader.shape(self.named(name))), self._rows(name)
        return shape if rows is None else (rows[1] - rows[0], *shape[1:])

    def get(self, name: str) -> torch.Tensor:
        rows = self._rows(name)
        if rows is None:
            return self.reader.get(self.named(name))
        return self.reader.get_part(self.named(name), 0, *rows)

    def get_part(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        rows = self._rows(name)
        if rows is None:
            return self.reader.get_part(self.named(name), dim, start, stop)
        if dim == 0:
            return self.reader.get_part(self.named(name), 0, rows[0] + start, rows[0] + stop)
        return self.reader.get_part(self.named(name), 0, *rows).narrow(dim, start, stop - start).contiguous()
