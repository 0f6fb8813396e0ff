"""Repeats in a prompt source, found before anything is generated.

Two kinds, each against every earlier line of the whole source (shards are partitions of one file, built apart, so a
repeat is decided by one rule over global line order: the first occurrence is kept, every later one is a repeat):
- **exact**: the same conversation, its canonical messages (`prompts.canonical_json`) equal, whatever its id;
- **near**: a prompt whose text (the request's messages, lower-cased words) shares at least `near_threshold` of its
  word shingles with an earlier prompt's, by MinHash: 112 permutations, banded for LSH in 14 bands of 8 rows
  (datatrove's default), each candidate pair confirmed by the estimated Jaccard similarity of the two signatures
  and by their word counts (the shorter at least `near_threshold` of the longer: a set of shingles forgets how often
  each occurs). A line is compared with the first earlier line of each band it falls in.

The repeats of a source are found once, in one pass over it, and kept in the data dir (`repeats/<key>.parquet`, the
key a hash of the source's path, size and modification time and of the settings): every shard's build reads the
lines of its own range there. The signatures are numpy arrays (uint32, 448 bytes a prompt), signed a batch of
prompts at a time.
"""

from __future__ import annotations

import hashlib
import re
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePath

import numpy as np
import pyarrow as pa

from dflash_assets.generation.prompts import FieldMapping, Prompt, canonical_json, read_shard
from dflash_assets.settings import RepeatSettings
from dflash_assets.store.storage import Storage, open_storage

BANDS, ROWS = 14, 8
NUM_PERM = BANDS * ROWS
_MERSENNE = np.uint64((1 << 61) - 1)
_MAX_HASH = np.uint64((1 << 32) - 1)
_PERMUTATIONS = np.random.default_rng(1).integers(1, 1 << 32, size=(2, NUM_PERM), dtype=np.uint64)  # a, b
_BATCH_SHINGLES = 50_000  # shingles hashed at once (NUM_PERM x this many uint64: 45 MB an array)
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
    """The distinct 32-bit hashes of the lower-cased word shingles (one shingle of all words when there are fewer);
    crc32 per word, combined per shingle, so the same text hashes the same on every machine."""
    if not words:
        return np.empty(0, dtype=np.uint64)
    hashed = np.fromiter((zlib.crc32(w.encode()) for w in words), dtype=np.uint64, count=len(words))
    k = min(words_per_shingle, len(words))
    combined = hashed[: len(words) - k + 1].copy()
    for j in range(1, k):
        combined = (combined * np.uint64(1_000_003) + hashed[j : len(words) - k + 1 + j]) & _MAX_HASH
    return np.unique(combined)


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
    """Every repeat among `prompts` (in source order): exact ones first, near ones among the rest."""
    first_of: dict[bytes, int] = {}
    repeats: list[Repeat] = []
    lines: list[int] = []
    sizes: list[int] = []  # words per prompt: a set of shingles forgets how often each one occurs
    pending: list[np.ndarray] = []  # shingle sets not signed yet: signed a batch at a time, then dropped
    signed: list[np.ndarray] = []
    waiting = 0
    for p in prompts:
        key = hashlib.sha256(canonical_json(p.messages).encode()).digest()[:16]
        if key in first_of:
            repeats.append(Repeat(p.line, first_of[key], "exact", 1.0))
            continue
        first_of[key] = p.line
        words = words_of(prompt_text(p))
        shingled = shingles(words, settings.shingle_words)
        if len(shingled):  # a prompt without words repeats only exactly
            lines.append(p.line)
            sizes.append(len(words))
            pending.append(shingled)
            waiting += len(shingled)
        if waiting >= _BATCH_SHINGLES:
            signed.append(signatures(pending))
            pending, waiting = [], 0
    if pending:
        signed.append(signatures(pending))
    if signed:
        repeats += _near(np.asarray(lines), np.asarray(sizes), np.concatenate(signed), settings.near_threshold)
    return sorted(repeats, key=lambda r: r.line)


def _near(lines: np.ndarray, sizes: np.ndarray, sigs: np.ndarray, threshold: float) -> Iterator[Repeat]:
    keys = _band_keys(sigs)
    index = np.arange(len(lines))
    earlier = np.full((len(lines), BANDS), -1)
    for band in range(BANDS):
        _, first, inverse = np.unique(keys[:, band], return_index=True, return_inverse=True)
        first_in_band = first[inverse]
        earlier[:, band] = np.where(first_in_band < index, first_in_band, -1)
    for i in np.flatnonzero((earlier >= 0).any(axis=1)):
        for j in sorted({int(j) for j in earlier[i] if j >= 0}):
            if min(sizes[i], sizes[j]) < threshold * max(sizes[i], sizes[j]):
                continue  # "word " * 250 and * 300 share every shingle, not 90% of their words
            similarity = float(np.mean(sigs[i] == sigs[j]))
            if similarity >= threshold:
                yield Repeat(int(lines[i]), int(lines[j]), "near", similarity)
                break


def source_key(source: Path, *settings: object) -> str:
    """The source as it is now (path, size, modification time) and the settings of what is found in it, hashed: the
    name of what is kept of a pass over it."""
    stat = Path(source).stat()
    what = (str(Path(source).resolve()), stat.st_size, stat.st_mtime_ns, *settings)
    return hashlib.sha256(repr(what).encode()).hexdigest()[:16]


def source_repeats(
    source: Path, data_dir: str | Path | Storage, mapping: FieldMapping | None, settings: RepeatSettings
) -> dict[int, Repeat]:
    """line -> Repeat over the whole source, found once and kept in the data dir for every shard's build."""
    storage = open_storage(data_dir)
    path: PurePath = (
        storage.root
        / FOLDER
        / f"{source_key(source, mapping, settings.near_threshold, settings.shingle_words, NUM_PERM, BANDS)}.parquet"
    )
    if not storage.exists(path):  # two builds at once find the same, and the write is atomic
        found = find_repeats((p for p in read_shard(source, 0, 1 << 62, mapping) if isinstance(p, Prompt)), settings)
        rows = [{"line": r.line, "first_line": r.first_line, "kind": r.kind, "similarity": r.similarity} for r in found]
        storage.write_table(pa.Table.from_pylist(rows, schema=REPEAT_SCHEMA), path)
    return {r["line"]: Repeat(**r) for r in storage.read_table(path).to_pylist()}
