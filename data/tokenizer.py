"""One joint SentencePiece model for source and target, trained once per run.

The special ids are fixed at training time and documented here, but every
other module reads them from the :class:`Tokenizer` object:

====  ======  =======================================
id    piece   use
====  ======  =======================================
0     <pad>   padding; attention and loss masks derive from it
1     <unk>   never produced for training text (byte fallback)
2     <s>     bos: first decoder input, ``tgt_in = [bos] + y``
3     </s>    eos: ends ``src = x + [eos]`` and ``tgt_out = y + [eos]``
====  ======  =======================================

Training is deterministic: no sentence sampling or shuffling and a single
trainer thread (SentencePiece's result depends on the thread count), so the
same corpus gives a byte-identical ``.model`` file on any machine. The model
normalizes nothing itself (``identity`` rule): :func:`data.normalize` has
already done it, so ``decode(encode(s)) == s`` for normalized ``s`` without U+2581
(SentencePiece's word-boundary mark, which decodes as a space).
Characters unseen in training are encoded as UTF-8 bytes (``byte_fallback``)
rather than ``<unk>``, so no input text is lost.
"""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import sentencepiece as spm

from data.errors import DataError
from data.text import write_atomically

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3  # set at training; read them from Tokenizer elsewhere
MODEL_TYPES = ("bpe", "unigram")
DEFAULT_VOCAB_SIZE = 6000  # joint en+de; train.py's default too (a test keeps them equal)
TOKENIZER_FILENAME = "tokenizer.model"
MAX_SENTENCE_BYTES = 1 << 16  # SentencePiece's training skips longer sentences


class Tokenizer:
    """A trained SentencePiece model with the pipeline's conventions.

    Attributes:
      path: the ``.model`` file it was loaded from.
      pad_id, unk_id, bos_id, eos_id: special ids, as stored in the model.
      vocab_size: number of pieces, specials included.
      model_type: ``"bpe"`` or ``"unigram"``.
      fingerprint: SHA-256 of the model file, a cache key for encoded data.
    """

    def __init__(self, model_bytes: bytes, path: str | os.PathLike | None = None):
        self.path = str(path) if path is not None else None
        if not model_bytes:  # SentencePiece takes it as a model with no pieces at all
            raise DataError(
                f"tokenizer {path or '(model bytes)'} is empty, not a SentencePiece model; "
                "delete it to train it again (train.py does, from the run's data)"
            )
        self._sp = spm.SentencePieceProcessor(model_proto=model_bytes)
        self.fingerprint = hashlib.sha256(model_bytes).hexdigest()
        self.pad_id, self.unk_id = self._sp.pad_id(), self._sp.unk_id()
        self.bos_id, self.eos_id = self._sp.bos_id(), self._sp.eos_id()
        self.vocab_size = self._sp.get_piece_size()
        from sentencepiece import sentencepiece_model_pb2 as model_pb2

        proto = model_pb2.ModelProto.FromString(model_bytes)
        self.model_type = model_pb2.TrainerSpec.ModelType.Name(
            proto.trainer_spec.model_type
        ).lower()
        if self.pad_id != 0:  # the model builds its masks from id 0
            raise DataError(
                f"tokenizer {path} has pad id {self.pad_id}, expected 0; "
                "retrain it with train_tokenizer"
            )

    @classmethod
    def load(cls, path: str | os.PathLike) -> Tokenizer:
        """Loads a ``.model`` file written by :func:`train_tokenizer`.

        Args:
          path: the model file.

        Returns:
          The tokenizer.

        Raises:
          DataError: the file is missing or is not a SentencePiece model.
        """
        try:
            model_bytes = Path(path).read_bytes()
        except OSError as e:
            raise DataError(f"cannot read tokenizer {path}: {e.strerror or e}") from None
        try:
            return cls(model_bytes, path)
        except DataError:
            raise
        # Any other error: damaged bytes can make SentencePiece raise RuntimeError,
        # UnicodeDecodeError (a piece that is not UTF-8) or protobuf's DecodeError.
        except Exception as e:
            raise DataError(
                f"{path} is not a SentencePiece model ({e}); delete it to train it again "
                "(train.py does, from the run's data)"
            ) from None

    def encode(self, text: str) -> list[int]:
        """Token ids of one sentence, without bos/eos.

        The text is encoded as given: callers pass sentences normalized with
        :func:`data.normalize` (corpora from :func:`data.load_corpus` and
        :func:`data.read_parallel` already are).

        Args:
          text: a normalized sentence.

        Returns:
          Token ids, each in ``[0, vocab_size)``; never pad, bos or eos.
        """
        return self._sp.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """:meth:`encode` for many sentences at once (one C++ call)."""
        return self._sp.encode(list(texts))

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        """Text of a token sequence, e.g. one row of decoder output.

        Args:
          ids: token ids; decoding stops at the first eos, and pad and bos
            are ignored.

        Returns:
          The detokenized sentence.
        """
        kept = []
        for i in np.asarray(ids, dtype=np.int64).reshape(-1).tolist():
            if i == self.eos_id:
                break
            if i != self.pad_id and i != self.bos_id:
                kept.append(i)
        return self._sp.decode(kept)

    def id_to_piece(self, i: int) -> str:
        """The vocabulary piece of id ``i`` (``"▁the"``, ``"<pad>"``, ``"<0xC3>"``)."""
        return self._sp.id_to_piece(int(i))

    def __repr__(self) -> str:
        return f"Tokenizer({self.path!r}, {self.model_type}, vocab_size={self.vocab_size})"


def train_tokenizer(
    texts: Sequence[str],
    path: str | os.PathLike,
    *,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    model_type: str = "bpe",
) -> Tokenizer:
    """Trains a SentencePiece model on ``texts`` and writes it to ``path``.

    Deterministic: the same texts and settings give a byte-identical file.

    Args:
      texts: normalized sentences, source and target together for a joint
        vocabulary.
      path: where to write the ``.model`` file (written atomically).
      vocab_size: number of pieces, including the 4 specials and 256 bytes.
      model_type: ``"bpe"`` (as in the paper; default) or ``"unigram"``.

    Returns:
      The trained tokenizer.

    Raises:
      DataError: bad settings, or a vocabulary too large for the texts.
    """
    if model_type not in MODEL_TYPES:
        raise DataError(
            f"unknown tokenizer model type {model_type!r}; choose one of {', '.join(MODEL_TYPES)}"
        )
    texts = [t for t in texts if t]
    if not texts:
        raise DataError("cannot train a tokenizer on an empty corpus")
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(texts),
            model_writer=model,
            vocab_size=vocab_size,
            model_type=model_type,
            pad_id=PAD_ID,
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            character_coverage=1.0,
            byte_fallback=True,
            normalization_rule_name="identity",
            # Every sentence, in order: sampling would make training non-deterministic.
            input_sentence_size=0,
            shuffle_input_sentence=False,
            max_sentence_length=MAX_SENTENCE_BYTES,
            num_threads=1,  # the trained model depends on the thread count
            minloglevel=2,
        )
    except RuntimeError as e:
        message = " ".join(str(e).split())
        if "Vocabulary size too high" in message or "Vocabulary size is too high" in message:
            advice = "too large for this corpus; choose a smaller vocab_size (--vocab-size)"
        elif "smaller than required_chars" in message:
            advice = (
                "too small for the characters of this corpus; "
                "choose a larger vocab_size (--vocab-size)"
            )
        elif all(len(t.encode("utf-8")) > MAX_SENTENCE_BYTES for t in texts):
            # SentencePiece skips such sentences without a word, then has none to train on.
            raise DataError(
                f"cannot train a tokenizer: every sentence of the training data is longer than "
                f"{MAX_SENTENCE_BYTES} bytes, which SentencePiece skips; split the lines into "
                "sentences"
            ) from None
        else:
            raise DataError(f"tokenizer training failed: {message}") from None
        raise DataError(f"vocabulary size {vocab_size} is {advice} ({message})") from None
    path = Path(path)
    # Through a temporary file that a failed write (a full disk) does not leave behind.
    write_atomically(path, lambda tmp: tmp.write_bytes(model.getvalue()))
    return Tokenizer(model.getvalue(), path)


def load_or_train_tokenizer(
    workdir: str | os.PathLike,
    corpus,
    *,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    model_type: str = "bpe",
) -> Tokenizer:
    """The run's tokenizer: ``workdir/tokenizer.model``, trained on first use.

    Training, evaluation and translation of one run therefore share exactly
    one model file.

    Args:
      workdir: the run directory.
      corpus: the training :class:`data.Corpus` (source and target sentences
        both feed the joint vocabulary).
      vocab_size: vocabulary size for a new model.
      model_type: ``"bpe"`` or ``"unigram"`` for a new model.

    Returns:
      The tokenizer.

    Raises:
      DataError: an existing model disagrees with ``vocab_size``/``model_type``.
    """
    path = Path(workdir) / TOKENIZER_FILENAME
    if path.is_file():
        tokenizer = Tokenizer.load(path)
        if (tokenizer.vocab_size, tokenizer.model_type) != (vocab_size, model_type):
            raise DataError(
                f"{path} is a {tokenizer.model_type} model of {tokenizer.vocab_size} pieces but "
                f"{model_type} with {vocab_size} was asked; "
                "use a new --workdir or the settings of this one"
            )
        return tokenizer
    return train_tokenizer(
        list(corpus.src) + list(corpus.tgt), path, vocab_size=vocab_size, model_type=model_type
    )
