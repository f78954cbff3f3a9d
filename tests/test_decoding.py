"""Properties of greedy and beam search on tiny random models."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from transformer import Transformer, TransformerConfig
from transformer.decoding import beam_search, greedy_search, length_penalty

PAD, BOS, EOS = 0, 1, 2


def _peaked_model(vocab_size: int, seed: int = 0, scale: float = 3.0, **overrides):
    """A tiny random model whose weights are scaled up so next-token distributions are peaked."""
    config = TransformerConfig.preset("tiny", vocab_size=vocab_size, dropout_rate=0.0, **overrides)
    model = Transformer(config)
    dummy = jnp.ones((1, 4), jnp.int32)
    params = model.init(jax.random.key(seed), dummy, dummy)["params"]
    return model, jax.tree.map(lambda x: x * scale, params)


def _sources(vocab_size: int, lengths: list[int], seed: int = 0) -> jax.Array:
    """Random sources (words then the end token) of the given non-padding lengths, right-padded."""
    rng = np.random.default_rng(seed)
    src = np.zeros((len(lengths), max(lengths)), np.int32)
    for row, n in enumerate(lengths):
        src[row, : n - 1] = rng.integers(EOS + 1, vocab_size, size=n - 1)
        src[row, n - 1] = EOS
    return jnp.asarray(src)


@pytest.fixture(scope="module")
def model_and_sources():
    model, params = _peaked_model(vocab_size=16)
    return model, params, _sources(16, [6, 3, 9, 4])


def _assert_well_formed(tokens: np.ndarray, src: np.ndarray, max_extra_len: int):
    """No padding inside a hypothesis, padding after its end, length within the limit."""
    for row, src_row in zip(tokens, src, strict=True):
        ends = np.flatnonzero(row == EOS)
        n = ends[0] + 1 if len(ends) else np.count_nonzero(row != PAD)
        assert np.all(row[:n] != PAD) and np.all(row[n:] == PAD)
        assert n <= np.count_nonzero(src_row != PAD) + max_extra_len


@pytest.mark.parametrize(
    "src_shape, changes, message",
    [
        ((2, 5), {"beam_size": 0}, "beam_size must be at least 1, got 0"),
        ((2, 5), {"beam_size": 2.0}, "beam_size must be an integer, got 2.0"),
        ((2, 5), {"max_extra_len": 2.0}, "max_extra_len must be an integer, got 2.0"),
        ((2, 5), {"max_len": 9.5}, "max_len must be an integer, got 9.5"),
        ((2, 5), {"bos_id": 16}, r"bos_id must be in \[0, vocab_size 16\), got 16"),
        ((2, 5), {"eos_id": 21}, r"eos_id must be in \[0, vocab_size 16\), got 21"),
        ((2, 5), {"bos_id": -1}, r"bos_id must be in \[0, vocab_size 16\), got -1"),
        ((2, 5), {"pad_id": 5}, r"pad_id 5 is not the model's padding id \(config.pad_id 0\)"),
        ((2, 5), {"eos_id": 0}, r"padding id \(0\) must differ from the start \(1\) and end \(0\)"),
        ((2, 5), {"bos_id": 0}, r"padding id \(0\) must differ from the start \(0\) and end \(2\)"),
        ((2, 0), {}, r"src_BS must be \[batch, src_len\] with src_len >= 1, got shape \(2, 0\)"),
        ((5,), {}, r"src_BS must be \[batch, src_len\]"),
        (
            (2, 5),
            {"max_extra_len": -5},
            r"limit \(src_len 5 \+ max_extra_len -5\) must be at least 1, got 0",
        ),
        ((2, 5), {"max_len": 0}, r"\+ max_extra_len 50, at most max_len 0\) must be at least 1"),
    ],
)
def test_arguments_that_would_search_wrongly_are_errors(
    model_and_sources, src_shape, changes, message
):
    # Each ran before: an end id past the vocabulary never ended the search, a start id
    # past it gave NaN embeddings, another padding id counted padding into the length
    # limits, and the others failed deep inside with an index or shape error (a float
    # width or length: "Shapes must be 1D sequences of concrete values of integer type").
    # A negative id would embed the vocabulary's last piece, an end id that is the
    # padding id would never be generated, and a start id that is would be masked out.
    model, params, _ = model_and_sources
    src = jnp.full(src_shape, 3, jnp.int32)
    kwargs = {"bos_id": BOS, "eos_id": EOS, "pad_id": PAD, **changes}
    beam = kwargs.pop("beam_size", 2)
    with pytest.raises(ValueError, match=message):
        beam_search(model, params, src, beam_size=beam, **kwargs)
    if "beam_size" not in changes:
        with pytest.raises(ValueError, match=message):
            greedy_search(model, params, src, **kwargs)


def test_an_output_limit_of_one_token_is_searched(model_and_sources):
    # The least limit that is not an error: one token per sentence, from either search.
    model, params, src = model_and_sources
    ids = dict(bos_id=BOS, eos_id=EOS, pad_id=PAD)
    tokens, scores = beam_search(model, params, src, beam_size=2, max_len=1, **ids)
    greedy = greedy_search(model, params, src, max_len=1, **ids)
    assert tokens.shape == greedy.shape == (src.shape[0], 1)
    assert np.all(np.asarray(tokens) != PAD) and np.all(np.isfinite(np.asarray(scores)))


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"src": [[5, 6, 3]]}, r"src_BS must be an int array \[batch, src_len\], got list"),
        ({"src": jnp.ones((1, 3))}, r"src_BS must be an int array .* got dtype float32"),
        ({"bos_id": 1.0}, "bos_id must be an integer, got 1.0"),
        ({"eos_id": True}, "eos_id must be an integer token id, got True"),
        ({"pad_id": 0.0}, "pad_id must be an integer, got 0.0"),
        ({"alpha": None}, "alpha must be a real number >= 0, got None"),
        ({"alpha": "0.6"}, "alpha must be a real number >= 0, got '0.6'"),
        ({"alpha": -0.5}, "alpha must be a real number >= 0, got -0.5"),
        ({"alpha": float("nan")}, "alpha must be a real number >= 0, got nan"),
        ({"alpha": float("inf")}, "alpha must be a real number >= 0, got inf"),
    ],
)
def test_arguments_of_the_wrong_type_are_errors_naming_them(model_and_sources, changes, message):
    # A list of ids was "'list' object has no attribute 'ndim'", a float id or alpha None
    # an error deep inside JAX, and True was taken as the id 1. An infinite alpha would
    # score every output longer than one token 0, the best score, whatever its log P.
    model, params, _ = model_and_sources
    kwargs = {"bos_id": BOS, "eos_id": EOS, "pad_id": PAD, **changes}
    src = kwargs.pop("src", jnp.full((1, 3), 3, jnp.int32))
    with pytest.raises(ValueError, match=message):
        beam_search(model, params, src, beam_size=2, **kwargs)
    if "alpha" not in changes:
        with pytest.raises(ValueError, match=message):
            greedy_search(model, params, src, **kwargs)


def test_beam_of_one_is_greedy(model_and_sources):
    model, params, src = model_and_sources
    kw = dict(bos_id=BOS, eos_id=EOS, pad_id=PAD, max_extra_len=5)
    greedy = np.asarray(greedy_search(model, params, src, **kw))
    beam, _ = beam_search(model, params, src, beam_size=1, alpha=0.0, **kw)
    np.testing.assert_array_equal(np.asarray(beam), greedy)
    _assert_well_formed(greedy, np.asarray(src), 5)
    # The random model must exercise both endings: by the end token and by the length limit.
    assert (greedy == EOS).any(axis=1).any() and not (greedy == EOS).any(axis=1).all()


@pytest.mark.parametrize("seed", range(4))
def test_beam_of_one_is_greedy_when_the_end_token_is_probable_but_not_the_best(seed):
    # Barely trained models put the end token second at many steps; a beam of one
    # must not finish there (an early, even empty, output of higher log P than the
    # greedy one), as a search that finishes every end token did.
    model, params = _peaked_model(vocab_size=8, seed=seed, scale=1.0)
    src = _sources(8, [5, 2, 7, 3, 6, 4], seed=seed)
    kw = dict(bos_id=BOS, eos_id=EOS, pad_id=PAD, max_extra_len=6)
    greedy = np.asarray(greedy_search(model, params, src, **kw))
    beam, _ = beam_search(model, params, src, beam_size=1, alpha=0.0, **kw)
    np.testing.assert_array_equal(np.asarray(beam), greedy)


def _assert_cached_equals_uncached(model, params, src, score_rtol=1e-5):
    """Greedy and beam search give the same outputs and scores with and without the cache."""
    kw = dict(bos_id=BOS, eos_id=EOS, pad_id=PAD, max_extra_len=5)
    np.testing.assert_array_equal(
        greedy_search(model, params, src, **kw),
        greedy_search(model, params, src, use_cache=False, **kw),
    )
    cached, cached_scores = beam_search(model, params, src, beam_size=3, **kw)
    uncached, uncached_scores = beam_search(model, params, src, beam_size=3, use_cache=False, **kw)
    np.testing.assert_array_equal(cached, uncached)
    np.testing.assert_allclose(cached_scores, uncached_scores, rtol=score_rtol)
    _assert_well_formed(np.asarray(cached), np.asarray(src), 5)


def test_cached_equals_uncached(model_and_sources):
    _assert_cached_equals_uncached(*model_and_sources)


@pytest.mark.parametrize("encoder_layers, decoder_layers", [(3, 1), (1, 3)])
def test_cached_equals_uncached_with_unequal_stacks(encoder_layers, decoder_layers):
    # The cache holds one self-attention and one cross-attention entry per decoder layer,
    # so it must follow the decoder's depth, not the encoder's (deep-encoder models).
    model, params = _peaked_model(
        vocab_size=16, num_encoder_layers=encoder_layers, num_decoder_layers=decoder_layers
    )
    # Three decoder layers round differently in the two paths: measured 1.3e-5 relative
    # on one score of four (1+3), with the same tokens, and 3.3e-5 with XLA's optimizations
    # off (tests/conftest.py).
    _assert_cached_equals_uncached(model, params, _sources(16, [6, 3, 9, 4]), score_rtol=1e-4)


def test_beam_search_ignores_batch_neighbours(model_and_sources):
    """A sentence decodes the same alone as in a batch with longer, padded neighbours."""
    model, params, src = model_and_sources
    kw = dict(bos_id=BOS, eos_id=EOS, pad_id=PAD, max_extra_len=5, beam_size=3)
    batch_tokens, batch_scores = beam_search(model, params, src, **kw)
    alone = src[1:2, :3]  # sentence 1 has 3 real tokens
    alone_tokens, alone_scores = beam_search(model, params, alone, **kw)
    np.testing.assert_array_equal(alone_tokens[0], batch_tokens[1, : alone_tokens.shape[1]])
    assert np.all(np.asarray(batch_tokens[1, alone_tokens.shape[1] :]) == PAD)
    np.testing.assert_allclose(alone_scores[0], batch_scores[1], rtol=1e-5)


def _exhaustive_best(model, params, src, vocab_size: int, limits: list[int], alpha: float):
    """Scores every possible output of each sentence; returns its best tokens and score.

    The outputs of sentence b are every sequence of non-padding tokens that
    ends with its first end token within limits[b] tokens, plus every sequence
    of exactly limits[b] tokens without one (cut off by the limit), as in
    beam_search.
    """
    tokens = [t for t in range(vocab_size) if t != PAD]
    words = [t for t in tokens if t != EOS]
    best = []
    apply = jax.jit(model.apply)
    for b, limit in enumerate(limits):
        outputs = [
            (*prefix, EOS) for n in range(limit) for prefix in itertools.product(words, repeat=n)
        ]
        outputs += list(itertools.product(words, repeat=limit))
        tgt_out = np.full((len(outputs), limit), PAD, np.int32)
        for i, y in enumerate(outputs):
            tgt_out[i, : len(y)] = y
        tgt_in = np.concatenate([np.full((len(outputs), 1), BOS), tgt_out[:, :-1]], axis=1)
        tgt_in = np.where(tgt_in == EOS, PAD, tgt_in)  # nothing follows the end token
        src_b = jnp.repeat(src[b : b + 1], len(outputs), axis=0)
        logits = apply({"params": params}, src_b, jnp.asarray(tgt_in))
        logp = np.asarray(jax.nn.log_softmax(logits.at[..., PAD].set(-jnp.inf), axis=-1))
        token_logp = np.take_along_axis(logp, tgt_out[..., None], axis=-1)[..., 0]
        lengths = np.array([len(y) for y in outputs])
        real = np.arange(limit)[None, :] < lengths[:, None]
        # GNMT's length penalty, written out: the search must use this formula.
        scores = np.where(real, token_logp, 0.0).sum(axis=1) / ((5.0 + lengths) / 6.0) ** alpha
        i = int(np.argmax(scores))
        best.append((tgt_out[i], scores[i]))
    return best


def test_length_penalty_is_gnmts():
    # Wu et al. (2016), ((5 + |Y|) / 6) ** alpha; evaluate.py's alpha was tuned for it.
    lengths = np.array([1, 7, 30])
    for alpha in (0.0, 0.6, 1.25):
        np.testing.assert_allclose(
            length_penalty(lengths, alpha), ((5.0 + lengths) / 6.0) ** alpha, rtol=1e-6
        )
    assert float(length_penalty(7, 0.6)) == pytest.approx(2.0**0.6)


@pytest.mark.parametrize("alpha", [0.0, 0.6])
def test_full_width_beam_is_exhaustive_search(alpha):
    """With a beam holding every extension, beam search finds the exhaustive optimum.

    Vocabulary 6: padding (never generated), start, end and three words, so a
    prefix continues with 4 tokens (the start token may be generated) or ends.
    With an output limit of L tokens, the step before the last extends 4^(L-2)
    unfinished prefixes into 4^(L-1) longer ones and 4^(L-2) ended ones, so a
    beam of 5 * 4^(L-2) holds every extension at every step (every end token
    is among the beam's most probable extensions), and the search can only be
    exact if its early stop and its length-limit handling are. (A beam as wide
    as the vocabulary is exhaustive only up to L = 2.) Sentences get
    different limits (source length + max_extra_len) to check they are
    per sentence.
    """
    vocab_size, max_extra_len = 6, 2
    model, params = _peaked_model(vocab_size, seed=2, scale=1.0)
    src = _sources(vocab_size, [2, 1], seed=2)
    limits = [2 + max_extra_len, 1 + max_extra_len]
    beam_size = 5 * 4 ** (max(limits) - 2)
    tokens, scores = beam_search(
        model,
        params,
        src,
        bos_id=BOS,
        eos_id=EOS,
        pad_id=PAD,
        beam_size=beam_size,
        alpha=alpha,
        max_extra_len=max_extra_len,
    )
    exhaustive = _exhaustive_best(model, params, src, vocab_size, limits, alpha)
    for b, (best_tokens, best_score) in enumerate(exhaustive):
        np.testing.assert_array_equal(np.asarray(tokens[b, : limits[b]]), best_tokens)
        np.testing.assert_allclose(float(scores[b]), best_score, rtol=1e-5)
    # The optimum is off the greedy path for some sentence, so the search had to look ahead.
    greedy = greedy_search(model, params, src, bos_id=BOS, eos_id=EOS, max_extra_len=max_extra_len)
    assert any(
        not np.array_equal(np.asarray(greedy[b, : limits[b]]), best)
        for b, (best, _) in enumerate(exhaustive)
    )


class _Scripted(nn.Module):
    """A model without parameters whose next-token logits (vocabulary 5) depend only on
    the position or the input token: subclasses write them in `decode`."""

    def encode(self, src):
        return jnp.zeros((*src.shape, 1))

    def __call__(self, src, tgt):
        return self.decode(self.encode(src), src, tgt)


def _logits_of(p: np.ndarray) -> np.ndarray:
    """log p, and -1e9 (never) where p is 0."""
    return np.log(p, where=p > 0, out=np.full(p.shape, -1e9))


class _EndNowOrLater(_Scripted):
    """A decoder that ends at once with P 0.6, or takes word 3 (P 0.4) and then, surely,
    four more before ending: a longer output that the length penalty favours."""

    def decode(self, encoded, src, tgt, decode=False):
        position, token = jnp.arange(tgt.shape[1])[None, :, None], jnp.arange(5)[None, None]
        never = -1e9
        first = jnp.where(token == EOS, np.log(0.6), jnp.where(token == 3, np.log(0.4), never))
        then = jnp.where(token == 3, 0.0, never)
        last = jnp.where(token == EOS, 0.0, never)
        logits = jnp.where(position == 0, first, jnp.where(position < 5, then, last))
        return jnp.broadcast_to(logits, (*tgt.shape, 5))


@pytest.mark.parametrize("beam_size", [1, 4])
def test_the_early_stop_waits_for_outputs_the_length_penalty_may_favour(beam_size):
    # After step 1 the ended "</s>" scores log 0.6 = -0.51, and the alive "3" has log 0.4
    # = -0.92: divided by the penalty of its next length only, 1.36, it looks unable to
    # win (-0.67), but "3 3 3 3 3 </s>" scores -0.92 / 3.36 = -0.27. A bound that forgot
    # the longer lengths up to the limit stopped with "</s>" (the exhaustive search test
    # did not notice: its outputs are at most 4 tokens long).
    src = jnp.array([[3, 3, 2]], jnp.int32)
    tokens, scores = beam_search(
        _EndNowOrLater(), {}, src, bos_id=BOS, eos_id=EOS, pad_id=PAD,
        beam_size=beam_size, alpha=2.0, max_extra_len=7, use_cache=False,
    )  # fmt: skip
    assert np.asarray(tokens)[0, :6].tolist() == [3, 3, 3, 3, 3, EOS]
    expected = np.log(0.4) / ((5 + 6) / 6) ** 2
    assert float(scores[0]) == pytest.approx(expected, rel=1e-5)


class _EndOutranked(_Scripted):
    """A decoder whose end token is probable only at position 1: words 3 and 4 with P 0.6
    and 0.4 first, then 3, 4 and the end with 0.46, 0.44 and 0.1, then 3 and 4 with 0.52
    and 0.48 (the end never) up to the length limit."""

    P_PV = np.zeros((3, 5))  # P[position, token]; the last row holds from position 2 on
    P_PV[0, [3, 4]] = 0.6, 0.4
    P_PV[1, [3, 4, EOS]] = 0.46, 0.44, 0.1
    P_PV[2, [3, 4]] = 0.52, 0.48

    def decode(self, encoded, src, tgt, decode=False):
        logits_TV = jnp.asarray(_logits_of(self.P_PV))[jnp.minimum(jnp.arange(tgt.shape[1]), 2)]
        return jnp.broadcast_to(logits_TV, (*tgt.shape, 5))


def _beam_of_two(decoder: _Scripted) -> tuple[np.ndarray, np.ndarray]:
    """Beam 2, plain log P, up to 6 tokens, of a scripted decoder on a 3-token source."""
    src = jnp.array([[3, 3, 2]], jnp.int32)
    tokens, scores = beam_search(
        decoder, {}, src, bos_id=BOS, eos_id=EOS, pad_id=PAD,
        beam_size=2, alpha=0.0, max_extra_len=3, use_cache=False,
    )  # fmt: skip
    return np.asarray(tokens), np.asarray(scores)


def test_an_end_token_outranked_by_the_beam_does_not_finish():
    # Beam 2, plain log P. At step 2 the beams "3" (0.6) and "4" (0.4) extend to "3 3"
    # 0.276, "3 4" 0.264, "4 3" 0.184, "4 4" 0.176 and the ends "3 </s>" 0.06 and "4 </s>"
    # 0.04. "4 </s>" has the two kept extensions and "3 </s>" above it, so it ranks third
    # and does not finish (fairseq's rule), nor does "3 </s>" (third too): the search goes
    # on to the limit, 6 tokens, where "3 3 3 3 3 3" has 0.276 * 0.52^4 = 0.020. An end
    # token counted as finishing where the end tokens above it were subtracted from its
    # rank instead of added would end with "4 </s>" (0.04).
    tokens, scores = _beam_of_two(_EndOutranked())
    assert tokens[0, :6].tolist() == [3] * 6
    assert float(scores[0]) == pytest.approx(np.log(0.6 * 0.46 * 0.52**4), rel=1e-5)


class _EndsRanked(_Scripted):
    """A decoder whose next-token probabilities follow from its input token alone: after
    the start, words 3 and 4 with P 0.6 and 0.4; after 3, word 3 0.5, the end 0.45 and word
    4 0.05; after 4, the end 0.55, word 4 0.25 and word 3 0.2."""

    P_IV = np.zeros((5, 5))  # P[input token, next token]
    P_IV[BOS, [3, 4]] = 0.6, 0.4
    P_IV[3, [3, EOS, 4]] = 0.5, 0.45, 0.05
    P_IV[4, [EOS, 4, 3]] = 0.55, 0.25, 0.2

    def decode(self, encoded, src, tgt, decode=False):
        return jnp.asarray(_logits_of(self.P_IV))[tgt]


def test_an_end_token_finishes_where_it_ranks_within_the_beam_counting_ends_above_it():
    # Beam 2, plain log P. Step 2 ranks "3 3" 0.30, "3 </s>" 0.27, "4 </s>" 0.22, "4 4"
    # 0.10, ...: "3 </s>" is second and finishes; "4 </s>", with "3 3" and "3 </s>" above
    # it, is third and does not (fairseq's rule). No later output comes near 0.27
    # ("3 3 </s>" 0.135). A rank that counted the end tokens below an end token, or the
    # going extensions above another beam's, would finish "4 </s>" in place of "3 </s>".
    tokens, scores = _beam_of_two(_EndsRanked())
    assert tokens[0].tolist() == [3, EOS, PAD, PAD, PAD, PAD]
    assert float(scores[0]) == pytest.approx(np.log(0.6 * 0.45), rel=1e-5)


class _EndOnTheSecondBeam(_EndsRanked):
    """After the start, words 3 and 4 with P 0.6 and 0.4; after 3, word 3 0.8 and word 4
    0.2; after 4, the end 0.9 and word 4 0.1."""

    P_IV = np.zeros((5, 5))
    P_IV[BOS, [3, 4]] = 0.6, 0.4
    P_IV[3, [3, 4]] = 0.8, 0.2
    P_IV[4, [EOS, 4]] = 0.9, 0.1


def test_an_output_that_ends_on_another_beam_than_the_first_keeps_its_own_words():
    # Beam 2, plain log P. Step 2 ranks "3 3" 0.48, "4 </s>" 0.36, "3 4" 0.12: "4 </s>"
    # ends, on the second beam ("4"), and no later output comes near it (the search stops
    # at "3 3 3 3" 0.31). Its words are that beam's, not the first beam's "3" with the end
    # token (an output the model gives P 0).
    tokens, scores = _beam_of_two(_EndOnTheSecondBeam())
    assert tokens[0].tolist() == [4, EOS, PAD, PAD, PAD, PAD]
    assert float(scores[0]) == pytest.approx(np.log(0.4 * 0.9), rel=1e-5)


class _Successor(_Scripted):
    """A decoder whose next token follows from its input token alone: the start token
    is followed by word 3, 3 by 4, and 4 by the end token, each surely."""

    NEXT = {BOS: 3, 3: 4, 4: EOS}

    def decode(self, encoded, src, tgt, decode=False):
        logits_IV = np.full((5, 5), -1e9)
        for given, following in self.NEXT.items():
            logits_IV[given, following] = 0.0
        return jnp.asarray(logits_IV)[tgt]


@pytest.mark.parametrize("beam_size", [None, 1, 2])
def test_each_step_feeds_the_token_produced_just_before(beam_size):
    # The random models repeat one token ("5 5 5 5"), so a search that fed the token of
    # two steps back gave the same outputs and passed every test; here it would give
    # "3 4 4 4 4 4".
    src = jnp.array([[3, 3, 2]], jnp.int32)
    kw = dict(bos_id=BOS, eos_id=EOS, pad_id=PAD, max_extra_len=3, use_cache=False)
    if beam_size is None:
        tokens = greedy_search(_Successor(), {}, src, **kw)
    else:
        tokens, _ = beam_search(_Successor(), {}, src, beam_size=beam_size, alpha=0.6, **kw)
    assert np.asarray(tokens)[0].tolist() == [3, 4, EOS, PAD, PAD, PAD]


@pytest.mark.parametrize("beam_size", [None, 1, 2])
def test_a_search_stops_when_every_sentence_is_done_not_at_the_buffer_length(beam_size):
    # Both sentences end at step 3 with log P 0, which no longer output can beat. A search
    # that ran on to the 3 + 50 positions its outputs have room for gave the same tokens
    # in 53 decoder steps instead of 3 (uncached: one call of `decode` a step).
    steps = []

    class CountedSuccessor(_Successor):
        def decode(self, encoded, src, tgt, decode=False):
            jax.debug.callback(lambda: steps.append("step"))
            return super().decode(encoded, src, tgt, decode)

    src = jnp.array([[3, 3, 2], [4, 2, 0]], jnp.int32)
    kw = dict(bos_id=BOS, eos_id=EOS, pad_id=PAD, max_extra_len=50, use_cache=False)
    if beam_size is None:
        tokens = greedy_search(CountedSuccessor(), {}, src, **kw)
    else:
        tokens, _ = beam_search(CountedSuccessor(), {}, src, beam_size=beam_size, alpha=0.6, **kw)
    assert np.asarray(tokens)[:, :4].tolist() == [[3, 4, EOS, PAD]] * 2
    assert len(steps) == 3


class _PaddingFirst(_Scripted):
    """A decoder that puts padding first at every step, then word 4, and from position 3
    the end token between the two."""

    def decode(self, encoded, src, tgt, decode=False):
        position, token = jnp.arange(tgt.shape[1])[None, :, None], jnp.arange(5)[None, None]
        logits = jnp.where(token == PAD, 0.0, jnp.where(token == 4, -1.0, -1e9))
        logits = jnp.where((token == EOS) & (position >= 3), -0.5, logits)
        return jnp.broadcast_to(logits, (*tgt.shape, 5))


def test_no_search_outputs_padding_however_probable():
    # Greedy's argmax with padding allowed passed every test (the random models never put
    # it first): a barely trained model's outputs lost words, which translate_ids strips.
    src = jnp.array([[3, 3, 2]], jnp.int32)
    kw = dict(bos_id=BOS, eos_id=EOS, pad_id=PAD, max_extra_len=5, use_cache=False)
    greedy = greedy_search(_PaddingFirst(), {}, src, **kw)
    assert np.asarray(greedy)[0, :4].tolist() == [4, 4, 4, EOS]
    for beam_size in (1, 3):
        tokens, _ = beam_search(_PaddingFirst(), {}, src, beam_size=beam_size, alpha=0.0, **kw)
        assert np.asarray(tokens)[0, :4].tolist() == [4, 4, 4, EOS], beam_size


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks XLA:CPU's lowering")
@pytest.mark.usefixtures("full_optimization")  # the program as evaluation compiles it
def test_beam_search_top_k_is_not_a_full_sort(model_and_sources):
    """XLA:CPU must lower each step's top_k to its TopK call, not a sort of [batch, beams * vocab].

    A slice of the sorted scores fused into a later op once blocked that
    rewrite; with the 8000-piece vocabulary each step became ~6x slower.
    """
    model, params, src = model_and_sources
    compiled = beam_search.lower(
        model, params, src, bos_id=BOS, eos_id=EOS, pad_id=PAD, beam_size=4, max_extra_len=5
    ).compile()
    hlo = compiled.as_text()
    assert "TopK" in hlo
    assert " sort(" not in hlo


def test_a_sentence_allowed_no_token_gets_none():
    # An all-padding source with max_extra_len 0 has a limit of 0 tokens; both searches
    # wrote one token there before. The other sentence is unaffected.
    model, params = _peaked_model(vocab_size=16)
    src = jnp.concatenate([_sources(16, [3]), jnp.zeros((1, 3), jnp.int32)])
    kw = dict(bos_id=BOS, eos_id=EOS, pad_id=PAD, max_extra_len=0)
    greedy = np.asarray(greedy_search(model, params, src, **kw))
    beam, scores = beam_search(model, params, src, beam_size=3, alpha=0.6, **kw)
    assert (greedy[1] == PAD).all() and (np.asarray(beam)[1] == PAD).all()
    assert scores[1] == -np.inf and np.isfinite(scores[0])
    assert (greedy[0] != PAD).any() and (np.asarray(beam)[0] != PAD).any()


@pytest.mark.parametrize("limit", [1, 2])
def test_a_sentence_allowed_one_or_two_tokens_gets_them_cut_at_its_limit(limit):
    # An all-padding source's limit is max_extra_len; the successor decoder would go on
    # "3 4 </s>". A greedy search that started a limit of 1 done, as it starts a limit of
    # 0, passed every other test.
    src = jnp.zeros((1, 3), jnp.int32)
    kw = dict(bos_id=BOS, eos_id=EOS, pad_id=PAD, max_extra_len=limit, use_cache=False)
    greedy = greedy_search(_Successor(), {}, src, **kw)
    beam, _ = beam_search(_Successor(), {}, src, beam_size=2, alpha=0.6, **kw)
    expected = [3, 4][:limit] + [PAD] * 3  # [src_len + max_extra_len] tokens
    assert np.asarray(greedy)[0].tolist() == np.asarray(beam)[0].tolist() == expected


def test_both_searches_decode_with_the_cache_unless_told(monkeypatch, model_and_sources):
    # The cache is what keeps a step from recomputing the prefix and the cross-attention
    # keys and values; a default of use_cache=False would give the same outputs, slower.
    import transformer.decoding as decoding

    def recomputing(*args, **kwargs):
        raise AssertionError("the search recomputed the prefix")

    monkeypatch.setattr(decoding, "_uncached_decoder", recomputing)
    model, params, src = model_and_sources
    kw = dict(bos_id=BOS, eos_id=EOS, pad_id=PAD)
    assert greedy_search(model, params, src, **kw).shape[0] == src.shape[0]
    assert beam_search(model, params, src, **kw)[0].shape[0] == src.shape[0]
    with pytest.raises(AssertionError, match="recomputed"):
        greedy_search(model, params, src, use_cache=False, **kw)
