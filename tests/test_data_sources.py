"""Sources and cleaning: normalization, file errors, skip counts, splits (real Multi30k)."""

import concurrent.futures
import gzip
import os
import socket
import stat

import pytest

import data
from data.sources import clean_pairs


def one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message and message
    return message


# --- normalize ---


def test_normalize_folds_spaces_entities_and_invisibles():
    assert data.normalize("  Ein\u00a0Mann\tgeht  ") == "Ein Mann geht"
    assert data.normalize("stone &amp; tile &lt;b&gt;") == "stone & tile <b>"
    assert data.normalize("Jeans & amp und") == "Jeans & amp und"  # not an entity
    assert data.normalize("AT&T &copy") == "AT&T &copy"  # only the XML entities are unescaped
    assert data.normalize("a\u200bb\ufeff") == "ab"
    assert data.normalize("a\u2060b") == "ab"  # word joiner
    assert data.normalize("&quot;Hi&quot;, he&apos;s") == '"Hi", he\'s'  # all five entities
    # Zero-width (non-)joiners stay: they spell Persian and Indic words, and emoji.
    assert data.normalize("\u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645") == (
        "\u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645"
    )
    assert data.normalize("\U0001f469\u200d\U0001f4bb") == "\U0001f469\u200d\U0001f4bb"
    assert data.normalize("\uff21\uff22 \ufb01") == "AB fi"  # NFKC: full-width, ligature
    assert data.normalize("a\x00b\x1bc") == "abc"
    assert data.normalize(" \t \u00a0 ") == ""
    assert data.normalize("Q&amp;amp;A") == "Q&A"  # double-escaped
    assert data.normalize("It&#39;s") == "It's"  # the numeric form of &apos;
    # Soft hyphens are invisible line-break hints: "Kinder\u00adgarten" was another word.
    assert data.normalize("Kinder\u00adgarten") == "Kindergarten"


@pytest.mark.parametrize(
    "text",
    [
        "&amp;amp;amp;",
        "\uff06amp;",
        "&am\u200bp;",
        "e\u200b\u0301",
        "a\x00\u0301",
        "&#38;amp;",
        "&lt;\u0338 &gt;\u0338",  # the unescaped < and > compose with U+0338: \u226e, \u226f
    ],
)
def test_normalize_is_idempotent_on_tricky_input(text):
    once = data.normalize(text)
    assert data.normalize(once) == once


def test_normalize_on_multi30k_dirt(multi30k_dir):
    lines = data.read_lines(multi30k_dir / "train.de")
    normalized = [data.normalize(line) for line in lines]
    assert normalized[7365] == " ".join(lines[7365].split())  # the stray TAB
    assert not any("\u00a0" in s or "\t" in s or s != s.strip() for s in normalized)
    assert all(data.normalize(s) == s for s in normalized)  # idempotent on real text
    en = [data.normalize(line) for line in data.read_lines(multi30k_dir / "train.en")]
    assert not any("&amp;" in s for s in en)
    assert en[3157] == "People walking down the street past a Lounge & Grill."


# --- reading files ---


def test_read_lines_splits_on_newline_only(tmp_path):
    path = tmp_path / "f.en"
    path.write_bytes("one\u2028still one\x0cand one\r\ntwo\n\nfour".encode())
    assert data.read_lines(path) == ["one\u2028still one\x0cand one", "two", "", "four"]
    # A UTF-8 byte-order mark (Notepad writes one) is not part of the first sentence.
    path.write_bytes("\ufeffeins\nzwei\n".encode())
    assert data.read_lines(path) == ["eins", "zwei"]


def test_utf16_and_lone_carriage_returns_are_named_not_misread(tmp_path):
    utf16 = tmp_path / "u16.en"
    for encoding in ("utf-16-le", "utf-16-be"):  # with a byte-order mark, either way round
        utf16.write_bytes("\ufeffhi\nyo\n".encode(encoding))
        with pytest.raises(data.DataError) as e:
            data.read_lines(utf16)
        assert str(utf16) in one_line(e) and "iconv -f utf-16 -t utf-8" in one_line(e)
    # Classic Mac line ends: one line of three sentences before, so one training pair.
    mac = tmp_path / "mac.en"
    # With a final \n too (`echo >> file`), the check was off and the lines were merged.
    for text in (b"a man\rtwo dogs\rred car\r", b"a man\rtwo dogs\rred car\r\n"):
        mac.write_bytes(text)
        with pytest.raises(data.DataError) as e:
            data.read_lines(mac)
        assert str(mac) in one_line(e) and "carriage return" in one_line(e)
    # A stray carriage return inside a line of a \n file stays, and one line ending in \r
    # alone is one line.
    stray = tmp_path / "stray.en"
    stray.write_bytes(b"a\rb\nc\n")
    assert data.read_lines(stray) == ["a\rb", "c"]
    one = tmp_path / "one.en"
    one.write_bytes(b"a man\r")
    assert data.read_lines(one) == ["a man"]
    # So do stray ones in a file of one line and in a Windows (\r\n) file.
    for text, lines in ((b"a\rb\n", ["a\rb"]), (b"a\rb\r\nc\rd\r\n", ["a\rb", "c\rd"])):
        stray.write_bytes(text)
        assert data.read_lines(stray) == lines


def test_invalid_utf8_names_file_and_line(multi30k_slice):
    d = multi30k_slice(n=20, splits=("train",))
    lines = (d / "train.de").read_bytes().split(b"\n")
    lines[0] = b""  # an empty first line counts too
    lines[6] = b"Ein M\xe4nnchen"  # latin-1, line 7
    (d / "train.de").write_bytes(b"\n".join(lines))
    with pytest.raises(data.DataError) as e:
        data.read_parallel(d / "train.en", d / "train.de")
    message = one_line(e)
    assert str(d / "train.de") in message and "line 7" in message and "UTF-8" in message
    offset = len(b"\n".join(lines[:6]) + b"\nEin M")  # of the byte \xe4, from 0
    assert f"at byte {offset})" in message


def test_gzipped_data_says_to_decompress_it(multi30k_slice):
    # Multi30k's upstream files are .gz: the advice was to convert them with iconv.
    d = multi30k_slice(n=20, splits=("train",))
    for lang in ("en", "de"):
        raw = (d / f"train.{lang}").read_bytes()
        (d / f"train.{lang}").write_bytes(gzip.compress(raw))
    with pytest.raises(data.DataError) as e:
        data.read_parallel(d / "train.en", d / "train.de")
    message = one_line(e)
    assert message == f"{d / 'train.en'} is gzip-compressed, not text; decompress it (gunzip, zcat)"
    # Named as they are upstream, with .gz: no split, and the files to decompress.
    for lang in ("en", "de"):
        (d / f"train.{lang}").rename(d / f"train.{lang}.gz")
    spec = data.CorpusSpec(dataset="files", data_dir=str(d))
    with pytest.raises(data.MissingSplitError) as e:
        data.load_corpus(spec, "train")
    assert one_line(e).endswith(
        "available splits: none; decompress train.en.gz and train.de.gz (gunzip)"
    )


def test_a_folder_given_as_a_file_is_a_one_line_error(tmp_path):
    # Not an IsADirectoryError traceback.
    with pytest.raises(data.DataError) as e:
        data.read_lines(tmp_path)
    assert one_line(e) == f"cannot read {tmp_path}: Is a directory"


def test_missing_file_is_named(multi30k_slice):
    d = multi30k_slice(n=5, splits=("train",), langs=("en",))
    with pytest.raises(data.DataError) as e:
        data.read_parallel(d / "train.en", d / "train.de")
    assert str(d / "train.de") in one_line(e)


def test_line_count_mismatch_names_both_files_and_counts(multi30k_slice):
    d = multi30k_slice(n=300, splits=("train",))
    (d / "train.de").write_bytes(b"\n".join((d / "train.de").read_bytes().split(b"\n")[:297]))
    with pytest.raises(data.DataError) as e:
        data.read_parallel(d / "train.en", d / "train.de")
    message = one_line(e)
    assert str(d / "train.en") in message and str(d / "train.de") in message
    assert "300" in message and "297" in message


def test_read_aligned_lines_gives_raw_lines_or_names_every_count(tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    a.write_text("One  &amp; two\nthree\n")
    b.write_text("eins und zwei\ndrei\n")
    assert data.read_aligned_lines(a, b) == [["One  &amp; two", "three"], ["eins und zwei", "drei"]]
    c.write_text("un\n")
    with pytest.raises(data.DataError) as e:
        data.read_aligned_lines(a, b, c)
    message = one_line(e)
    assert f"{a} has 2 lines, {b} has 2 lines, {c} has 1 lines" in message


# --- cleaning ---


def test_cleaning_counts_every_skip(multi30k_slice):
    d = multi30k_slice(n=300, splits=("train",))
    en = data.read_lines(d / "train.en")
    de = data.read_lines(d / "train.de")
    en[10], de[10] = "", "  "  # empty pair
    en[20], de[20] = " \t", "\u00a0"  # whitespace only (NBSP folds to a space)
    en[30] = ""  # one side empty
    de[40] = "   "  # one side whitespace
    de[50] = "@@"  # junk, as in Multi30k
    en[60] = "..."  # junk
    en[70], de[70] = "1990", "1990"  # digits only: a year is content, not junk
    corpus = clean_pairs(en, de, name="slice")
    s = corpus.summary
    assert (s.total, s.empty, s.one_side_empty, s.junk, s.kept) == (300, 2, 2, 2, 294)
    assert len(corpus.src) == len(corpus.tgt) == 294
    assert corpus.src[10] == data.normalize(en[11])  # alignment survives the skips
    assert corpus.tgt[10] == data.normalize(de[11])
    assert ("1990", "1990") in zip(corpus.src, corpus.tgt, strict=True)
    line = str(s)
    assert "\n" not in line and "300" in line and "294 kept" in line and "6 skipped" in line


def test_the_cleaning_line_names_the_split_and_each_reason_with_its_own_count():
    # The line the CLIs print: with equal counts per reason (above), two reasons' counts
    # swapped, or the total skipped given as junk, read the same.
    src = ["", "", "a", "ein", "@@", "a", "...", "x", "y", "z"]
    tgt = ["", "b", "", "", "b", "@@", "c", "x", "y", "z"]
    summary = clean_pairs(src, tgt, name="train en-de").summary
    assert str(summary) == (
        "train en-de: 10 pairs read, 3 kept, 7 skipped (1 empty, 3 one side empty, 3 junk)"
    )


def test_full_multi30k_train_skips_exactly_the_two_junk_pairs(multi30k_dir):
    corpus = data.read_parallel(multi30k_dir / "train.en", multi30k_dir / "train.de")
    s = corpus.summary
    assert (s.total, s.kept, s.junk, s.empty, s.one_side_empty) == (29000, 28998, 2, 0, 0)
    raw_de = data.read_lines(multi30k_dir / "train.de")
    assert raw_de[16509] == raw_de[16663] == "@@"
    assert "@@" not in corpus.tgt
    assert corpus.src_path == str(multi30k_dir / "train.en")
    assert s.name == "train.en / train.de"  # read_parallel's label names both files


# Multi30k read from --data-dir is evaluation's usual corpus: it keeps every line too.
@pytest.mark.parametrize("dataset", ["files", "multi30k"])
def test_clean_false_keeps_every_line_for_evaluation(multi30k_slice, dataset):
    d = multi30k_slice(n=50, splits=("train",))
    lines = data.read_lines(d / "train.de")
    lines[3] = "@@"
    lines[4] = ""
    lines[5] = "Stein\u00a0&amp;  Holz "
    (d / "train.de").write_text("\n".join(lines) + "\n", encoding="utf-8")
    spec = data.CorpusSpec(dataset=dataset, data_dir=str(d))
    corpus = data.load_corpus(spec, "train", clean=False)
    assert len(corpus.src) == len(corpus.tgt) == 50
    assert corpus.tgt[3:6] == ["@@", "", "Stein & Holz"]  # kept, and normalized all the same
    assert corpus.tgt_path == str(d / "train.de")
    assert corpus.summary.kept == 50 and corpus.summary.skipped == 0
    assert len(data.load_corpus(spec, "train").tgt) == 48


def test_references_without_a_file_are_the_lines_as_given_when_nothing_was_skipped():
    # sacreBLEU scores against raw references (TFDS gives no file); a cleaned corpus has
    # lost the alignment with the raw lines, so it is scored against its normalized ones.
    raw = ["Stein\u00a0&amp;  Holz ", "ein Hund"]
    corpus = clean_pairs(["stone &amp; wood", "a dog"], raw, clean=False)
    assert corpus.references() == raw and corpus.tgt == ["Stein & Holz", "ein Hund"]
    cleaned = clean_pairs(["stone", "", "a dog"], ["Stein\u00a0 ", "x", "ein Hund"])
    assert cleaned.references() == ["Stein", "ein Hund"]


def test_sentences_of_unequal_counts_are_a_one_line_error_either_way():
    # Not zip()'s ValueError traceback, nor pairs made of the shorter side.
    for src, tgt in ((["a", "b"], ["x"]), (["a"], ["x", "y"])):
        with pytest.raises(data.DataError) as e:
            clean_pairs(src, tgt, name="val en-de")
        assert one_line(e) == (f"val en-de: {len(src)} source lines but {len(tgt)} target lines")


# --- load_corpus ---


def test_files_source_any_language_pair(multi30k_slice):
    d = multi30k_slice(splits=("val",), n=30, langs=("fr", "cs"))
    corpus = data.load_corpus(
        data.CorpusSpec(dataset="files", data_dir=str(d), src="fr", tgt="cs"), "val"
    )
    fr, cs = data.read_lines(d / "val.fr"), data.read_lines(d / "val.cs")
    assert corpus.src == [data.normalize(line) for line in fr]
    assert corpus.tgt == [data.normalize(line) for line in cs]  # the target, not German
    assert (corpus.src_path, corpus.tgt_path) == (str(d / "val.fr"), str(d / "val.cs"))
    assert corpus.summary.name == "val fr-cs"


def test_multi30k_from_data_dir_matches_files(multi30k_dir):
    spec = data.CorpusSpec(data_dir=str(multi30k_dir))
    a = data.load_corpus(spec, "test2016")
    b = data.load_corpus(spec.replace(dataset="files"), "test2016")
    assert a.src == b.src and a.tgt == b.tgt and len(a.src) == 1000


def test_unknown_split_lists_available_splits(multi30k_slice):
    d = multi30k_slice(splits=("train",), n=10)
    multi30k_slice(splits=("val",), n=10)
    # A split whose target is a folder, not a file, is not available.
    multi30k_slice(splits=("test2016",), n=10, langs=("en",))
    (d / "test2016.de").mkdir()
    with pytest.raises(data.MissingSplitError) as e:
        data.load_corpus(data.CorpusSpec(dataset="files", data_dir=str(d)), "test")
    # The folder by its full path, the two files looked for, the splits there are.
    assert one_line(e) == (
        f"no split 'test' for en-de in {d} (no test.en / test.de); available splits: train, val"
    )


def test_a_split_whose_files_are_broken_is_an_error_not_a_missing_split(multi30k_slice):
    # A missing split means a run without it (no validation); broken files must stop it.
    d = multi30k_slice(splits=("train",), n=10)
    spec = data.CorpusSpec(dataset="files", data_dir=str(d))
    for lang in ("en", "de"):  # links into a drive that is not mounted
        (d / f"val.{lang}").symlink_to(f"/nonexistent/val.{lang}")
    with pytest.raises(data.DataError) as e:
        data.load_corpus(spec, "val")
    assert not isinstance(e.value, data.MissingSplitError)
    assert one_line(e).startswith(f"{d / 'val.en'} is a link to /nonexistent/val.en, which is")
    (d / "val.en").unlink()
    (d / "val.en").mkdir()
    (d / "val.de").unlink()
    with pytest.raises(data.DataError) as e:  # the one that is there is named
        data.load_corpus(spec, "val")
    message = one_line(e)
    assert f"no val.de in {d} (its val files are in: en)" in message
    # de is the right language (train has it): the advice is the missing file, not --tgt.
    assert "add val.de (the folder has de files for: train)" in message
    assert "or remove val.en if there is no val split" in message and "--tgt" not in message


def test_a_data_folder_that_cannot_be_looked_into_is_not_a_missing_split(
    multi30k_slice, monkeypatch
):
    # A folder without search permission for this user: os.path.lexists said False, and
    # the error was "no split 'train' ... available splits: none".
    d = multi30k_slice(n=10, splits=("train",))
    lstat = os.lstat

    def denied(path, *args, **kwargs):
        if os.path.dirname(path) == str(d):
            raise PermissionError(13, "Permission denied", str(path))
        return lstat(path, *args, **kwargs)

    monkeypatch.setattr(os, "lstat", denied)
    with pytest.raises(data.DataError) as e:
        data.load_corpus(data.CorpusSpec(dataset="files", data_dir=str(d)), "train")
    assert not isinstance(e.value, data.MissingSplitError)
    assert one_line(e) == (
        f"cannot look into the data directory {d} (Permission denied); "
        "fix its permissions or pass another --data-dir"
    )


def test_a_language_the_folder_lacks_names_those_it_has(multi30k_slice):
    d = multi30k_slice(n=10, splits=("train",), langs=("en", "de", "fr"))
    with pytest.raises(data.DataError) as e:
        data.load_corpus(data.CorpusSpec(dataset="files", data_dir=str(d), src="cs"), "train")
    message = one_line(e)
    assert f"no train.cs in {d}" in message and "de, en, fr" in message and "--src" in message
    assert "add train.cs" not in message


@pytest.mark.parametrize(
    "spec, fragment",
    [
        (data.CorpusSpec(dataset="files"), "--data-dir"),
        (data.CorpusSpec(dataset="nope"), "multi30k, files, tfds"),
        (data.CorpusSpec(dataset="files", data_dir="/nonexistent/dir"), "/nonexistent/dir not"),
        (data.CorpusSpec(dataset="files", data_dir=__file__), "is a file, not a directory"),
        (data.CorpusSpec(tfds_name="wmt14_translate/de-en"), "--tfds-name wmt14_translate"),
        # Not the files read, the TFDS dataset asked for ignored.
        (data.CorpusSpec(dataset="files", tfds_name="x"), "x is for --dataset tfds, not files"),
        (data.CorpusSpec(dataset="tfds", tfds_name="x", data_dir="/tmp"), "drop one of them"),
        (data.CorpusSpec(src="en", tgt="en"), "both 'en'"),
        (data.CorpusSpec(tgt="xx"), "language 'xx'"),
    ],
)
def test_bad_specs_give_one_line_errors(spec, fragment, monkeypatch, tmp_path):
    monkeypatch.setenv("TRANSFORMER_MT_CACHE", str(tmp_path))  # never download here
    with pytest.raises(data.DataError) as e:
        data.load_corpus(spec, "train")
    assert fragment in one_line(e)


def test_write_text_atomically_writes_through_links_and_into_pipes(tmp_path):
    # A link stays a link, its file keeps its permissions; a pipe is written to, not replaced.
    target = tmp_path / "real.txt"
    target.write_text("old\n")
    target.chmod(0o640)
    link = tmp_path / "link.txt"
    link.symlink_to(target)
    data.text.write_text_atomically(link, "new\n")
    assert link.is_symlink() and target.read_text() == "new\n"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        read = pool.submit(fifo.read_text)
        data.text.write_text_atomically(fifo, "through the pipe\n")
        assert read.result(timeout=30) == "through the pipe\n"
    assert stat.S_ISFIFO(fifo.stat().st_mode)
    with pytest.raises(OSError) as e:  # named by the path asked for, not a temporary file
        data.text.write_text_atomically(tmp_path / "real.txt" / "under_a_file.txt", "x")
    assert e.value.filename == str(tmp_path / "real.txt" / "under_a_file.txt")
    if os.path.exists("/dev/full"):  # written in place; its "no space left" names it too
        with pytest.raises(OSError) as e:
            data.text.write_text_atomically("/dev/full", "x")
        assert e.value.filename == "/dev/full"


@pytest.mark.skipif(not os.path.isdir("/dev/fd"), reason="needs /dev/fd")
def test_a_name_of_an_open_file_is_appended_to_not_replaced(tmp_path):
    # `--output /dev/stderr 2>> log`: the log was replaced, all it held before lost, and
    # the shell's redirect went on into the file taken away.
    log = tmp_path / "log.txt"
    log.write_text("before\n")
    link = tmp_path / "out"
    with open(log, "a") as f:
        link.symlink_to(f"/dev/fd/{f.fileno()}")
        assert data.text.names_an_open_file(link) and data.text.is_written_in_place(link)
        data.text.write_text_atomically(f"/dev/fd/{f.fileno()}", "one\n")
        data.text.write_text_atomically(link, "two\n")
        # Linux's own name for the descriptor, and a relative link to a link to one.
        data.text.write_text_atomically(f"/proc/self/fd/{f.fileno()}", "three\n")
        (tmp_path / "relative").symlink_to("out")
        data.text.write_text_atomically(tmp_path / "relative", "four\n")
        f.write("five\n")  # the redirect still writes into the same file
    assert log.read_text() == "before\none\ntwo\nthree\nfour\nfive\n"
    # A name that only begins like one is not one.
    (tmp_path / "not_a_descriptor").symlink_to("/dev/stdout.txt")
    assert not data.text.names_an_open_file(tmp_path / "not_a_descriptor")
    assert not data.text.names_an_open_file(log) and not data.text.is_written_in_place(log)
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    assert not data.text.names_an_open_file(tmp_path / "a")  # a loop of links


def test_writers_that_overlap_each_replace_the_file_whole(tmp_path, monkeypatch):
    # Hosts sharing a workdir write the tokenizer at once, often with one process id.
    monkeypatch.setattr(data.text.os, "getpid", lambda: 7)
    path = tmp_path / "tokenizer.model"

    def first(tmp):
        # Beside the file: renamed within one folder, so on one file system (atomic).
        assert tmp.parent == path.parent
        with open(tmp, "wb") as f:
            f.write(b"one half, ")
            data.text.write_atomically(path, lambda t: t.write_bytes(b"the other host's\n"))
            assert path.read_bytes() == b"the other host's\n"
            f.write(b"the other half\n")

    data.text.write_atomically(path, first)
    assert path.read_bytes() == b"one half, the other half\n"
    assert [p.name for p in tmp_path.iterdir()] == ["tokenizer.model"]


def test_what_is_there_and_no_regular_file_is_written_in_place(tmp_path, monkeypatch):
    # A socket or a folder is not replaced by a file (the write fails, naming it).
    server = tmp_path / "server.sock"
    monkeypatch.chdir(tmp_path)  # bound by a short name: a socket's path has 108 bytes at most
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(server.name)
        assert data.text.is_written_in_place(server) and data.text.is_written_in_place(tmp_path)
        with pytest.raises(OSError) as e:
            data.text.write_text_atomically(server, "x")
        assert e.value.filename == str(server) and stat.S_ISSOCK(server.stat().st_mode)
    assert not data.text.is_written_in_place(tmp_path / "new.txt")


def test_write_text_atomically_leaves_the_old_file_or_the_new_never_half(tmp_path, monkeypatch):
    path = tmp_path / "out" / "de" / "hyp.de"
    data.text.write_text_atomically(path, "Grüße\n")  # the folders are made
    assert path.read_bytes() == "Grüße\n".encode()  # UTF-8, whatever the locale's encoding

    def interrupted(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(data.text.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        data.text.write_text_atomically(path, "zwei\n")
    assert path.read_bytes() == "Grüße\n".encode()
    assert [p.name for p in path.parent.iterdir()] == ["hyp.de"]


def test_a_runs_data_settings_name_its_corpus_and_the_rest_take_defaults():
    # config.json's "data" holds the corpus fields beside the vocabulary and batching
    # settings; an old run's may lack fields added since.
    settings = {"dataset": "files", "data_dir": "/d", "src": "de", "tgt": "en", "vocab_size": 8}
    spec = data.CorpusSpec.from_settings(settings)
    assert spec == data.CorpusSpec(dataset="files", data_dir="/d", src="de", tgt="en")
    assert data.CorpusSpec.from_settings({"src": "de"}) == data.CorpusSpec(src="de")
    # A TFDS run's every field: evaluation reads the data where training found it.
    tfds = {"dataset": "tfds", "tfds_name": "wmt14_translate/de-en", "tfds_data_dir": "/t"}
    assert data.CorpusSpec.from_settings({**tfds, "vocab_size": 8}) == data.CorpusSpec(**tfds)
