"""Repeats in a prompt source, found once before anything is generated, each against every earlier line of the
whole source (the first occurrence is kept): **exact**, the same canonical messages whatever the id; **near**, at
least `near_threshold` of its word shingles shared with an earlier prompt's, by MinHash (112 permutations, LSH in 14
bands of 8 rows: datatrove's default), each candidate confirmed by the two signatures and by the word counts (a set
of shingles forgets how often each occurs).

Kept in the data dir (`repeats/<key>.parquet`, keyed by the source's path, size, mtime and the settings); each shard's
build reads its own lines there. The signatures go to a temporary directory as they are made: the pass holds 40 bytes
a prompt in memory.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import re
import tempfile
import zlib
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePath

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dflash_assets.generation.prompts import FieldMapping, Prompt, canonical_json, read_shard
from dflash_assets.settings import RepeatSettings
from dflash_assets.store.storage import Storage, open_storage

BANDS, ROWS = 14, 8
NUM_PERM = BANDS * ROWS
_MERSENNE = np.uint64((1 << 61) - 1)
_MAX_HASH = np.uint64((1 << 32) - 1)
_PERMUTATIONS = np.random.default_rng(1).integers(1, 1 << 32, size=(2, NUM_PERM), dtype=np.uint64)  # a, b
_BATCH_SHINGLES = (
    4_000  # shingles hashed at once (NUM_PERM x this many uint64: 3.6 MB an array, in cache: twice as fast as 45 MB)
)
_WORD = re.compile(r"\w+")
FOLDER = "repeats"
REPEAT_SCHEMA = pa.schema(
    [("line", pa.int64()), ("first_line", pa.int64()), ("kind", pa.string()), ("similarity", pa.float64())]
)


@dataclass(frozen=True)
class Repeat:
    line: int  # the repeat's line in the source (1-based)
    first_line: int  # the earlier line it repeats
    kind: str  # "exact" or "near"
    similarity: float  # 1.0 for an exact repeat; the estimated Jaccard similarity of a near one

    @property
    def reason(self) -> str:
        """The reject reason (prompts.SourceReject), `line N: ...`."""
        if self.kind == "exact":
            return f"line {self.line}: exact repeat of line {self.first_line} (the same conversation)"
        return (
            f"line {self.line}: near repeat of line {self.first_line} (word-shingle similarity "
            f"{self.similarity:.2f}, MinHash)"
        )


def prompt_text(prompt: Prompt) -> str:
    """What a near repeat is judged on: the text of the messages the request sends."""
    texts = (m.get("content") for m in prompt.request)
    return "\n".join(t if isinstance(t, str) else canonical_json(t) for t in texts if t is not None)


def words_of(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def shingles(words: list[str], words_per_shingle: int) -> np.ndarray:
    """The 32-bit hashes of the lower-cased word shingles (one shingle of all words when there are fewer); crc32 per
    word, combined per shingle, so the same text hashes the same on every machine. A shingle that occurs twice is
    hashed twice: a signature's minimum is that of the distinct ones, so they are not made distinct here."""
    if not words:
        return np.empty(0, dtype=np.uint64)
    hashed = np.fromiter(map(zlib.crc32, map(str.encode, words)), dtype=np.uint64, count=len(words))
    k = min(words_per_shingle, len(words))
    combined = hashed[: len(words) - k + 1].copy()
    for j in range(1, k):
        combined = (combined * np.uint64(1_000_003) + hashed[j : len(words) - k + 1 + j]) & _MAX_HASH
    return combined


def signatures(shingle_sets: list[np.ndarray]) -> np.ndarray:
    """The MinHash signatures (len x NUM_PERM, uint32) of non-empty shingle sets, a batch of them at a time."""
    out = np.empty((len(shingle_sets), NUM_PERM), dtype=np.uint32)
    a, b = _PERMUTATIONS[0][:, None], _PERMUTATIONS[1][:, None]
    start = 0
    while start < len(shingle_sets):
        stop, total = start, 0
        while stop < len(shingle_sets) and (stop == start or total + len(shingle_sets[stop]) <= _BATCH_SHINGLES):
            total += len(shingle_sets[stop])
            stop += 1
        batch = shingle_sets[start:stop]
        values = np.concatenate(batch)[None, :]
        permuted = ((values * a + b) % _MERSENNE) & _MAX_HASH
        offsets = np.cumsum([0] + [len(s) for s in batch[:-1]])
        out[start:stop] = np.minimum.reduceat(permuted, offsets, axis=1).T
        start = stop
    return out


def _band_keys(sigs: np.ndarray) -> np.ndarray:
    """One 64-bit key per band of each signature (len x BANDS)."""
    rows = sigs.reshape(len(sigs), BANDS, ROWS)
    keys = np.zeros((len(sigs), BANDS), dtype=np.uint64)
    for r in range(ROWS):  # one row at a time: a uint64 copy of every signature would be 896 bytes a prompt
        keys = keys * np.uint64(0x100000001B3) + rows[:, :, r].astype(np.uint64)  # wraps mod 2**64: a hash
    return keys


def find_repeats(prompts: Iterable[Prompt], settings: RepeatSettings) -> list[Repeat]:
    """Every repeat among `prompts` (in source order): exact ones, and near ones among the rest. What stays in memory
    is 56 bytes a prompt (its line, its words, hashes of its conversation and its id); the signatures and their band
    keys go to a temporary directory as they are made (Signed), so a source of millions of prompts does not hold them.
    A line whose id an earlier line has is no prompt (read_shard rejects it) and left out, found by the hashes."""
    keys, ids, every_line, pending, waiting = bytearray(), bytearray(), array("q"), list[np.ndarray](), 0
    with tempfile.TemporaryDirectory(prefix="dflash-repeats-") as folder, Signed(Path(folder)) as signed:
        for p in prompts:
            keys += hashlib.sha256(canonical_json(p.messages).encode()).digest()[:16]
            ids += hashlib.sha256(p.prompt_id.encode()).digest()[:16]
            every_line.append(p.line)
            words = words_of(prompt_text(p))
            shingled = shingles(words, settings.shingle_words)
            if len(shingled):  # a prompt without words repeats only exactly
                signed.lines.append(p.line)
                signed.sizes.append(len(words))
                pending.append(shingled)
                waiting += len(shingled)
            if waiting >= _BATCH_SHINGLES:
                signed.add(signatures(pending))
                pending, waiting = [], 0
        if pending:
            signed.add(signatures(pending))
        lines = np.frombuffer(every_line, dtype=np.int64)
        again = _firsts(np.frombuffer(ids, dtype=np.uint64)) < np.arange(len(lines))  # an id seen before
        exact = _exact(lines[~again], np.frombuffer(keys, dtype=np.uint64).reshape(-1, 2)[~again])
        # an exact repeat is that and nothing else, and its first line, earlier, stands for it in every band
        skip = np.concatenate([lines[again], np.array([r.line for r in exact], dtype=np.int64)])
        near = list(signed.near(settings.near_threshold, skip))
    return sorted(exact + near, key=lambda r: r.line)


def _firsts(keys: np.ndarray) -> np.ndarray:
    """For each 128-bit key (two uint64 a key), the index of the first equal one: one stable sort, no copy of the
    keys per comparison (np.unique by rows held several times them)."""
    keys = keys.reshape(-1, 2)
    order = np.lexsort((keys[:, 1], keys[:, 0]))  # stable: equal keys keep their order, the first first
    new = _starts(keys[order])
    firsts = np.empty(len(order), dtype=np.int64)
    firsts[order] = order[new][np.cumsum(new) - 1]
    return firsts


def _starts(rows: np.ndarray) -> np.ndarray:
    """Of sorted rows, those that differ from the row before (the first of each run of equal ones)."""
    new = np.ones(len(rows), dtype=bool)
    new[1:] = (rows[1:] != rows[:-1]).any(axis=1)
    return new


def _exact(lines: np.ndarray, keys: np.ndarray) -> list[Repeat]:
    """Each line whose conversation's hash (`keys`: two uint64 a line) an earlier line has: a repeat of the first."""
    firsts = _firsts(keys)
    return [
        Repeat(int(lines[i]), int(lines[firsts[i]]), "exact", 1.0)
        for i in np.flatnonzero(firsts < np.arange(len(lines)))
    ]


class Signed:
    """The MinHash signatures of the prompts with words, in a folder as they are made: the signatures (448 bytes a
    prompt) and each band's keys (8 bytes a prompt) in files of their own; in memory, each prompt's line and words.
    A line is compared with the first earlier line of each band it falls in, read back a band at a time, and the
    candidate pairs confirmed by their two signatures, read from the file."""

    def __init__(self, folder: Path) -> None:
        self.lines, self.sizes = array("q"), array("q")
        self.signatures = (folder / "signatures").open("wb+")
        self.bands = [(folder / f"band{b}").open("wb+") for b in range(BANDS)]

    def __enter__(self) -> Signed:
        return self

    def __exit__(self, *exc: object) -> None:
        for f in (self.signatures, *self.bands):
            f.close()

    def add(self, sigs: np.ndarray) -> None:
        self.signatures.write(sigs.tobytes())
        keys = _band_keys(sigs)
        for band, f in enumerate(self.bands):
            f.write(keys[:, band].tobytes())

    def near(self, threshold: float, skip: np.ndarray) -> Iterator[Repeat]:
        """The near repeats among the lines, those in `skip` left out (neither a repeat nor repeated)."""
        kept = ~np.isin(np.frombuffer(self.lines, dtype=np.int64), skip)
        index, pairs = np.flatnonzero(kept), [np.empty((0, 2), dtype=np.int64)]
        for f in self.bands:
            f.flush()
            f.seek(0)
            _, first, inverse = np.unique(np.fromfile(f, dtype=np.uint64)[kept], return_index=True, return_inverse=True)
            earlier = first[inverse]
            later = np.flatnonzero(earlier < np.arange(len(index)))
            pairs.append(np.stack([index[later], index[earlier[later]]], axis=1))
        self.signatures.flush()
        fd, width = self.signatures.fileno(), NUM_PERM * 4
        row = lambda i: np.frombuffer(os.pread(fd, width, int(i) * width), dtype=np.uint32)  # noqa: E731
        candidates = np.concatenate(pairs)
        candidates = candidates[np.lexsort((candidates[:, 1], candidates[:, 0]))]  # by line, then by the earlier line
        candidates = candidates[_starts(candidates)]
        for i, group in itertools.groupby(candidates.tolist(), key=lambda pair: pair[0]):
            for _, j in group:
                if min(self.sizes[i], self.sizes[j]) < threshold * max(self.sizes[i], self.sizes[j]):
                    continue  # "word " * 250 and * 300 share every shingle, not 90% of their words
                similarity = float(np.mean(row(i) == row(j)))
                if similarity >= threshold:
                    yield Repeat(self.lines[i], self.lines[j], "near", similarity)
                    break


def source_key(source: Path, *settings: object) -> str:
    """The source as it is now (path, size, modification time) and the settings of what is found in it, hashed: the
    name of what is kept of a pass over it."""
    stat = Path(source).stat()
    what = (str(Path(source).resolve()), stat.st_size, stat.st_mtime_ns, *settings)
    return hashlib.sha256(repr(what).encode()).hexdigest()[:16]


def source_repeats(
    source: Path,
    data_dir: str | Path | Storage,
    mapping: FieldMapping | None,
    settings: RepeatSettings,
    lines: range | None = None,
) -> dict[int, Repeat]:
    """line -> Repeat over the whole source, found once and kept in the data dir for every shard's build; of the
    `lines` only when given (a shard's: what it holds does not grow with the source)."""
    storage = open_storage(data_dir)
    path: PurePath = (
        storage.root
        / FOLDER
        / f"{source_key(source, mapping, settings.near_threshold, settings.shingle_words, NUM_PERM, BANDS)}.parquet"
    )
    if not storage.exists(path):  # two builds at once find the same, and the write is atomic
        every = read_shard(source, 0, 1 << 62, mapping, unique_ids=False)  # ids told apart by find_repeats
        found = find_repeats((p for p in every if isinstance(p, Prompt)), settings)
        rows = [{"line": r.line, "first_line": r.first_line, "kind": r.kind, "similarity": r.similarity} for r in found]
        storage.write_table(pa.Table.from_pylist(rows, schema=REPEAT_SCHEMA), path)
    table = storage.read_table(path)
    if lines is not None:
        table = table.filter((pc.field("line") >= lines.start) & (pc.field("line") < lines.stop))
    return {r.line: r for r in (Repeat(**columns) for columns in table.to_pylist())}
