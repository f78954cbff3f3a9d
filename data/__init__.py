"""The input pipeline: parallel corpora in, bucketed token batches out.

Data flows one way::

    load_corpus / read_parallel      raw text -> normalized, cleaned Corpus
    load_or_train_tokenizer          one joint SentencePiece model per run
    encode_corpus                    Corpus -> token ids (cached on disk;
                                     prune_encoded_cache drops stale ones)
    TokenBatcher / prefetch          ids -> [devices, batch, length] training batches
    inference_batches                ids -> whole-sentence evaluation batches
    Tokenizer.decode                 ids -> text (for sacreBLEU)
"""

from data.batching import (
    DEFAULT_MAX_LEN,
    EncodedCorpus,
    TokenBatcher,
    choose_bucket_shapes,
    encode_corpus,
    encoded_cache_file,
    inference_batches,
    prune_encoded_cache,
)
from data.errors import DataError, MissingSplitError
from data.prefetch import Prefetcher, prefetch
from data.sources import CleaningSummary, Corpus, CorpusSpec, load_corpus, read_parallel
from data.text import decode_lines, normalize, read_aligned_lines, read_lines
from data.tokenizer import (
    DEFAULT_VOCAB_SIZE,
    Tokenizer,
    load_or_train_tokenizer,
    train_tokenizer,
)

__all__ = [
    "DEFAULT_MAX_LEN",
    "DEFAULT_VOCAB_SIZE",
    "CleaningSummary",
    "Corpus",
    "CorpusSpec",
    "DataError",
    "EncodedCorpus",
    "MissingSplitError",
    "Prefetcher",
    "TokenBatcher",
    "Tokenizer",
    "choose_bucket_shapes",
    "encode_corpus",
    "encoded_cache_file",
    "inference_batches",
    "load_corpus",
    "load_or_train_tokenizer",
    "decode_lines",
    "normalize",
    "prune_encoded_cache",
    "prefetch",
    "read_aligned_lines",
    "read_lines",
    "read_parallel",
    "train_tokenizer",
]
