"""Batching: token cache, bucket shapes, padding efficiency, resume, device independence."""

import gc
import itertools
import json
import os
import pathlib
import threading
import time
import weakref
import zipfile

import numpy as np
import pytest

import data


@pytest.fixture(scope="module")
def full_encoded(multi30k_tokenizer, multi30k_dir, tmp_path_factory):
    """Full Multi30k en-de train, encoded with the default max_len."""
    corpus = data.load_corpus(data.CorpusSpec(data_dir=str(multi30k_dir)), "train")
    return data.encode_corpus(
        multi30k_tokenizer, corpus, max_len=data.DEFAULT_MAX_LEN, cache_dir=None
    )


@pytest.fixture
def small(multi30k_tokenizer, multi30k_slice):
    """300 pairs of Multi30k en-de train, encoded."""
    spec = data.CorpusSpec(dataset="files", data_dir=str(multi30k_slice(n=300, splits=("train",))))
    corpus = data.load_corpus(spec, "train")
    return data.encode_corpus(multi30k_tokenizer, corpus, max_len=64, cache_dir=None)


def batcher(encoded, tok, **kw):
    kw.setdefault("max_tokens", 1024)
    kw.setdefault("num_devices", 1)
    return data.TokenBatcher(encoded, pad_id=tok.pad_id, bos_id=tok.bos_id, **kw)


def host_batchers(encoded, tok, num_devices, process_count, **kw):
    """One batcher per host of a multi-host run, each with `num_devices` local devices."""
    return [
        batcher(
            encoded,
            tok,
            num_devices=num_devices,
            process_index=p,
            process_count=process_count,
            **kw,
        )
        for p in range(process_count)
    ]


def global_rows(batch, key):
    """[D, b, L] -> [D * b, L]: the rows of all local devices, in device order."""
    return batch[key].reshape(-1, batch[key].shape[-1])


# --- encode_corpus and its cache ---


class OneTokenPerWord:
    """A stand-in tokenizer whose token counts are plain to see."""

    eos_id, fingerprint = 2, "one token per word"

    def encode_batch(self, texts):
        return [[5] * len(t.split()) for t in texts]


def test_encode_appends_eos_and_counts_long_pairs(multi30k_tokenizer):
    tok = multi30k_tokenizer
    long = " ".join(["Ein Hund läuft."] * 40)
    corpus = data.Corpus(
        src=["Ein Mann.", long, "Zwei."], tgt=["A man.", "A dog.", long], summary=None
    )
    kept = data.encode_corpus(tok, corpus, max_len=32, cache_dir=None)
    assert kept.num_too_long == 2 and len(kept) == 1 and "2 longer than 32" in str(kept)
    assert kept.src[0].dtype == np.int32
    assert kept.src[0].tolist() == tok.encode("Ein Mann.") + [tok.eos_id]
    assert kept.tgt[0].tolist() == tok.encode("A man.") + [tok.eos_id]
    whole = data.encode_corpus(tok, corpus, max_len=None, cache_dir=None)
    assert whole.num_too_long == 0 and len(whole) == 3  # evaluation keeps everything


def test_token_cache_is_reused_and_invalidated(multi30k_tokenizer, multi30k_slice, tmp_path):
    tok = multi30k_tokenizer
    spec = data.CorpusSpec(dataset="files", data_dir=str(multi30k_slice(n=100, splits=("train",))))
    corpus = data.load_corpus(spec, "train")
    cache = tmp_path / "cache"
    first = data.encode_corpus(tok, corpus, max_len=64, cache_dir=cache)
    assert len(list(cache.glob("encoded-*.npz"))) == 1

    class NoEncoding:  # the cached ids must be read without tokenizing again
        fingerprint, eos_id = tok.fingerprint, tok.eos_id

        def encode_batch(self, texts):
            raise AssertionError("tokenized again despite the cache")

    again = data.encode_corpus(NoEncoding(), corpus, max_len=64, cache_dir=cache)
    assert all(
        np.array_equal(a, b)
        for a, b in zip(first.src + first.tgt, again.src + again.tgt, strict=True)
    )
    assert again.num_too_long == first.num_too_long

    data.encode_corpus(tok, corpus, max_len=32, cache_dir=cache)  # max_len changed
    edited = data.Corpus(src=corpus.src[:-1] + ["Ganz neu."], tgt=corpus.tgt, summary=None)
    data.encode_corpus(tok, edited, max_len=64, cache_dir=cache)  # content changed
    retold = data.Corpus(src=corpus.src, tgt=corpus.tgt[:-1] + ["Ganz neu."], summary=None)
    data.encode_corpus(tok, retold, max_len=64, cache_dir=cache)  # a target alone changed
    other_tok = data.train_tokenizer(corpus.src + corpus.tgt, tmp_path / "o.model", vocab_size=500)
    data.encode_corpus(other_tok, corpus, max_len=64, cache_dir=cache)  # tokenizer changed
    assert len(list(cache.glob("encoded-*.npz"))) == 5

    # What a run reads now stays; the four others go, and nothing but their kind is touched.
    in_use = data.encoded_cache_file(tok, edited, cache, max_len=64)
    assert in_use in cache.glob("encoded-*.npz")
    (cache / "notes.txt").write_text("mine")
    (cache / "other.npz").write_bytes(b"not ours either")
    removed, failed = data.prune_encoded_cache(cache, keep=[in_use])
    assert len(removed) == 4 and failed == [] and in_use not in removed
    assert sorted(cache.iterdir()) == sorted([in_use, cache / "notes.txt", cache / "other.npz"])
    assert data.prune_encoded_cache(tmp_path / "no such folder", keep=[]) == ([], [])


def test_the_token_cache_file_changes_with_the_normalization_and_the_cache_format(
    tmp_path, monkeypatch
):
    # Ids cached before normalize() or the file's layout changed must not be read as current.
    corpus = data.Corpus(src=["Ein Mann."], tgt=["A man."], summary=None)
    tok = OneTokenPerWord()
    before = data.encoded_cache_file(tok, corpus, tmp_path)
    monkeypatch.setattr(
        data.batching, "NORMALIZATION_VERSION", data.batching.NORMALIZATION_VERSION + 1
    )
    renormalized = data.encoded_cache_file(tok, corpus, tmp_path)
    monkeypatch.setattr(data.batching, "_CACHE_FORMAT", data.batching._CACHE_FORMAT + 1)
    assert len({before, renormalized, data.encoded_cache_file(tok, corpus, tmp_path)}) == 3


def test_corpora_that_split_the_same_text_otherwise_have_their_own_cache_files(tmp_path):
    # Each cache file is read for one corpus; these pairs run together into one string.
    corpora = [
        (["ab", "c"], ["x", "y"]),
        (["a", "bc"], ["x", "y"]),  # where one sentence ends
        (["a", "b"], ["c", "d"]),
        (["a", "bc"], ["", "d"]),  # where the sources end and the targets begin
        ([""], [""]),
        ([], []),  # how many pairs
    ]
    files = {
        data.encoded_cache_file(OneTokenPerWord(), data.Corpus(src, tgt, summary=None), tmp_path)
        for src, tgt in corpora
    }
    assert len(files) == len(corpora)


def test_a_cached_corpus_says_how_many_pairs_were_too_long(tmp_path):
    # train.py prints the count; read from the cache, it was 0 and the limit was not named.
    corpus = data.Corpus(src=["a " * 8, "a", "a"], tgt=["a", "a " * 8, "a"], summary=None)
    first = data.encode_corpus(OneTokenPerWord(), corpus, max_len=8, cache_dir=tmp_path)
    again = data.encode_corpus(OneTokenPerWord(), corpus, max_len=8, cache_dir=tmp_path)
    assert again.num_too_long == first.num_too_long == 2 and len(again) == 1
    assert str(again) == str(first) == "1 pairs encoded, 2 longer than 8 tokens dropped"


def test_a_cache_file_that_cannot_be_deleted_is_reported_and_not_counted_removed(
    tmp_path, monkeypatch
):
    # train.py warns with the failed lines and says how many files went.
    stale = [tmp_path / "encoded-a.npz", tmp_path / "encoded-b.npz"]
    for path in stale:
        path.write_bytes(b"ids")
    unlink = pathlib.Path.unlink

    def denied_for_a(self, *args, **kwargs):
        if self.name == "encoded-a.npz":
            raise PermissionError(13, "Permission denied", str(self))
        return unlink(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "unlink", denied_for_a)
    assert data.prune_encoded_cache(tmp_path, keep=[]) == (
        [stale[1]],
        [f"{stale[0]}: Permission denied"],
    )


def test_a_stale_file_another_host_deleted_first_is_no_failure(tmp_path, monkeypatch):
    # Hosts sharing a workdir prune its cache at once: a file can go between the listing
    # and the deletion. That is the result asked for, not a line to warn of.
    stale = [tmp_path / "encoded-a.npz", tmp_path / "encoded-b.npz"]
    for path in stale:
        path.write_bytes(b"ids")
    unlink = pathlib.Path.unlink

    def deleted_by_another_host_first(self, *args, **kwargs):
        os.remove(self)
        return unlink(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "unlink", deleted_by_another_host_first)
    assert data.prune_encoded_cache(tmp_path, keep=[]) == (stale, [])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("damage", ["truncated", "empty", "lengths", "counts", "header"])
def test_a_damaged_token_cache_is_made_again_with_a_warning(
    damage, multi30k_tokenizer, multi30k_slice, tmp_path, capsys
):
    # The cache is disposable (README): a damaged file was a BadZipFile traceback.
    tok = multi30k_tokenizer
    spec = data.CorpusSpec(dataset="files", data_dir=str(multi30k_slice(n=50, splits=("train",))))
    corpus = data.load_corpus(spec, "train")
    cache = tmp_path / "cache"
    first = data.encode_corpus(tok, corpus, max_len=64, cache_dir=cache)
    (path,) = cache.glob("encoded-*.npz")
    if damage in ("lengths", "counts"):  # a readable file whose arrays disagree
        with np.load(path) as z:
            arrays = dict(z)
        if damage == "lengths":
            arrays["src_len"] = arrays["src_len"] + 1
        else:  # the last target gone: pairs would be read one source short
            arrays["tgt"] = arrays["tgt"][: -arrays["tgt_len"][-1]]
            arrays["tgt_len"] = arrays["tgt_len"][:-1]
        with open(path, "wb") as f:
            np.savez(f, **arrays)
    elif damage == "header":  # one byte of an array's header, CRC intact: a SyntaxError
        with zipfile.ZipFile(path) as z:
            members = {name: z.read(name) for name in z.namelist()}
        assert b"'descr': '<" in members["src.npy"]
        members["src.npy"] = members["src.npy"].replace(b"'descr': '<", b"'descr': ',", 1)
        with zipfile.ZipFile(path, "w") as z:
            for name, raw in members.items():
                z.writestr(name, raw)
    else:
        path.write_bytes(path.read_bytes()[:100] if damage == "truncated" else b"")
    again = data.encode_corpus(tok, corpus, max_len=64, cache_dir=cache)
    assert [a.tolist() for a in again.src + again.tgt] == [
        a.tolist() for a in first.src + first.tgt
    ]
    err = capsys.readouterr().err
    assert (
        err.startswith(f"warning: tokenizing again: {path} cannot be read") and err.count("\n") == 1
    )
    # Written again whole: the next call reads it without a warning.
    data.encode_corpus(tok, corpus, max_len=64, cache_dir=cache)
    assert capsys.readouterr().err == ""


# --- shapes and padding on full Multi30k ---


@pytest.mark.parametrize("max_tokens", [4096, 8192])
def test_padding_efficiency_and_shapes_on_full_multi30k(
    full_encoded, multi30k_tokenizer, max_tokens
):
    b = batcher(full_encoded, multi30k_tokenizer, max_tokens=max_tokens)
    assert b.padding_efficiency() >= 0.90
    assert b.num_shapes == len(b.shapes) <= data.batching.DEFAULT_MAX_SHAPES
    for rows, S, T in b.shapes:
        assert rows % 8 == 0 and rows * (S + T) <= max_tokens
    longest = max(len(x) for x in full_encoded.src), max(len(y) for y in full_encoded.tgt)
    assert (
        max(S for _, S, _ in b.shapes) == longest[0] and max(T for *_, T in b.shapes) == longest[1]
    )
    # The efficiency figure is what the batches really hold: real tokens over padded positions.
    held = efficiency_held(b, b.batches_per_epoch, multi30k_tokenizer.pad_id)
    assert abs(held - b.padding_efficiency()) < 0.005


def efficiency_held(b, num_batches, pad_id):
    """Real (non-pad) source and target tokens over padded positions in the next batches."""
    real = padded = 0
    for _ in range(num_batches):
        batch = next(b)
        real += sum(int((batch[k] != pad_id).sum()) for k in ("src", "tgt_out"))
        padded += batch["src"].size + batch["tgt_out"].size
    return real / padded


def test_batches_hold_the_right_tokens(small, multi30k_tokenizer):
    tok = multi30k_tokenizer
    b = batcher(small, tok, max_tokens=512)
    pairs = {(tuple(x), tuple(y)) for x, y in zip(small.src, small.tgt, strict=True)}
    shapes = {(r, S, T) for r, S, T in b.shapes}
    for _ in range(2 * b.batches_per_epoch):
        batch = next(b)
        assert {k: v.dtype for k, v in batch.items()} == dict.fromkeys(
            ("src", "tgt_in", "tgt_out"), np.int32
        )
        src, tgt_in, tgt_out = (global_rows(batch, k) for k in ("src", "tgt_in", "tgt_out"))
        assert (src.shape[0], src.shape[1], tgt_out.shape[1]) in shapes
        assert tgt_in.shape == tgt_out.shape
        for s_row, in_row, out_row in zip(src, tgt_in, tgt_out, strict=True):
            x = s_row[s_row != tok.pad_id]
            y = out_row[out_row != tok.pad_id]
            assert (tuple(x), tuple(y)) in pairs  # a real pair, no padding rows
            assert (s_row[: len(x)] == x).all() and (s_row[len(x) :] == tok.pad_id).all()
            assert in_row[0] == tok.bos_id and (in_row[1 : len(y)] == y[:-1]).all()
            assert (in_row[len(y) :] == tok.pad_id).all() and y[-1] == tok.eos_id


def test_every_pair_once_per_epoch_up_to_carry_over(small, multi30k_tokenizer):
    tok = multi30k_tokenizer
    b = batcher(small, tok, max_tokens=512, seed=3)
    index = {
        (tuple(x), tuple(y)): i for i, (x, y) in enumerate(zip(small.src, small.tgt, strict=True))
    }
    counts = np.zeros(len(small), int)
    epochs = 5
    while b.epoch < epochs:
        batch = next(b)
        for s_row, out_row in zip(
            global_rows(batch, "src"), global_rows(batch, "tgt_out"), strict=True
        ):
            counts[
                index[tuple(s_row[s_row != tok.pad_id]), tuple(out_row[out_row != tok.pad_id])]
            ] += 1
    assert (
        counts.min() >= epochs - 1 and counts.max() <= epochs
    )  # carry-over: at most one epoch late
    assert counts.sum() > (epochs - 1) * len(small)


# 1 x 3: rows must be a multiple of the 3 hosts, not only of each host's devices.
@pytest.mark.parametrize("num_devices, process_count", [(1, 1), (2, 1), (2, 2), (1, 3)])
def test_one_pass_holds_every_pair_exactly_once(
    small, multi30k_tokenizer, num_devices, process_count
):
    tok = multi30k_tokenizer
    hosts = host_batchers(small, tok, num_devices, process_count, max_tokens=512)
    shapes = {(r, S, T) for r, S, T in hosts[0].shapes}
    assert {r % (num_devices * process_count) for r, _, _ in shapes} == {0}  # rows per host
    seen, filler, pairs_per_shape = [], 0, dict.fromkeys(shapes, 0)
    for per_host in zip(*(h.one_pass() for h in hosts), strict=True):
        src, tgt_in, tgt_out = (
            np.concatenate([global_rows(b, k) for b in per_host])
            for k in ("src", "tgt_in", "tgt_out")
        )
        shape = (src.shape[0], src.shape[1], tgt_out.shape[1])
        assert shape in shapes
        before = len(seen)
        for s_row, in_row, out_row in zip(src, tgt_in, tgt_out, strict=True):
            y = out_row[out_row != tok.pad_id]
            if len(y) == 0:  # a filler row: padding only, on every side
                assert (s_row == tok.pad_id).all() and (in_row == tok.pad_id).all()
                filler += 1
                continue
            assert in_row[0] == tok.bos_id and (in_row[1 : len(y)] == y[:-1]).all()
            seen.append((tuple(s_row[s_row != tok.pad_id]), tuple(y)))
        pairs_per_shape[shape] += len(seen) - before
    # A shape with fewer pairs than one batch has rows goes, pairs and all, to a larger
    # one: kept, its batch was mostly padding here and repeated its pairs in training.
    covering = hosts[0].shapes[-1]  # the one shape that may, in a toy corpus
    too_few = {shape: n for shape, n in pairs_per_shape.items() if n < shape[0]}
    assert too_few.keys() <= {covering}, f"shapes (rows, S, T) with too few pairs: {too_few}"
    assert sorted(seen) == sorted(
        (tuple(x), tuple(y)) for x, y in zip(small.src, small.tgt, strict=True)
    )
    assert filler < sum(r for r, _, _ in shapes)  # at most one part-filled batch per shape
    assert hosts[0].position == 0  # the training stream did not move


def test_shuffle_depends_on_seed_and_epoch(small, multi30k_tokenizer):
    def first_rows(seed, n):
        b = batcher(small, multi30k_tokenizer, max_tokens=512, seed=seed)
        return [global_rows(next(b), "src").tobytes() for _ in range(n)]

    n = batcher(small, multi30k_tokenizer, max_tokens=512).batches_per_epoch
    assert first_rows(0, n) == first_rows(0, n)
    assert first_rows(0, n) != first_rows(1, n)
    b = batcher(small, multi30k_tokenizer, max_tokens=512, seed=0)
    epoch0 = [global_rows(next(b), "src").tobytes() for _ in range(n)]
    epoch1 = [global_rows(next(b), "src").tobytes() for _ in range(n)]
    assert epoch0 != epoch1
    # Not only the order of the batches: which sentences share a batch changes too.
    b = batcher(small, multi30k_tokenizer, max_tokens=512, seed=0)
    groups = [
        {frozenset(row.tobytes() for row in global_rows(next(b), "src")) for _ in range(n)}
        for _epoch in range(2)
    ]
    # Measured: 0 of 28 batches alike here; 7 with one shuffle of each bucket for all epochs.
    assert len(groups[0] & groups[1]) <= n // 10
    # Another seed groups the sentences otherwise from the first epoch on.
    b = batcher(small, multi30k_tokenizer, max_tokens=512, seed=1)
    other_seed = {frozenset(row.tobytes() for row in global_rows(next(b), "src")) for _ in range(n)}
    assert len(groups[0] & other_seed) <= n // 10


def test_the_order_of_shapes_is_shuffled_anew_every_epoch(multi30k_tokenizer):
    # Four shapes of two batches each, so every epoch holds the same batches: with one
    # shuffle of the batch order for all epochs, the shapes came in the same order each time.
    lengths = [n for n in (4, 8, 16, 32) for _ in range(16)]
    pairs = [np.arange(5, 5 + n, dtype=np.int32) for n in lengths]

    def shape_orders(seed):
        b = batcher(
            data.EncodedCorpus(src=pairs, tgt=pairs), multi30k_tokenizer, max_tokens=64, seed=seed
        )
        assert [r for r, _, _ in b.shapes] == [8] * 4 and b.batches_per_epoch == 8
        return [[next(b)["src"].shape[-1] for _ in range(8)] for _epoch in range(3)]

    orders = shape_orders(seed=0)
    assert sorted(orders[0]) == sorted(orders[1]) == [4, 4, 8, 8, 16, 16, 32, 32]
    assert orders[0] != orders[1] and orders[1] != orders[2]
    assert shape_orders(seed=1) != orders  # the seed orders the shapes too


def test_pairs_up_to_max_len_tokens_with_eos_are_kept_and_longer_ones_dropped():
    # The boundary itself: pairs far over the limit passed with an off-by-one there.
    src = ["a " * 7, "a " * 8, "a", "a"]  # 7 + eos = 8 tokens: kept; 9: dropped
    tgt = ["a", "a", "a " * 7, "a " * 8]
    corpus = data.Corpus(src=src, tgt=tgt, summary=None)
    encoded = data.encode_corpus(OneTokenPerWord(), corpus, max_len=8)
    assert [len(x) for x in encoded.src] == [8, 2] and [len(y) for y in encoded.tgt] == [2, 8]
    assert encoded.num_too_long == 2


# --- resume ---


def test_resume_gives_the_uninterrupted_batches(small, multi30k_tokenizer):
    tok = multi30k_tokenizer
    reference = batcher(small, tok, max_tokens=512, seed=7)
    expected = [next(reference) for _ in range(3 * reference.batches_per_epoch)]
    for k in (0, 5, reference.batches_per_epoch + 2):  # including across an epoch boundary
        run = batcher(small, tok, max_tokens=512, seed=7)
        for _ in range(k):
            next(run)
        state = json.loads(json.dumps(run.state()))
        resumed = batcher(small, tok, max_tokens=512, seed=7)
        resumed.restore(state)
        assert resumed.position == k
        for want in expected[k : k + 12]:
            got = next(resumed)
            assert all(np.array_equal(got[key], want[key]) for key in want)


def test_restore_refuses_other_data_or_settings(small, multi30k_tokenizer):
    tok = multi30k_tokenizer
    state = batcher(small, tok, max_tokens=512).state()
    fewer = data.EncodedCorpus(src=small.src[:-1], tgt=small.tgt[:-1])
    retold = [y.copy() for y in small.tgt]  # one target token changed, every length the same
    retold[0][0] += 1
    resaid = [x.copy() for x in small.src]  # the same on the source side
    resaid[0][0] += 1
    moved = [x.copy() for x in small.src]  # every token the same, one moved to the next pair
    moved[1], moved[2] = moved[1][:-1], np.concatenate([moved[1][-1:], moved[2]])
    for other in (
        batcher(fewer, tok, max_tokens=512),
        batcher(data.EncodedCorpus(src=small.src, tgt=retold), tok, max_tokens=512),
        batcher(data.EncodedCorpus(src=resaid, tgt=small.tgt), tok, max_tokens=512),
        batcher(data.EncodedCorpus(src=moved, tgt=small.tgt), tok, max_tokens=512),
        batcher(small, tok, max_tokens=1024),
        batcher(small, tok, max_tokens=512, seed=1),
    ):
        with pytest.raises(data.DataError, match="resume"):
            other.restore(state)


# --- devices and hosts ---


def test_global_batch_is_independent_of_device_and_host_count(small, multi30k_tokenizer):
    tok = multi30k_tokenizer
    steps = 8

    def global_batches(num_devices, process_count=1):
        hosts = host_batchers(small, tok, num_devices, process_count, max_tokens=512)
        out = []
        for _ in range(steps):
            per_host = [next(h) for h in hosts]
            for batch in per_host:
                assert all(v.shape[0] == num_devices for v in batch.values())
            out.append(
                {k: np.concatenate([global_rows(b, k) for b in per_host]) for k in per_host[0]}
            )
        return out

    reference = global_batches(1)
    for num_devices, process_count in ((2, 1), (4, 1), (2, 2), (1, 4)):
        other = global_batches(num_devices, process_count)
        for want, got in zip(reference, other, strict=True):
            assert all(np.array_equal(want[k], got[k]) for k in want)


def test_a_resume_on_a_device_count_of_other_batches_names_the_counts_to_use(
    small, multi30k_tokenizer
):
    # Rows are a multiple of lcm(8, devices): a run of 1 device resumes on 2 (the same
    # batches, above), not on 3 or 2 hosts of 3, and the refusal says so instead of
    # listing every setting the batches hang on.
    tok = multi30k_tokenizer
    one = batcher(small, tok, max_tokens=512)
    next(one)
    state = json.loads(json.dumps(one.state()))
    two = batcher(small, tok, max_tokens=512, num_devices=2)
    two.restore(state)
    assert two.position == 1
    for hosts, devices in ((1, 3), (2, 3)):
        with pytest.raises(data.DataError) as refused:
            host_batchers(small, tok, devices, hosts, max_tokens=512)[0].restore(state)
        assert str(refused.value) == (
            f"cannot resume the data iterator on {hosts * devices} devices: the checkpoint's "
            "batches were made for 1 device, with rows a multiple of 8, and here their rows "
            "would be a multiple of 24, so other batches; resume on 1, 2, 4 or 8 devices in "
            "all, or start a new --workdir"
        )
    state = json.loads(json.dumps(batcher(small, tok, max_tokens=512, num_devices=3).state()))
    with pytest.raises(data.DataError, match="resume on 3, 6, 12 or 24 devices in all"):
        one.restore(state)
    # A state of 3 hosts of one device each counts the devices of all hosts.
    state = json.loads(json.dumps(host_batchers(small, tok, 1, 3, max_tokens=512)[0].state()))
    with pytest.raises(data.DataError, match="made for 3 devices"):
        one.restore(state)
    del state["devices"]  # a checkpoint from before the state kept its device count
    with pytest.raises(data.DataError, match="seed or device count changed"):
        one.restore(state)


def test_array_shapes_names_the_shape_of_every_batch_a_host_gets(small, multi30k_tokenizer):
    # What train.py compiles ahead on an accelerator: a batch of a shape not listed would
    # be compiled again when it comes.
    from transformer.training import batch_layout

    for num_devices, process_count in ((1, 1), (2, 1), (2, 2)):
        for host in host_batchers(small, multi30k_tokenizer, num_devices, process_count):
            listed = host.array_shapes()
            assert len(listed) == host.num_shapes == len(set(listed))
            seen = {batch_layout(next(host)) for _ in range(3 * host.batches_per_epoch)}
            assert seen == set(listed)


# --- prefetch ---


def test_prefetch_yields_the_same_batches_and_tracks_state(small, multi30k_tokenizer):
    tok = multi30k_tokenizer
    plain = batcher(small, tok, max_tokens=512)
    with data.prefetch(batcher(small, tok, max_tokens=512), size=3) as fetched:
        for _ in range(5):
            want, got = next(plain), next(fetched)
            assert all(np.array_equal(want[k], got[k]) for k in want)
        assert fetched.state() == plain.state()  # the consumer's position, not the producer's


def test_prefetch_reraises_errors_and_closes():
    def broken():
        yield 1
        raise ValueError("bad batch")

    it = data.prefetch(broken())
    assert next(it) == 1
    with pytest.raises(ValueError, match="bad batch"):
        next(it)
    assert list(data.prefetch(iter(range(4)))) == [0, 1, 2, 3]

    def endless():
        i = 0
        while True:
            yield i
            i += 1

    it = data.prefetch(endless(), size=2)
    next(it)
    it.close()
    assert not it._thread.is_alive()
    with pytest.raises(StopIteration):  # not a wait for ever on the emptied queue
        _next_within(it)


def _next_within(iterator, seconds=5.0):
    """next(iterator) on a thread: a test failure where it would hang."""
    out = {}

    def call():
        try:
            out["value"] = next(iterator)
        except BaseException as e:
            out["error"] = e

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "next() hung"
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_prefetch_ends_for_good_after_the_last_item_or_an_error():
    # A next() after the end must not wait for ever on the queue of a finished producer.
    it = data.prefetch(iter(range(2)))
    assert [_next_within(it), _next_within(it)] == [0, 1]
    for _ in range(2):
        with pytest.raises(StopIteration):
            _next_within(it)

    def broken():
        raise ValueError("bad batch")
        yield

    it = data.prefetch(broken())
    with pytest.raises(ValueError, match="bad batch"):
        _next_within(it)
    with pytest.raises(StopIteration):
        _next_within(it)


def test_prefetch_runs_at_most_size_items_ahead():
    # TokenBatcher is endless: an unbounded queue would fill host memory for the whole run.
    pulled = 0

    def endless():
        nonlocal pulled
        while True:
            pulled += 1
            yield pulled

    def pulled_when_still(seconds=0.3):
        before, deadline = -1, time.monotonic() + 5
        while pulled != before and time.monotonic() < deadline:
            before = pulled
            time.sleep(seconds)
        return pulled

    with data.prefetch(endless(), size=2) as it:
        assert it._thread.daemon  # a Ctrl-C'd run exits while the thread waits to put
        assert pulled_when_still() == 2 + 1  # the queue's items and the one waiting to go in
        next(it)
        assert pulled_when_still() == 2 + 2
    pulled = 0
    with data.prefetch(endless(), size=0) as it:  # not Queue(0), which has no bound
        assert pulled_when_still() == 1 + 1
    pulled = 0
    with data.prefetch(endless()) as it:  # the default: 2 ahead, as train.py asks
        assert pulled_when_still() == 2 + 1


def _wait_until(condition, seconds=5.0):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the producer did not get there"
        time.sleep(0.01)


class _Counting:
    """An iterator of 1, 2, 3, ... with a TokenBatcher's state(): how many it handed out."""

    def __init__(self):
        self.position = 0

    def __iter__(self):
        return self

    def __next__(self):
        self.position += 1
        return self.position

    def state(self):
        return {"position": self.position}


def test_prefetch_state_is_the_consumers_while_the_producer_runs_ahead():
    # What a checkpoint stores: a resumed run must go on from the last batch trained on,
    # not from the producer's, which is `size` + 1 batches further.
    counting = _Counting()
    with data.prefetch(counting, size=3) as it:
        _wait_until(lambda: counting.position == 3 + 1)
        assert it.state() == {"position": 0}  # nothing consumed yet: where it started
        assert [next(it), next(it)] == [1, 2]
        _wait_until(lambda: counting.position == 2 + 3 + 1)
        assert it.state() == {"position": 2}


def test_prefetch_of_an_iterator_whose_state_is_no_method_has_no_state():
    class Tagged:  # `state` a plain attribute, not a TokenBatcher's method
        state = "ready"

        def __init__(self):
            self.items = iter(range(3))

        def __iter__(self):
            return self

        def __next__(self):
            return next(self.items)

    fetched = data.prefetch(Tagged())
    assert list(fetched) == [0, 1, 2] and fetched.state() is None


def test_prefetch_hands_on_an_exit_that_is_no_exception():
    # A SystemExit or KeyboardInterrupt raised in the producer must reach the consumer;
    # else its next() waits for ever on a thread that is gone.
    def leaving():
        yield 1
        raise SystemExit("the data source gave up")

    it = data.prefetch(leaving())
    assert _next_within(it) == 1
    with pytest.raises(SystemExit, match="gave up"):
        _next_within(it)


def test_prefetch_as_a_context_manager_stops_its_thread_and_drops_pending_items():
    # A run that ends keeps neither a thread pulling batches nor the batches it pulled.
    class Item:
        pass

    made = []

    def make():
        item = Item()
        made.append(weakref.ref(item))
        return item

    def items():
        while True:
            yield make()

    with data.prefetch(items(), size=2) as it:
        first = next(it)
        _wait_until(lambda: len(made) == 1 + 2 + 1)  # 2 in the queue, 1 waiting to go in
    assert not it._thread.is_alive()
    gc.collect()
    # The producer may have pulled one more before it saw the stop: gone as well.
    assert [ref() is not None for ref in made] == [True] + [False] * (len(made) - 1)
    assert made[0]() is first


# --- shapes of made-up corpora ---


def toy_batcher(src, tgt, **kw):
    corpus = data.EncodedCorpus(src=src, tgt=tgt)
    kw.setdefault("num_devices", 1)
    return data.TokenBatcher(corpus, pad_id=0, bos_id=1, **kw)


def ids(n):
    return np.arange(5, 5 + n, dtype=np.int32)


def test_a_shape_with_exactly_one_batch_of_pairs_is_kept():
    # Merged into a larger shape, its pairs would be padded to 32 tokens.
    pairs = [ids(4)] * 8 + [ids(32)] * 8  # 8 rows each (ROW_MULTIPLE: the fewest a batch has)
    assert toy_batcher(pairs, pairs, max_tokens=64).shapes == [(8, 4, 4), (8, 32, 32)]


def test_of_two_shapes_too_rare_the_rarest_goes_first():
    # 3 pairs of (4, 4) and 6 of (8, 8) are each too few for 8 rows. The 3 join the 6 and
    # together fill a batch of (8, 8); dropping (8, 8) first sent all 9 to (32, 32).
    pairs = [ids(4)] * 3 + [ids(8)] * 6 + [ids(32)] * 8
    assert toy_batcher(pairs, pairs, max_tokens=64).shapes == [(8, 8, 8), (8, 32, 32)]


def test_a_covering_shape_that_no_pair_needs_is_not_kept():
    # The longest source and the longest target are in different pairs: a (40, 40) shape
    # would be one more compiled program that no batch uses.
    from transformer.training import batch_layout

    src, tgt = [ids(40)] * 8 + [ids(4)] * 8, [ids(4)] * 8 + [ids(40)] * 8
    b = toy_batcher(src, tgt, max_tokens=8 * 44)
    assert sorted((S, T) for _, S, T in b.shapes) == [(4, 40), (40, 4)]
    assert {batch_layout(next(b)) for _ in range(4 * b.batches_per_epoch)} == set(b.array_shapes())


def test_batches_per_epoch_is_the_mean_rounded():
    # 22 pairs in batches of 8 rows: 2.75 batches an epoch on average (carry-over), so 3;
    # --epochs N trains N x this many steps.
    pairs = [ids(4)] * 22
    b = toy_batcher(pairs, pairs, max_tokens=64)
    assert b.shapes == [(8, 4, 4)] and b.batches_per_epoch == 3
    few = [ids(4)] * 3  # 3 / 8 rounds to 0 batches: an epoch is still one
    assert toy_batcher(few, few, max_tokens=64).batches_per_epoch == 1


def test_padding_efficiency_of_fewer_pairs_than_a_batch_is_what_the_batches_hold():
    # Epoch 0 has no whole batch of 3 pairs in 16 rows; train.py still prints the figure.
    b = toy_batcher([ids(3), ids(5), ids(9)], [ids(7), ids(2), ids(4)], max_tokens=256)
    assert b.shapes == [(16, 9, 7)]
    held = efficiency_held(b, 3, pad_id=0)  # 48 rows: every pair 16 times
    assert b.padding_efficiency() == held == 30 / 48


def test_shapes_of_as_many_pairs_are_shuffled_each_its_own_way():
    src = [ids(4)] * 16 + [ids(32)] * 16
    tgt = [np.concatenate([[100 + i], ids(3)]).astype(np.int32) for i in range(32)]
    b = toy_batcher(src, tgt, max_tokens=64)
    orders = {4: [], 32: []}
    for _ in range(b.batches_per_epoch):
        batch = next(b)
        orders[batch["src"].shape[-1]].extend(global_rows(batch, "tgt_out")[:, 0] - 100)
    assert sorted(orders[4]) == list(range(16)) and sorted(orders[32]) == list(range(16, 32))
    assert orders[4] != [i - 16 for i in orders[32]]  # not one permutation for both


def test_without_shuffle_the_batches_are_the_corpus_in_order_shape_by_shape():
    # shuffle=False: a reproducible order to read and debug batches by.
    src = [ids(4), ids(32)] * 16
    tgt = [np.concatenate([[100 + i], ids(3)]).astype(np.int32) for i in range(32)]
    b = toy_batcher(src, tgt, max_tokens=64, shuffle=False)
    firsts = [global_rows(next(b), "tgt_out")[:, 0] - 100 for _ in range(2 * b.batches_per_epoch)]
    in_order = [*range(0, 32, 2), *range(1, 32, 2)]  # the (4, 4) pairs, then the (32, 4) ones
    assert np.concatenate(firsts).tolist() == in_order * 2


def test_the_batcher_makes_at_most_max_shapes_shapes():
    # --max-shapes bounds the train-step programs compiled.
    pairs = [ids(n) for n in (4, 8, 16, 32) for _ in range(16)]
    assert toy_batcher(pairs, pairs, max_tokens=64).num_shapes == 4
    assert toy_batcher(pairs, pairs, max_tokens=64, max_shapes=2).num_shapes == 2


def test_a_pair_goes_to_the_covering_shape_of_fewest_positions():
    # Three (2, 8) pairs, too few for a shape of their own: (8, 8) pads them to 16
    # positions, (2, 20) to 22 (fewer cells of the rectangle, but more positions).
    src = [ids(2)] * 16 + [ids(8)] * 16 + [ids(2)] * 3
    tgt = [ids(20)] * 16 + [ids(8)] * 16 + [ids(8)] * 3
    b = toy_batcher(src, tgt, max_tokens=200)
    assert b.shapes == [(8, 8, 8), (8, 2, 20)]
    pairs_per_shape = dict.fromkeys([(8, 8), (2, 20)], 0)
    for batch in b.one_pass():
        pairs_per_shape[batch["src"].shape[-1], batch["tgt_out"].shape[-1]] += int(
            (global_rows(batch, "tgt_out")[:, 0] != 0).sum()
        )
    assert pairs_per_shape == {(8, 8): 16 + 3, (2, 20): 16}


def test_the_shuffles_kept_in_memory_stay_few_over_many_epochs():
    # Each (shape, epoch) shuffle is a corpus-sized array: kept for every epoch of a long
    # run, they filled host memory.
    pairs = [ids(4)] * 12 + [ids(32)] * 12
    b = toy_batcher(pairs, pairs, max_tokens=64)
    for _ in range(60 * b.batches_per_epoch):
        next(b)
    assert b.epoch >= 50 and len(b._perm_cache) <= 4 * b.num_shapes + 1


def padded_positions(src_len, tgt_len, shapes):
    """Source plus target positions of every pair padded to the cheapest shape covering it."""
    positions = np.array([S + T for S, T in shapes])
    return int(positions[data.batching._assign(src_len, tgt_len, shapes)].sum())


def check_shapes(src_len, tgt_len, shapes, max_shapes):
    """What every shape set promises: at most max_shapes, sorted by S + T, the last covering
    the longest pairs (so every pair has a shape)."""
    assert len(shapes) <= max_shapes and len(set(shapes)) == len(shapes)
    assert shapes == sorted(shapes, key=lambda st: (st[0] + st[1], st))
    assert shapes[-1] == (src_len.max(), tgt_len.max())


def test_bucket_shapes_are_not_improved_by_swapping_any_one_shape():
    # The greedy pick and its swap passes end where no shape but the covering one, swapped
    # for another (S, T), pads less: checked against every S and T of the corpus's lengths.
    for seed in (*range(6), 20):  # seed 20: one swap pass leaves a shape to swap
        rng = np.random.default_rng(seed)
        src = rng.integers(1, 30, 200)
        tgt = np.clip(src + rng.integers(-5, 6, 200), 1, None)
        shapes = data.batching.choose_bucket_shapes(src, tgt, max_shapes=4)
        check_shapes(src, tgt, shapes, 4)
        cost = padded_positions(src, tgt, shapes)
        for i in range(len(shapes) - 1):  # the last, covering shape stays
            for swap in itertools.product(np.unique(src).tolist(), np.unique(tgt).tolist()):
                others = shapes[:i] + [swap] + shapes[i + 1 :]
                assert padded_positions(src, tgt, others) >= cost, (seed, shapes[i], swap)


def test_bucket_shapes_of_a_long_tailed_corpus():
    # WMT-like lengths, 1 to 250 tokens: more distinct lengths than the 64 per side that the
    # shape search tries, so it picks its candidates along the length distribution.
    rng = np.random.default_rng(0)
    src = np.clip(np.round(rng.lognormal(3.0, 0.6, 20000)), 1, 250).astype(np.int64)
    tgt = np.clip(np.round(src * rng.lognormal(0.05, 0.15, 20000)), 1, 250).astype(np.int64)
    assert len(np.unique(src)) > 64 and len(np.unique(tgt)) > 64
    shapes = data.batching.choose_bucket_shapes(src, tgt, max_shapes=12)
    check_shapes(src, tgt, shapes, 12)
    assert len(shapes) == 12
    # One shape would hold 12% real tokens here; twelve hold 85% (measured; 80% asserted).
    assert (src + tgt).sum() / padded_positions(src, tgt, shapes) >= 0.80


def test_no_shape_is_kept_that_pads_no_pair_less():
    # Two lengths need two shapes; (4, 32) and (32, 4) would save nothing, so a twelve-shape
    # budget still compiles two programs.
    lengths = np.array([4] * 10 + [32] * 10)
    assert data.batching.choose_bucket_shapes(lengths, lengths, max_shapes=12) == [(4, 4), (32, 32)]
    # Nor (4, 4) where no pair is that short on both sides (the covering shape stays).
    src, tgt = np.array([4] * 10 + [40] * 10), np.array([40] * 10 + [4] * 10)
    assert data.batching.choose_bucket_shapes(src, tgt, max_shapes=12) == [
        (4, 40),
        (40, 4),
        (40, 40),
    ]


@pytest.mark.parametrize(
    "layout",
    [
        dict(num_devices=0),
        dict(process_count=0),
        dict(process_index=2, process_count=2),
        dict(process_index=-1, process_count=2),
    ],
)
def test_a_bad_device_layout_is_a_data_error(layout):
    with pytest.raises(data.DataError, match="bad device layout"):
        toy_batcher([ids(4)] * 8, [ids(4)] * 8, max_tokens=64, **layout)


def test_an_empty_corpus_or_budget_is_a_data_error():
    with pytest.raises(data.DataError, match="no training pairs"):
        toy_batcher([], [], max_tokens=64)
    assert toy_batcher([ids(4)], [ids(4)], max_tokens=64).shapes == [(8, 4, 4)]  # one is enough
    with pytest.raises(data.DataError, match="max_tokens must be positive"):
        toy_batcher([ids(4)] * 8, [ids(4)] * 8, max_tokens=0)
    # A budget below one row still makes batches of the fewest rows, 8.
    assert toy_batcher([ids(4)] * 8, [ids(4)] * 8, max_tokens=1).shapes == [(8, 4, 4)]


@pytest.mark.parametrize("state", [{"position": 3}, None, {"position": "x", "seed": 0}])
def test_restore_refuses_a_malformed_state_with_a_data_error(state):
    # Not a KeyError traceback where a checkpoint's data state is damaged or of an old version.
    b = toy_batcher([ids(4)] * 8, [ids(4)] * 8, max_tokens=64)
    with pytest.raises(data.DataError, match="not a TokenBatcher state"):
        b.restore(state)


# --- inference batches ---


def test_inference_batches_keep_every_sentence_whole(full_encoded):
    sentences = full_encoded.src[:400] + [np.arange(4, 4 + 300, dtype=np.int32)]  # one very long
    seen = np.zeros(len(sentences), int)
    lengths_seen = []
    shapes = set()
    for indices, src in data.inference_batches(sentences, max_tokens=1000, pad_id=0):
        assert src.dtype == np.int32 and len(indices) == src.shape[0]
        assert src.shape[0] * src.shape[1] <= 1000 or src.shape[0] == 1
        shapes.add(src.shape[1])
        for i, row in zip(indices, src, strict=True):
            seen[i] += 1
            n = len(sentences[i])
            assert (row[:n] == sentences[i]).all() and (row[n:] == 0).all()
            lengths_seen.append(n)
    assert (seen == 1).all()
    assert lengths_seen == sorted(lengths_seen, reverse=True)
    assert shapes <= {*data.batching.INFERENCE_LENGTHS, 384} and 384 in shapes


def test_a_sentence_of_exactly_a_padded_length_is_not_padded_further():
    # One size up would decode 8 tokens as 12 (or 128 as 256): half again the work, no error.
    lengths = (*data.batching.INFERENCE_LENGTHS, 256, 384)
    for previous, length in zip((0, *lengths), lengths, strict=False):
        sentence = np.arange(1, length + 1, dtype=np.int32)
        [(_, src)] = data.inference_batches([sentence], max_tokens=4096, pad_id=0)
        assert src.shape == (1, length) and (src[0] == sentence).all()
        [(_, src)] = data.inference_batches([sentence[: previous + 1]], max_tokens=4096, pad_id=0)
        assert src.shape == (1, length)


def test_inference_batches_are_as_full_as_max_tokens_allows():
    # Fewer, fuller batches are fewer decoder calls; a sentence longer than max_tokens
    # still gets its own batch, one row.
    sentences = [ids(10)] * 20 + [ids(100)] * 2
    batches = data.inference_batches(sentences, max_tokens=60, pad_id=0)
    assert [src.shape for _, src in batches] == [(1, 128), (1, 128)] + [(5, 12)] * 4


def test_inference_lengths_pad_a_sentence_by_at_most_half():
    # A few lengths (few compiled decoders) and bounded padding work up to 128 tokens.
    lengths = data.batching.INFERENCE_LENGTHS
    assert len(lengths) <= 10 and list(lengths) == sorted(set(lengths))
    for n in range(1, 129):
        assert n <= data.batching.inference_length(n) <= max(8, 1.5 * n)
    assert data.batching.inference_length(129) == 256 and data.batching.inference_length(300) == 384
