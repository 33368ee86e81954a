"""A JSONL corpus read by offset: the passages stay on disk, a replica reads a hit's row by seek.

    write_offsets("corpus.jsonl", "corpus.offsets.npy")     # one streaming pass, done once
    store = CorpusStore.open("corpus.jsonl", "corpus.offsets.npy")   # builds the offsets if missing/stale
    store[17]            # -> {"id": ..., "contents": ...}, parsed from bytes [off[17], off[18])
    store.rows([3, 9])   # several rows; len(store), iter(store) (lazily, in file order)

The offsets file is a ``.npy`` array of uint64: the byte offset where every non-blank line starts,
then the file's size (``N + 1`` entries). Both the corpus and the offsets are memory-mapped
read-only, so the replicas of one node share the page cache instead of each holding a copy of
the corpus as Python objects (Wikipedia's 21M passages are about 14 GB of JSONL). Row ``i`` is
the i-th non-blank line, the numbering ``read_jsonl`` and Search-R1's own loader use. The file the
offsets were computed from is recorded next to them (``<offsets>.json``: path, size, mtime); a
changed corpus gets new offsets on the next open.
"""

from __future__ import annotations

import json
import mmap
import os
from pathlib import Path
from typing import Iterator

import numpy as np
from tqdm import tqdm

_CHUNK = 64 << 20  # bytes per read when scanning for line starts


def _stamp(corpus: Path) -> dict:
    st = corpus.stat()
    return {"corpus": str(corpus.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def write_offsets(corpus: str | Path, out: str | Path, show_progress: bool = False) -> int:
    """Scan ``corpus`` once (64 MB at a time, never all of it in memory) and write the start of every
    non-blank line plus the file size to ``out`` (.npy, uint64), atomically. Returns the row count."""
    corpus, out = Path(corpus), Path(out)
    size = corpus.stat().st_size
    starts: list[np.ndarray] = []
    pos = 0
    line_start = 0          # start of the line being read
    line_blank = True       # no non-whitespace byte seen in it yet
    with open(corpus, "rb") as f, tqdm(total=size, unit="B", unit_scale=True, desc="corpus offsets",
                                       disable=not show_progress) as bar:
        while True:
            buf = f.read(_CHUNK)
            if not buf:
                break
            a = np.frombuffer(buf, dtype=np.uint8)
            nl = np.flatnonzero(a == 10)
            # per line in this chunk: [begin, end) of its bytes inside the chunk
            begins = np.concatenate(([0], nl + 1))
            ends = np.concatenate((nl, [len(a)]))
            ws = (a == 32) | (a == 9) | (a == 13) | (a == 10)
            nonblank_cum = np.concatenate(([0], np.cumsum(~ws)))
            has_text = (nonblank_cum[ends] - nonblank_cum[begins]) > 0
            # the first piece continues the line carried over from the previous chunk
            if has_text[0]:
                line_blank = False
            if len(nl):
                if not line_blank:
                    starts.append(np.array([line_start], dtype=np.uint64))
                full = slice(1, len(begins) - 1)  # lines that begin and end inside this chunk
                starts.append((begins[full][has_text[full]] + pos).astype(np.uint64))
                line_start = pos + int(begins[-1])
                line_blank = not has_text[-1]
            pos += len(a)
            bar.update(len(a))
    if not line_blank:
        starts.append(np.array([line_start], dtype=np.uint64))
    offsets = np.concatenate(starts + [np.array([size], dtype=np.uint64)])
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}.npy")
    np.save(tmp, offsets)
    os.replace(tmp, out)
    _meta_path(out).write_text(json.dumps(_stamp(corpus)))
    return len(offsets) - 1


def _meta_path(offsets: Path) -> Path:
    return offsets.with_name(offsets.name + ".json")


def offsets_current(corpus: str | Path, offsets: str | Path) -> bool:
    """Whether ``offsets`` were computed from ``corpus`` as it is now (same path, size and mtime)."""
    offsets = Path(offsets)
    try:
        return json.loads(_meta_path(offsets).read_text()) == _stamp(Path(corpus)) and offsets.is_file()
    except (OSError, ValueError):
        return False


class CorpusStore:
    """Read-only, memory-mapped rows of a JSONL corpus (a sequence of dicts, parsed on access)."""

    def __init__(self, corpus: str | Path, offsets: str | Path):
        self.path = Path(corpus)
        self.offsets = np.load(offsets, mmap_mode="r")
        if len(self.offsets) < 1 or int(self.offsets[-1]) != self.path.stat().st_size:
            raise ValueError(f"{offsets} does not describe {corpus} (sizes differ): delete it to recompute")
        self._file = open(self.path, "rb")
        size = int(self.offsets[-1])
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        if size and hasattr(mmap, "MADV_RANDOM"):
            self._map.madvise(mmap.MADV_RANDOM)  # rows are read at random: no read-ahead around a hit

    @classmethod
    def open(cls, corpus: str | Path, offsets: str | Path, show_progress: bool = False) -> "CorpusStore":
        """The store of ``corpus``, computing ``offsets`` first when they are missing or stale."""
        if not Path(corpus).is_file():
            raise FileNotFoundError(f"corpus {str(corpus)!r} does not exist")
        if not offsets_current(corpus, offsets):
            write_offsets(corpus, offsets, show_progress)
        return cls(corpus, offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def raw(self, i: int) -> bytes:
        """Row ``i``'s bytes (a JSON object, possibly followed by blank lines)."""
        return self._map[int(self.offsets[i]) : int(self.offsets[i + 1])]

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = int(i)
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"row {i} out of range for a corpus of {n} rows")
        return json.loads(self.raw(i))

    def rows(self, ids) -> list[dict]:
        return [self[i] for i in ids]

    def __iter__(self) -> Iterator[dict]:
        for i in range(len(self)):
            yield self[i]

    def close(self) -> None:
        if isinstance(self._map, mmap.mmap):
            self._map.close()
        self._file.close()
