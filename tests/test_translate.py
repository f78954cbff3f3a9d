"""translate(): normalization, batching, input order and empty lines, on a real tokenizer."""

import inspect
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import data
from transformer import Transformer, TransformerConfig
from transformer import translate as translate_module
from transformer.decoding import beam_search, greedy_search
from transformer.translate import detokenize, encode_sources, translate, translate_ids

MAX_EXTRA_LEN = 4


@pytest.fixture(scope="module")
def setup(multi30k_dir, tmp_path_factory):
    """A tokenizer trained on 300 lines of Multi30k, a random tiny model and 12 test sentences."""
    corpus = data.read_parallel(multi30k_dir / "val.en", multi30k_dir / "val.de")
    tokenizer = data.train_tokenizer(
        corpus.src[:300] + corpus.tgt[:300],
        tmp_path_factory.mktemp("tok") / "tokenizer.model",
        vocab_size=400,
    )
    model = Transformer(TransformerConfig.preset("tiny", vocab_size=tokenizer.vocab_size))
    dummy = jnp.ones((1, 4), jnp.int32)
    params = model.init(jax.random.key(0), dummy, dummy)["params"]
    params = jax.tree.map(lambda x: 3.0 * x, params)  # random but source-dependent outputs
    sentences = data.read_lines(multi30k_dir / "test2016.en")[:12]
    return model, params, tokenizer, sentences


def test_batching_and_order_do_not_change_translations(setup):
    model, params, tokenizer, sentences = setup
    kw = dict(greedy=True, max_extra_len=MAX_EXTRA_LEN)
    one_batch = translate(model, params, tokenizer, sentences, max_tokens=4096, **kw)
    assert len(set(one_batch)) > 1, "a model that ignores its input cannot check ordering"
    many_batches = translate(model, params, tokenizer, sentences, max_tokens=40, **kw)
    assert many_batches == one_batch
    reversed_input = translate(model, params, tokenizer, sentences[::-1], max_tokens=4096, **kw)
    assert reversed_input[::-1] == one_batch
    # Each in its own place: the translation of that sentence alone (the two checks above
    # would pass outputs given back in reverse).
    for i in (0, 4, 11):
        assert one_batch[i] == translate(model, params, tokenizer, [sentences[i]], **kw)[0]


def test_no_decoded_batch_exceeds_max_tokens(setup, monkeypatch):
    """Rows padded to a power of two stay within the budget; only a too-long sentence is over."""
    model, params, tokenizer, sentences = setup
    lines = sentences + [f"{sentences[5]} {sentences[9]}"]  # the last is longer than the budget
    src_ids = encode_sources(tokenizer, lines)
    max_tokens = 100
    padded = [data.batching.inference_length(len(ids)) for ids in src_ids]
    # Without the fix: 100 // 32 = 3 rows of 32, padded to 4 rows (128 positions).
    assert padded.count(32) == 3 and len(src_ids[-1]) > max_tokens
    shapes = []
    search_programs = translate_module.search_programs

    def recording(model, params, batch_shapes, **kw):  # the shapes of the batches decoded
        shapes.extend(batch_shapes)
        return search_programs(model, params, batch_shapes, **kw)

    monkeypatch.setattr(translate_module, "search_programs", recording)
    kw = dict(bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id, max_extra_len=MAX_EXTRA_LEN)
    within = translate_ids(model, params, src_ids, greedy=True, max_tokens=max_tokens, **kw)
    assert shapes[0] == (1, padded[-1])  # longest first, alone
    assert all(B * S <= max_tokens for B, S in shapes[1:]), shapes
    one_batch = translate_ids(model, params, src_ids, greedy=True, max_tokens=4096, **kw)
    assert within == one_batch


def test_lengths_of_one_padded_length_share_a_batch_its_rows_padded_with_its_sentences():
    # Lengths 3 to 8 all pad to 8: one batch (one compiled program), not one per length.
    # Its rows go up to a power of two with copies of its sentences, which end with them
    # (rows of padding could decode on to the length limit); 4 rows stay 4.
    lines = [np.arange(4, 4 + n) for n in range(3, 9)]
    [(indices, src)] = translate_module.decoding_batches(lines, max_tokens=4096, pad_id=0)
    assert sorted(indices) == list(range(6)) and src.shape == (6, 8)
    for real, rows in ((src, 8), (src[:4], 4)):
        padded = translate_module.pad_batch_rows(real)
        assert len(padded) == rows
        assert (padded[: len(real)] == real).all()
        assert all(any((row == r).all() for r in real) for row in padded[len(real) :])


def test_translation_is_the_detokenized_search_output(setup):
    model, params, tokenizer, sentences = setup
    sentence = sentences[3]
    src_ids = encode_sources(tokenizer, [sentence])[0]
    assert src_ids[-1] == tokenizer.eos_id and src_ids[:-1] == tokenizer.encode(
        data.normalize(sentence)
    )
    tokens = greedy_search(
        model,
        params,
        jnp.asarray([src_ids], jnp.int32),
        bos_id=tokenizer.bos_id,
        eos_id=tokenizer.eos_id,
        pad_id=tokenizer.pad_id,
        max_extra_len=MAX_EXTRA_LEN,
    )
    expected = tokenizer.decode(np.asarray(tokens[0]))
    got = translate(model, params, tokenizer, [sentence], greedy=True, max_extra_len=MAX_EXTRA_LEN)
    assert got == [expected]


def test_outputs_end_before_the_end_token(monkeypatch):
    # The random model never ends within its few steps, so a scripted search does: the end
    # token, what a finished hypothesis holds after it (another end token too), and padding
    # are not output ids.
    eos = 3

    def scripted(model, params, shapes, *, greedy, **options):
        row = np.array([5, 6, eos, 7, eos, 0])
        return {shape: lambda params, src: np.tile(row, (len(src), 1)) for shape in shapes}

    monkeypatch.setattr(translate_module, "search_programs", scripted)
    sources = [[4, 4, eos], [], [9, eos]]
    out = translate_ids(object(), {}, sources, bos_id=2, eos_id=eos, greedy=True)
    assert out == [[5, 6], [], [5, 6]]


def test_translate_passes_every_search_setting_on(setup, monkeypatch):
    model, params, tokenizer, sentences = setup
    calls = []

    def recording(model, params, src_ids, **kw):
        calls.append(kw)
        return [[] for _ in src_ids]

    monkeypatch.setattr(translate_module, "translate_ids", recording)
    settings = dict(
        greedy=False, beam_size=2, alpha=1.3, max_extra_len=3, max_tokens=77, progress=True
    )
    assert translate(model, params, tokenizer, sentences[:2], **settings) == ["", ""]
    ids = dict(bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id)
    assert calls == [{**settings, **ids}]


def test_translate_ids_searches_with_its_settings(monkeypatch):
    # Each setting reaches the compiled search (a scripted one here): the padding id of
    # the caller's tokenizer too, and no beam settings for greedy search.
    searched = []

    def scripted(model, params, shapes, *, greedy, **options):
        searched.append((greedy, options))

        def search(params, src):  # [5, end] in every row; beam search gives scores too
            tokens = np.tile([5, 3], (len(src), 1))
            return tokens if greedy else (tokens, None)

        return dict.fromkeys(shapes, search)

    monkeypatch.setattr(translate_module, "search_programs", scripted)
    ids = dict(bos_id=2, eos_id=3, pad_id=1)
    beam = dict(beam_size=2, alpha=1.3)
    for greedy in (False, True):
        out = translate_ids(object(), {}, [[4, 3]], greedy=greedy, max_extra_len=7, **beam, **ids)
        assert out == [[5]]
    assert searched == [
        (False, {**ids, "max_extra_len": 7, **beam}),
        (True, {**ids, "max_extra_len": 7}),
    ]


def test_the_library_searches_as_the_paper_by_default():
    # Users who import translate() and pass no search settings get the paper's beam 4 and
    # alpha 0.6 (evaluate.py's own defaults are separate flags), and the same output bound.
    for search in (translate, translate_ids, beam_search, greedy_search):
        defaults = {k: p.default for k, p in inspect.signature(search).parameters.items()}
        assert defaults["max_extra_len"] == 50
        if search is not greedy_search:
            assert (defaults["beam_size"], defaults["alpha"]) == (4, 0.6)
    assert inspect.signature(translate).parameters["greedy"].default is False


def test_a_progress_bar_only_when_asked_for(setup, capsys):
    # A library call prints nothing by default; evaluate.py asks for the bar.
    model, params, tokenizer, sentences = setup
    kw = dict(greedy=True, max_extra_len=MAX_EXTRA_LEN)
    quiet = translate(model, params, tokenizer, sentences[:3], **kw)
    assert capsys.readouterr().err == ""
    assert translate(model, params, tokenizer, sentences[:3], progress=True, **kw) == quiet
    err = capsys.readouterr().err
    assert "decoding" in err and "3/3" in err


def test_the_progress_bar_counts_each_sentence_decoded_once(monkeypatch, capsys):
    # Not the empty line (never decoded), nor the copy that pads 3 rows to 4 (scripted
    # search): the bar ends at 3/3.
    def scripted(model, params, shapes, *, greedy, **options):
        return dict.fromkeys(shapes, lambda params, src: np.tile([5, 3], (len(src), 1)))

    monkeypatch.setattr(translate_module, "search_programs", scripted)
    sources = [[4, 3], [5, 3], [], [6, 3]]
    translate_ids(object(), {}, sources, bos_id=2, eos_id=3, greedy=True, progress=True)
    assert "3/3" in capsys.readouterr().err.splitlines()[-1]


def test_empty_and_blank_lines_give_empty_outputs(setup):
    model, params, tokenizer, sentences = setup
    lines = ["", sentences[0], "   ", "\t", sentences[1]]  # not a palindrome: order shows
    kw = dict(beam_size=2, max_extra_len=MAX_EXTRA_LEN)
    out = translate(model, params, tokenizer, lines, **kw)
    alone = [translate(model, params, tokenizer, [s], **kw)[0] for s in sentences[:2]]
    assert all(alone) and out == ["", alone[0], "", "", alone[1]]
    assert translate(model, params, tokenizer, [], max_extra_len=MAX_EXTRA_LEN) == []


def test_a_source_id_outside_the_vocabulary_is_an_error_not_garbage(setup):
    model, params, tokenizer, _ = setup  # one embedded as NaN, a negative one wrapped around
    vocab = tokenizer.vocab_size
    for bad in (vocab, -3):  # the first of the sentence, of the first such sentence named
        src_ids = [[5, 6, tokenizer.eos_id], [], [5, bad, vocab + 9, tokenizer.eos_id], [-7]]
        with pytest.raises(
            ValueError, match=rf"src_ids\[2\] holds id {bad}, outside .*\[0, {vocab}\)"
        ):
            translate_ids(
                model,
                params,
                src_ids,
                bos_id=tokenizer.bos_id,
                eos_id=tokenizer.eos_id,
                pad_id=tokenizer.pad_id,
                greedy=True,
                max_extra_len=MAX_EXTRA_LEN,
            )


def test_one_string_instead_of_a_list_is_a_type_error(setup):
    model, params, tokenizer, sentences = setup  # it translated each character as a sentence
    with pytest.raises(TypeError, match="pass \\[sentence\\]"):
        translate(model, params, tokenizer, sentences[0])


def test_ids_that_are_not_integers_are_an_error_not_truncated_or_parsed(setup):
    model, params, tokenizer, sentences = setup
    kw = dict(bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id, greedy=True, max_extra_len=2)
    # [5.5, 7, 3] was decoded as [5, 7, 3], and ["5", "3"] as [5, 3].
    # [[5, 7, 3]] (a sentence inside a list) is no sentence either.
    for bad in ([5.5, 7, tokenizer.eos_id], ["5", str(tokenizer.eos_id)], [[5, 7, 3]]):
        with pytest.raises(ValueError, match=r"src_ids\[1\] must be a flat sequence of integer"):
            translate_ids(model, params, [[5, tokenizer.eos_id], bad], **kw)
    with pytest.raises(TypeError, match=r"src_ids holds text: give token ids"):
        translate_ids(model, params, sentences[:2], **kw)


def test_one_sentences_ids_without_their_list_are_a_one_line_error():
    # [4, 5, 3] (or its array) failed with "object of type 'int' has no len()", and a
    # sentence of lists of two lengths with numpy's "inhomogeneous shape" naming no sentence.
    one_id = r"src_ids\[0\] is the id 4, not a sentence: give a list of sentences' ids \(\[ids\]"
    for src_ids, message in (
        ([4, 5, 3], one_id),
        (np.array([4, 5, 3]), one_id),
        ([[4, 3], [[5, 6], [3]]], r"src_ids\[1\] must be a flat sequence of integer token ids"),
    ):
        with pytest.raises(ValueError, match=message):
            translate_ids(object(), {}, src_ids, bos_id=2, eos_id=3, greedy=True)


def test_ids_as_a_generator_or_a_padded_array_translate_as_the_list(setup):
    # A generator was used up by the text check: nothing decoded, [] returned. A row of
    # padding only (an empty line in a padded array) was decoded as a sentence.
    model, params, tokenizer, sentences = setup
    kw = dict(bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id, greedy=True, max_extra_len=2)
    src_ids = encode_sources(tokenizer, [sentences[0], "", sentences[1]])
    expected = translate_ids(model, params, src_ids, **kw)
    assert expected[0] and expected[1] == [] and expected[2]
    assert translate_ids(model, params, (ids for ids in src_ids), **kw) == expected
    padded = np.full((3, max(map(len, src_ids)) + 3), tokenizer.pad_id, np.int64)
    for row, ids in zip(padded, src_ids, strict=True):
        row[: len(ids)] = ids
    assert translate_ids(model, params, padded, **kw) == expected
    assert translate_ids(model, params, padded.astype(np.uint16), **kw) == expected
    with pytest.raises(ValueError, match="max_tokens must be at least 1, got 0"):
        translate_ids(model, params, src_ids, max_tokens=0, **kw)


def test_a_tokenizer_that_is_not_the_models_is_an_error(setup):
    model, params, tokenizer, sentences = setup
    for path in ("tok.model", Path("tok.model")):
        with pytest.raises(TypeError, match=r"got the path 'tok.model': use data.Tokenizer.load"):
            translate(model, params, path, sentences[:1])
    other = Transformer(model.config.replace(vocab_size=500))  # it failed in SentencePiece
    with pytest.raises(ValueError, match="has 400 pieces but the model's vocabulary is 500"):
        translate(other, params, tokenizer, sentences[:1])


def test_raw_input_is_normalized_like_training_data(setup):
    """No-break spaces, an XML entity and extra whitespace translate like the clean sentence."""
    model, params, tokenizer, _ = setup
    clean = "A man & a dog."
    dirty = "  A\u00a0man &amp; a\tdog.  "
    sources = encode_sources(tokenizer, [clean, dirty])
    assert sources[0] == sources[1]
    ids = translate_ids(
        model,
        params,
        sources,
        bos_id=tokenizer.bos_id,
        eos_id=tokenizer.eos_id,
        greedy=True,
        max_extra_len=MAX_EXTRA_LEN,
    )
    assert ids[0] == ids[1] and ids[0]  # not two empty outputs


def test_detokenized_outputs_hold_no_line_break_of_any_kind(setup):
    """Byte-fallback pieces can spell every character str.splitlines breaks at."""
    _, _, tokenizer, sentences = setup
    byte_id = {tokenizer.id_to_piece(i): i for i in range(tokenizer.vocab_size)}
    words = tokenizer.encode("A man")
    breaks = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"
    hypotheses = [
        words + [byte_id[f"<0x{b:02X}>"] for b in char.encode()] + words for char in breaks
    ]
    assert [tokenizer.decode(ids) for ids in hypotheses] == [f"A man{c} A man" for c in breaks]
    assert detokenize(tokenizer, hypotheses) == ["A man  A man"] * len(breaks)
    plain = [tokenizer.encode(data.normalize(s)) for s in sentences] + [[]]
    assert detokenize(tokenizer, plain) == [tokenizer.decode(ids) for ids in plain[:-1]] + [""]


def test_programs_compiled_side_by_side_are_the_searches_and_kept(setup, monkeypatch):
    """Each batch shape's program is the search jax.jit would run with those options, and
    a later call with the same model, options and shapes compiles nothing again."""
    model, params, tokenizer, sentences = setup
    # A third of the sentences: the reference compiles a search per sentence length.
    src_ids = encode_sources(tokenizer, sentences[:4])
    kw = dict(bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id, max_extra_len=MAX_EXTRA_LEN)
    compiled = []
    compile_side_by_side = translate_module.compile_side_by_side

    def counting(lowered, *args, **kwargs):
        compiled.append(len(lowered))
        return compile_side_by_side(lowered, *args, **kwargs)

    monkeypatch.setattr(translate_module, "compile_side_by_side", counting)
    monkeypatch.setattr(translate_module, "_PROGRAMS", {})  # none kept from other tests
    got = translate_ids(model, params, src_ids, beam_size=3, alpha=0.6, max_tokens=60, **kw)
    expected = []
    for ids in src_ids:  # one sentence at a time, through jax.jit
        tokens, _ = beam_search(model, params, jnp.asarray([ids]), beam_size=3, alpha=0.6, **kw)
        row = np.asarray(tokens[0])
        ends = np.flatnonzero(row == tokenizer.eos_id)
        expected.append(row[: ends[0]].tolist() if len(ends) else row.tolist())
    assert got == expected
    # Options are part of what a program was compiled for: another alpha compiles anew.
    # (This random model's outputs do not depend on alpha, so only the count can tell.)
    translate_ids(model, params, src_ids, beam_size=3, alpha=3.0, max_tokens=60, **kw)
    assert compiled[0] > 1 and compiled[1] == compiled[0]  # several shapes, per alpha
    again = translate_ids(model, params, src_ids, beam_size=3, alpha=0.6, max_tokens=60, **kw)
    assert compiled[2] == 0 and again == translate_ids(
        model, params, src_ids, beam_size=3, alpha=0.6, max_tokens=60, **kw
    )
    # Only the most recently used are kept: with room for 2, alpha 0.6 is compiled again.
    monkeypatch.setattr(translate_module, "MAX_KEPT_PROGRAMS", 2)
    translate_ids(model, params, src_ids, beam_size=3, alpha=3.0, max_tokens=60, **kw)
    assert len(translate_module._PROGRAMS) == 2
    assert again == translate_ids(
        model, params, src_ids, beam_size=3, alpha=0.6, max_tokens=60, **kw
    )
    assert compiled[-1] == compiled[0]


def test_a_program_is_kept_for_its_model_and_parameter_dtypes_by_recent_use(setup, monkeypatch):
    # Bookkeeping only (nothing compiled): a shape asked for twice is compiled once; another
    # model or parameters of another dtype get programs of their own (one compiled for
    # float32 parameters does not take bfloat16 ones); the least recently used goes first.
    model, params, _, _ = setup
    compiled = []

    def compile_side_by_side(lowerings):
        compiled.append(len(lowerings))
        return [object() for _ in lowerings]

    monkeypatch.setattr(translate_module, "compile_side_by_side", compile_side_by_side)
    monkeypatch.setattr(translate_module, "_PROGRAMS", {})
    monkeypatch.setattr(translate_module, "MAX_KEPT_PROGRAMS", 3)
    kw = dict(greedy=True, bos_id=2, eos_id=3, pad_id=0, max_extra_len=MAX_EXTRA_LEN)

    def search_programs(model, params, shapes):
        return translate_module.search_programs(model, params, shapes, **kw)

    first = search_programs(model, params, [(1, 4), (2, 8), (1, 4)])
    assert compiled == [2] and len(first) == 2
    bfloat16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    search_programs(model, bfloat16, [(1, 4)])
    search_programs(Transformer(model.config.replace(matmul_dtype="bfloat16")), params, [(1, 4)])
    assert compiled == [2, 1, 1]
    # Room for 3: the fourth put out the least recently used, (1, 4) of `model`. (2, 8),
    # used again, outlasts the bfloat16 parameters' program when (1, 4) comes back.
    assert search_programs(model, params, [(2, 8)]) == {(2, 8): first[(2, 8)]}
    search_programs(model, params, [(1, 4)])
    assert compiled == [2, 1, 1, 0, 1]
    assert search_programs(model, params, [(2, 8)]) == {(2, 8): first[(2, 8)]}
