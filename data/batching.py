"""Token ids, token-budget batches with length bucketing, and inference batches.

Training batches (:class:`TokenBatcher`) come from a few fixed bucket shapes
``(rows, S, T)`` so XLA compiles only a handful of programs. The shapes are
chosen from the corpus's length distribution to minimize padding, and each
shape's number of rows fills the token budget ``max_tokens``. The budget is
that of one *global* step (all devices of all hosts) and counts padded
positions of source plus target (``rows * (S + T)``; ``tgt_in`` and
``tgt_out`` share their ``T`` positions).

No training batch holds padding rows: each bucket is an endless stream of
epoch-wise shuffled examples, cut into full batches; the few examples of a
bucket that do not fill its last batch of an epoch open its first batch of the
next epoch. Every example is therefore seen once per epoch, give or take that
carry-over, and epochs differ in length by at most the number of shapes. (A
bucket with fewer pairs than one batch has rows, as in a toy corpus, repeats
pairs within a batch.)

The batch at global position ``n`` is a pure function of ``(seed, n)``, so the
iterator's state is one integer, and resuming gives exactly the batches an
uninterrupted run would. Rows per shape are a multiple of 8 (of
``lcm(8, global devices)`` in general) whatever the device count, so 1, 2, 4 or
8 devices see the same global batches, each device a slice of it.

Evaluation passes (:meth:`TokenBatcher.one_pass`) are cut from the same shapes
but hold every pair exactly once, the last batch of a shape filled up with rows
of padding only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np

from data.errors import DataError
from data.text import NORMALIZATION_VERSION, write_atomically

DEFAULT_MAX_LEN = 128  # tokens including eos; longer training pairs are dropped and counted
DEFAULT_MAX_SHAPES = 12
ROW_MULTIPLE = 8  # rows of every training batch are a multiple of this, independent of devices
_CACHE_FORMAT = 1


@dataclasses.dataclass
class EncodedCorpus:
    """A corpus as token ids, ready for batching.

    Attributes:
      src: per pair, int32 ids of ``x + [eos]``.
      tgt: per pair, int32 ids of ``y + [eos]``.
      num_too_long: pairs dropped because a side exceeded ``max_len`` tokens.
      max_len: the limit applied (None: all pairs kept).
    """

    src: list[np.ndarray]
    tgt: list[np.ndarray]
    num_too_long: int = 0
    max_len: int | None = None

    def __len__(self) -> int:
        return len(self.src)

    def __str__(self) -> str:
        limit = (
            f", {self.num_too_long} longer than {self.max_len} tokens dropped"
            if self.max_len
            else ""
        )
        return f"{len(self.src)} pairs encoded{limit}"


def _corpus_key(tokenizer, corpus, max_len: int | None) -> str:
    h = hashlib.sha256(
        f"format={_CACHE_FORMAT} norm={NORMALIZATION_VERSION} max_len={max_len} "
        f"tokenizer={tokenizer.fingerprint} n={len(corpus.src)}\n".encode()
    )
    for side in (corpus.src, corpus.tgt):
        h.update("\n".join(side).encode())
        h.update(b"\0")
    return h.hexdigest()


def _flatten(arrays: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))
    flat = np.concatenate(arrays).astype(np.int32) if arrays else np.zeros(0, np.int32)
    return flat, lengths


def _unflatten(flat: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
    return np.split(flat, np.cumsum(lengths)[:-1]) if len(lengths) else []


def _read_cached(path: Path, max_len: int | None) -> EncodedCorpus | None:
    """The encoded corpus kept in `path`, or None (with a warning) if it cannot be read:
    the cache is disposable, so a damaged file is made again, not an error."""
    try:
        with np.load(path) as z:
            src_flat, src_len, tgt_flat, tgt_len = (z[k] for k in _CACHED_ARRAYS)
            num_too_long = int(z["num_too_long"])
        if src_len.sum() != len(src_flat) or tgt_len.sum() != len(tgt_flat):
            raise ValueError("its lengths do not add up to its ids")
        if len(src_len) != len(tgt_len):
            raise ValueError("it has unequal numbers of sources and targets")
    # Any error: NumPy's header parser alone can raise SyntaxError or tokenize.TokenError.
    except Exception as e:
        print(f"warning: tokenizing again: {path} cannot be read ({e})", file=sys.stderr)
        return None
    return EncodedCorpus(
        src=_unflatten(src_flat, src_len),
        tgt=_unflatten(tgt_flat, tgt_len),
        num_too_long=num_too_long,
        max_len=max_len,
    )


_CACHED_ARRAYS = ("src", "src_len", "tgt", "tgt_len")


def encode_corpus(
    tokenizer,
    corpus,
    *,
    max_len: int | None = DEFAULT_MAX_LEN,
    cache_dir: str | os.PathLike | None = None,
) -> EncodedCorpus:
    """Tokenizes a corpus once, appending eos, and caches the ids on disk.

    The cache file is keyed by a hash of the tokenizer model, the (normalized,
    cleaned) sentences, the normalization version and ``max_len``, so changing
    any of them re-tokenizes instead of reusing stale ids.

    Args:
      tokenizer: a :class:`data.Tokenizer`.
      corpus: a :class:`data.Corpus`.
      max_len: drop pairs whose source or target exceeds this many tokens
        (eos included); None keeps every pair (evaluation never truncates).
      cache_dir: where to keep ``encoded-<hash>.npz``; None disables caching.

    Returns:
      The encoded corpus.
    """
    path = None
    if cache_dir is not None:
        path = encoded_cache_file(tokenizer, corpus, cache_dir, max_len=max_len)
        if path.is_file():
            cached = _read_cached(path, max_len)
            if cached is not None:
                return cached
    eos = np.array([tokenizer.eos_id], np.int32)
    src_ids = tokenizer.encode_batch(corpus.src)
    tgt_ids = tokenizer.encode_batch(corpus.tgt)
    src, tgt, too_long = [], [], 0
    for x, y in zip(src_ids, tgt_ids, strict=True):
        if max_len is not None and (len(x) + 1 > max_len or len(y) + 1 > max_len):
            too_long += 1
            continue
        src.append(np.concatenate([np.asarray(x, np.int32), eos]))
        tgt.append(np.concatenate([np.asarray(y, np.int32), eos]))
    encoded = EncodedCorpus(src=src, tgt=tgt, num_too_long=too_long, max_len=max_len)
    if path is not None:
        src_flat, src_len = _flatten(src)
        tgt_flat, tgt_len = _flatten(tgt)
        arrays = dict(src=src_flat, src_len=src_len, tgt=tgt_flat, tgt_len=tgt_len)

        def write(tmp: Path) -> None:
            with open(tmp, "wb") as f:  # a file object: given a path, np.savez adds ".npz"
                np.savez(f, **arrays, num_too_long=too_long)

        write_atomically(path, write)  # no half-written file is left by a full disk
    return encoded


def encoded_cache_file(
    tokenizer, corpus, cache_dir: str | os.PathLike, *, max_len: int | None = DEFAULT_MAX_LEN
) -> Path:
    """The file in which `encode_corpus(tokenizer, corpus, max_len=max_len,
    cache_dir=cache_dir)` keeps the corpus's ids."""
    return Path(cache_dir) / f"encoded-{_corpus_key(tokenizer, corpus, max_len)[:32]}.npz"


def prune_encoded_cache(
    cache_dir: str | os.PathLike, keep: Iterable[str | os.PathLike]
) -> tuple[list[Path], list[str]]:
    """Deletes the ``encoded-*.npz`` files of `cache_dir` other than `keep`.

    Each holds the ids of one (tokenizer, sentences, max_len); one that a run no longer
    reads (its data edited, its tokenizer trained again) would only take up disk space:
    reading it again needs that very tokenizer and text, and then it is made again in
    seconds.

    Args:
      cache_dir: the folder (`encode_corpus`'s `cache_dir`); a missing one has nothing.
      keep: the files to keep (`encoded_cache_file`).

    Returns:
      (the files deleted, one line per file that could not be deleted and why).
    """
    keep_names = {Path(k).name for k in keep}
    removed, failed = [], []
    folder = Path(cache_dir)
    stale = sorted(folder.glob("encoded-*.npz")) if folder.is_dir() else []
    for path in stale:
        if path.name in keep_names:
            continue
        try:
            path.unlink(missing_ok=True)  # another host of the run may have deleted it
            removed.append(path)
        except OSError as e:
            failed.append(f"{path}: {e.strerror or e}")
    return removed, failed


def _thin(values: np.ndarray, limit: int) -> np.ndarray:
    values = np.unique(values)
    if len(values) <= limit:
        return values
    picks = np.quantile(values, np.linspace(0, 1, limit), method="higher")
    return np.unique(np.append(picks, values[-1]))


def choose_bucket_shapes(
    src_lengths: np.ndarray, tgt_lengths: np.ndarray, max_shapes: int = DEFAULT_MAX_SHAPES
) -> list[tuple[int, int]]:
    """Picks at most ``max_shapes`` padded shapes ``(S, T)`` that minimize padding.

    Every pair is padded to the cheapest shape that covers it (``S >= s`` and
    ``T >= t``). Shapes are added greedily, each time the candidate that saves
    the most padded positions; then, in up to four passes, each is swapped
    for a better candidate if one exists. Deterministic.

    Args:
      src_lengths: [N] source lengths.
      tgt_lengths: [N] target lengths.
      max_shapes: the most shapes to return.

    Returns:
      Shapes sorted by ``S + T``; the last covers the longest pairs.
    """
    src_lengths, tgt_lengths = np.asarray(src_lengths, np.int64), np.asarray(tgt_lengths, np.int64)
    cells_ST, weights = np.unique(
        np.stack([src_lengths, tgt_lengths], 1), axis=0, return_counts=True
    )
    cell_s, cell_t = cells_ST[:, 0], cells_ST[:, 1]
    top = (int(src_lengths.max()), int(tgt_lengths.max()))
    cand_s, cand_t = np.meshgrid(_thin(src_lengths, 64), _thin(tgt_lengths, 64), indexing="ij")
    cand_s, cand_t = cand_s.ravel(), cand_t.ravel()

    def best_candidate(base_cost: np.ndarray) -> tuple[int, int]:
        # Total padded positions if each candidate were added to shapes costing base_cost per cell.
        best_total, best_j = None, 0
        for lo in range(0, len(cand_s), 256):
            s, t = cand_s[lo : lo + 256, None], cand_t[lo : lo + 256, None]
            cost = np.where((s >= cell_s) & (t >= cell_t), np.minimum(base_cost, s + t), base_cost)
            totals = cost @ weights
            j = int(np.argmin(totals))
            if best_total is None or totals[j] < best_total:
                best_total, best_j = int(totals[j]), lo + j
        return best_total, best_j

    def cost_per_cell(shapes: list[tuple[int, int]]) -> np.ndarray:
        cost = np.full(len(cell_s), np.iinfo(np.int64).max // 4)
        for s, t in shapes:
            cost = np.where((s >= cell_s) & (t >= cell_t), np.minimum(cost, s + t), cost)
        return cost

    shapes = [top]
    while len(shapes) < max_shapes:
        base = cost_per_cell(shapes)
        total, j = best_candidate(base)
        if total >= base @ weights:
            break
        shapes.append((int(cand_s[j]), int(cand_t[j])))
    for _ in range(4):  # swap refinement; the covering shape `top` stays
        changed = False
        for i in range(1, len(shapes)):
            others = shapes[:i] + shapes[i + 1 :]
            base = cost_per_cell(others)
            total, j = best_candidate(base)
            if (
                total < cost_per_cell(shapes) @ weights
                and (int(cand_s[j]), int(cand_t[j])) not in shapes
            ):
                shapes[i] = (int(cand_s[j]), int(cand_t[j]))
                changed = True
        if not changed:
            break
    return sorted(set(shapes), key=lambda st: (st[0] + st[1], st))


def _assign(src_len: np.ndarray, tgt_len: np.ndarray, shapes: list[tuple[int, int]]) -> np.ndarray:
    """Index of the cheapest shape covering each pair: [N]."""
    cells_ST, inverse = np.unique(np.stack([src_len, tgt_len], 1), axis=0, return_inverse=True)
    S = np.array([s for s, _ in shapes])
    T = np.array([t for _, t in shapes])
    covers = (S[None] >= cells_ST[:, :1]) & (T[None] >= cells_ST[:, 1:])
    cell_shape = np.argmin(np.where(covers, (S + T)[None], np.iinfo(np.int64).max), axis=1)
    return cell_shape[inverse.reshape(-1)]


class TokenBatcher:
    """Endless, shuffled, length-bucketed training batches, split for pmap.

    Yields dicts of int32 numpy arrays for this host's devices::

        src      [D, b, S]   x + [eos], padded with pad_id
        tgt_in   [D, b, T]   [bos] + y
        tgt_out  [D, b, T]   y + [eos]

    where ``D = num_devices`` (local) and ``b = rows / (D * process_count)``
    for the bucket shape ``(rows, S, T)`` of that step. Every host computes the
    same global batch order from ``seed`` and takes its own slice of rows.

    Attributes:
      shapes: the global batch shapes ``(rows, S, T)``, one per bucket.
      batches_per_epoch: average number of batches in an epoch.
      max_tokens: the global token budget per step.
    """

    def __init__(
        self,
        encoded: EncodedCorpus,
        *,
        max_tokens: int,
        num_devices: int,
        pad_id: int,
        bos_id: int,
        seed: int = 0,
        shuffle: bool = True,
        process_index: int = 0,
        process_count: int = 1,
        max_shapes: int = DEFAULT_MAX_SHAPES,
    ):
        """Builds the buckets.

        Args:
          encoded: training pairs from :func:`encode_corpus`.
          max_tokens: global budget per step of padded source + target
            positions. Each shape gets ``rows = max_tokens // (S + T)`` rounded
            down to a multiple of ``lcm(8, num_devices * process_count)``, but
            never fewer than that multiple, so for long shapes and a tiny budget
            a batch may exceed it.
          num_devices: local devices; the leading axis of every array.
          pad_id: padding id (the tokenizer's).
          bos_id: beginning-of-sentence id (the tokenizer's).
          seed: shuffling seed; the batch sequence is a function of it.
          shuffle: False keeps corpus order within buckets and buckets in turn.
          process_index: this host's index in a multi-host run.
          process_count: number of hosts.
          max_shapes: most bucket shapes, i.e. compiled train-step programs.

        Raises:
          DataError: no pairs, or inconsistent device/host arguments.
        """
        if len(encoded) == 0:
            raise DataError(
                "no training pairs left after cleaning and the max_len filter; "
                "check the data and max_len (--max-len)"
            )
        if num_devices < 1 or process_count < 1 or not 0 <= process_index < process_count:
            raise DataError(
                f"bad device layout: {num_devices} devices, host {process_index} of {process_count}"
            )
        if max_tokens < 1:
            raise DataError(f"max_tokens must be positive, got {max_tokens}")
        self.max_tokens, self.seed, self.shuffle = int(max_tokens), int(seed), bool(shuffle)
        self.num_devices, self.process_index, self.process_count = (
            num_devices,
            process_index,
            process_count,
        )
        self.pad_id, self.bos_id = int(pad_id), int(bos_id)
        self._row_multiple = math.lcm(ROW_MULTIPLE, num_devices * process_count)

        self._src_flat, self._src_len = _flatten(encoded.src)
        self._tgt_flat, self._tgt_len = _flatten(encoded.tgt)
        self._src_off = np.concatenate([[0], np.cumsum(self._src_len)[:-1]])
        self._tgt_off = np.concatenate([[0], np.cumsum(self._tgt_len)[:-1]])

        shapes = choose_bucket_shapes(self._src_len, self._tgt_len, max_shapes)
        while True:  # drop shapes too rare to fill one batch; their pairs go to a larger shape
            bucket_of = _assign(self._src_len, self._tgt_len, shapes)
            counts = np.bincount(bucket_of, minlength=len(shapes))
            rows = [self._rows_for(s + t) for s, t in shapes]
            rare = [k for k in range(len(shapes) - 1) if counts[k] < rows[k]]
            if not rare:
                break
            shapes.pop(min(rare, key=lambda k: (counts[k], k)))
        keep = counts > 0
        self._ST = [st for st, k in zip(shapes, keep, strict=True) if k]
        self._rows = np.array([r for r, k in zip(rows, keep, strict=True) if k], np.int64)
        bucket_of = _assign(self._src_len, self._tgt_len, self._ST)
        self._members = [np.flatnonzero(bucket_of == k) for k in range(len(self._ST))]
        self._sizes = np.array([len(m) for m in self._members], np.int64)
        self.shapes = [(int(r), s, t) for r, (s, t) in zip(self._rows, self._ST, strict=True)]
        self.batches_per_epoch = max(1, round(float(np.sum(self._sizes / self._rows))))
        self._fingerprint = hashlib.sha256(
            repr((self.shapes, self._src_len.tolist(), self._tgt_len.tolist())).encode()
            + self._src_flat.tobytes()
            + self._tgt_flat.tobytes()
        ).hexdigest()[:16]
        self._position = 0
        self._epoch_cache: tuple[int, np.ndarray] | None = None
        self._perm_cache: dict[tuple[int, int], np.ndarray] = {}

    def _rows_for(self, width: int) -> int:
        return max(
            self._row_multiple, self.max_tokens // width // self._row_multiple * self._row_multiple
        )

    # --- The schedule: which bucket batch comes at which global position. ---

    def _epoch_start(self, epoch: int) -> int:
        """Global position of the first batch of ``epoch``."""
        return int(np.sum(epoch * self._sizes // self._rows))

    def _epoch_of(self, position: int) -> int:
        epoch = int(position / np.sum(self._sizes / self._rows))
        while epoch > 0 and self._epoch_start(epoch) > position:
            epoch -= 1
        while self._epoch_start(epoch + 1) <= position:
            epoch += 1
        return epoch

    def _epoch_order(self, epoch: int) -> np.ndarray:
        """[num_batches, 2] (bucket, batch index within bucket stream) of one epoch, in order."""
        if self._epoch_cache is not None and self._epoch_cache[0] == epoch:
            return self._epoch_cache[1]
        first = epoch * self._sizes // self._rows
        last = (epoch + 1) * self._sizes // self._rows
        order = np.concatenate(
            [
                np.stack([np.full(b - a, k), np.arange(a, b)], 1)
                for k, (a, b) in enumerate(zip(first, last, strict=True))
            ]
        ).astype(np.int64)
        if self.shuffle:
            order = order[np.random.default_rng([self.seed, epoch, 1]).permutation(len(order))]
        self._epoch_cache = (epoch, order)
        return order

    def _permutation(self, bucket: int, epoch: int) -> np.ndarray:
        key = (bucket, epoch)
        if key not in self._perm_cache:
            if len(self._perm_cache) > 4 * len(self._ST):
                self._perm_cache.clear()
            members = self._members[bucket]
            if self.shuffle:
                members = members[
                    np.random.default_rng([self.seed, epoch, 2, bucket]).permutation(len(members))
                ]
            self._perm_cache[key] = members
        return self._perm_cache[key]

    def _batch_examples(self, bucket: int, index: int) -> np.ndarray:
        """Example ids of batch ``index`` of a bucket's endless stream: [rows]."""
        rows, size = int(self._rows[bucket]), int(self._sizes[bucket])
        stream = np.arange(index * rows, (index + 1) * rows)
        out = np.empty(rows, np.int64)
        for epoch in np.unique(stream // size):
            sel = stream // size == epoch
            out[sel] = self._permutation(bucket, int(epoch))[stream[sel] % size]
        return out

    def _global_batch(self, position: int) -> tuple[int, np.ndarray]:
        epoch = self._epoch_of(position)
        bucket, index = self._epoch_order(epoch)[position - self._epoch_start(epoch)]
        return int(bucket), self._batch_examples(int(bucket), int(index))

    # --- Arrays. ---

    def _pad(self, flat, offsets, lengths, ids, width):
        """[rows, width] ids of the examples ``ids`` padded to ``width``; id -1 is all padding."""
        cols = np.arange(width)
        real = cols[None] < np.where(ids >= 0, lengths[ids], 0)[:, None]
        gathered = flat[np.minimum(offsets[ids][:, None] + cols[None], len(flat) - 1)]
        return np.where(real, gathered, self.pad_id).astype(np.int32), real

    def batch_at(self, position: int) -> dict[str, np.ndarray]:
        """This host's share of the global batch at a position, without moving the iterator.

        Args:
          position: global step index (0 = first batch of the run).

        Returns:
          ``dict(src=[D, b, S], tgt_in=[D, b, T], tgt_out=[D, b, T])``, int32.
        """
        return self._arrays(*self._global_batch(position))

    def one_pass(self) -> list[dict[str, np.ndarray]]:
        """Every pair exactly once: the batches of one evaluation pass, such as a val loss.

        The training stream carries the pairs that do not fill a bucket's last batch
        over to the next epoch and repeats pairs in buckets smaller than one batch;
        here each bucket's pairs, in corpus order, are cut into batches of its shape,
        and its last batch is filled up with rows of padding only, which hold no
        target token and so weigh nothing in a token-averaged loss.

        Returns:
          This host's share of each batch, as from :meth:`batch_at`, bucket by bucket.
        """
        batches = []
        for bucket, members in enumerate(self._members):
            rows = int(self._rows[bucket])
            for start in range(0, len(members), rows):
                ids = np.full(rows, -1, np.int64)
                chunk = members[start : start + rows]
                ids[: len(chunk)] = chunk
                batches.append(self._arrays(bucket, ids))
        return batches

    def _arrays(self, bucket: int, ids: np.ndarray) -> dict[str, np.ndarray]:
        """This host's share of the global batch of examples ``ids`` (-1: a padding row)."""
        S, T = self._ST[bucket]
        share = len(ids) // self.process_count
        ids = ids[self.process_index * share : (self.process_index + 1) * share]
        src, _ = self._pad(self._src_flat, self._src_off, self._src_len, ids, S)
        tgt_out, real = self._pad(self._tgt_flat, self._tgt_off, self._tgt_len, ids, T)
        shifted = np.concatenate(
            [np.full((len(ids), 1), self.bos_id, np.int32), tgt_out[:, :-1]], axis=1
        )
        tgt_in = np.where(real, shifted, self.pad_id).astype(np.int32)
        D = self.num_devices
        return {
            "src": src.reshape(D, -1, S),
            "tgt_in": tgt_in.reshape(D, -1, T),
            "tgt_out": tgt_out.reshape(D, -1, T),
        }

    def __iter__(self) -> TokenBatcher:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        batch = self.batch_at(self._position)
        self._position += 1
        return batch

    # --- State. ---

    @property
    def position(self) -> int:
        """Number of batches produced so far (the global step of the next batch)."""
        return self._position

    @property
    def epoch(self) -> int:
        """Epoch of the next batch (0-based)."""
        return self._epoch_of(self._position)

    def state(self) -> dict:
        """JSON-serializable position of the iterator; see :meth:`restore`."""
        return {
            "position": self._position,
            "seed": self.seed,
            "fingerprint": self._fingerprint,
            "devices": self.num_devices * self.process_count,
        }

    def restore(self, state: dict) -> None:
        """Continues from a saved :meth:`state`: the next batch is the one that came next then.

        Args:
          state: a dict from :meth:`state`.

        Raises:
          DataError: the state was saved for other data or batching settings.
        """
        try:
            position, seed, fingerprint = (
                int(state["position"]),
                int(state["seed"]),
                state["fingerprint"],
            )
        except (KeyError, TypeError, ValueError):
            raise DataError(f"not a TokenBatcher state: {state!r}") from None
        if fingerprint != self._fingerprint:
            self._check_devices(state.get("devices"))  # None in a state saved before 2026-12-07
        if fingerprint != self._fingerprint or seed != self.seed:
            raise DataError(
                "cannot resume the data iterator: the training data, tokenizer, max_len, "
                "max_tokens, seed or device count changed since the checkpoint; "
                "resume with the same settings or start a new --workdir"
            )
        self._position = position

    def _check_devices(self, saved: object) -> None:
        """A DataError naming the device counts to resume on, where the state's global
        device count made batches of other rows than this one's does: rows are a multiple
        of lcm(8, devices), so 1, 2, 4 and 8 devices share their batches, 3 does not.
        Called where the batches differ, so that it names the cause."""
        if not isinstance(saved, int) or saved < 1:
            return
        then, now = math.lcm(ROW_MULTIPLE, saved), self._row_multiple
        if then == now:
            return
        counts = [
            n for n in range(1, then + 1) if then % n == 0 and math.lcm(ROW_MULTIPLE, n) == then
        ]
        choices = (
            ", ".join(map(str, counts[:-1])) + f" or {counts[-1]}"
            if len(counts) > 1
            else str(counts[0])
        )
        here = _devices(self.num_devices * self.process_count)
        raise DataError(
            f"cannot resume the data iterator on {here}: "
            f"the checkpoint's batches were made for {_devices(saved)}, with rows a multiple of "
            f"{then}, and here their rows would be a multiple of {now}, so other batches; resume "
            f"on {choices} devices in all, or start a new --workdir"
        )

    # --- Statistics. ---

    def array_shapes(self) -> list[tuple[tuple[int, int, int], ...]]:
        """Per bucket, the shapes of this host's src, tgt_in and tgt_out arrays.

        These are what a batch of that bucket holds (``[D, b, S], [D, b, T], [D, b, T]``),
        so a step program can be compiled for each before the first batch comes.
        """
        D = self.num_devices
        return [
            ((D, b, S), (D, b, T), (D, b, T))
            for b, S, T in ((r // (D * self.process_count), S, T) for r, S, T in self.shapes)
        ]

    @property
    def num_shapes(self) -> int:
        """Number of distinct batch shapes (compiled train-step programs)."""
        return len(self.shapes)

    def padding_efficiency(self) -> float:
        """Fraction of real (non-pad) tokens among padded positions over one epoch.

        Counts source and target positions, over the batches of epoch 0 (the
        same for every epoch up to the carried-over examples).

        Returns:
          A number in (0, 1]; at least 0.9 on Multi30k.
        """
        real = padded = 0
        for bucket, index in self._epoch_order(0):
            ids = self._batch_examples(int(bucket), int(index))
            S, T = self._ST[bucket]
            real += int(self._src_len[ids].sum() + self._tgt_len[ids].sum())
            padded += len(ids) * (S + T)
        if padded == 0:  # fewer pairs than one batch: use the long-run figure
            real = int(self._src_len.sum() + self._tgt_len.sum())
            padded = int(sum((s + t) * n for (s, t), n in zip(self._ST, self._sizes, strict=True)))
        return real / padded

    def __repr__(self) -> str:
        return (
            f"TokenBatcher({len(self._src_len)} pairs, max_tokens={self.max_tokens}, "
            f"{self.num_shapes} shapes, ~{self.batches_per_epoch} batches/epoch)"
        )


# Source lengths of inference batches are rounded up to one of these (then to multiples of 128).
INFERENCE_LENGTHS = (8, 12, 16, 24, 32, 48, 64, 96, 128)


def inference_length(n: int) -> int:
    """The padded length for a sentence of ``n`` tokens in :func:`inference_batches`."""
    for length in INFERENCE_LENGTHS:
        if n <= length:
            return length
    return -(-n // 128) * 128


def inference_batches(
    token_lists: Sequence[np.ndarray], *, max_tokens: int, pad_id: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Batches for evaluation/translation: every sentence whole and exactly once.

    Sentences are sorted by length (longest first, so memory problems show
    at once) and padded to a few fixed lengths to limit recompilation.

    Args:
      token_lists: per sentence, its source ids (``x + [eos]``).
      max_tokens: most padded source positions per batch (``b * S``); a
        sentence longer than that still gets a batch of its own.
      pad_id: padding id.

    Yields:
      ``(indices [b], src [b, S])``: positions in ``token_lists`` and the
      padded int32 ids; put outputs back with ``out[indices] = ...``.
    """
    lengths = np.array([len(t) for t in token_lists], np.int64)
    order = np.argsort(-lengths, kind="stable")
    start = 0
    while start < len(order):
        S = inference_length(int(lengths[order[start]]))
        rows = max(1, max_tokens // S)
        same = start
        while (
            same < len(order)
            and same - start < rows
            and inference_length(int(lengths[order[same]])) == S
        ):
            same += 1
        indices = order[start:same]
        src = np.full((len(indices), S), pad_id, np.int32)
        for row, i in enumerate(indices):
            src[row, : lengths[i]] = token_lists[i]
        yield indices, src
        start = same


def _devices(n: int) -> str:
    return f"{n} device" if n == 1 else f"{n} devices"
