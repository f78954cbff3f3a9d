"""train.py with BPE-dropout (Provilkov et al., 2020) as SentencePiece samples it.

  python benchmarks/bpe_dropout.py --copies 16 --alpha 0.1 --workdir runs/m30k_en_de_bpd \\
      --data-dir ../shared/data/multi30k --steps 11550 --no-progress

The experiment of benchmarks/EXPERIMENTS.md, not an option of train.py: the
training split becomes `--copies` copies of itself, each segmented by
SentencePiece's subword sampling (every merge skipped with probability
`--alpha`, both sides), so one pass over them is that many epochs with a fresh
segmentation each; validation keeps the deterministic segmentation, as
translation does. The copies are sampled once and cached in the workdir, so a
resume reads the same ones; but SentencePiece's sampling cannot be seeded per
call, so two fresh runs sample different copies. Every other flag is
train.py's; `--steps` fixes the compute, since sampled sentences are longer.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import sentencepiece as spm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import data  # noqa: E402
import train  # noqa: E402
from data.batching import encode_corpus  # noqa: E402  (train.py calls data.encode_corpus)
from transformer.compilation_cache import exit_process  # noqa: E402


class SamplingTokenizer:
    """A tokenizer whose `encode_batch` samples a segmentation (BPE-dropout)."""

    def __init__(self, tokenizer: data.Tokenizer, alpha: float):
        # The same model file through SentencePiece's own API, which samples.
        self._sp = spm.SentencePieceProcessor(model_file=str(tokenizer.path))
        self._alpha = alpha
        # encode_corpus keys its cache by the fingerprint: sampled ids never pass for plain ones.
        self.fingerprint = f"{tokenizer.fingerprint}-bpe-dropout-{alpha}"
        self.eos_id = tokenizer.eos_id

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._sp.encode(list(texts), enable_sampling=True, alpha=self._alpha, nbest_size=-1)


def encode_sampled_copies(
    tokenizer: data.Tokenizer, corpus: data.Corpus, copies: int, alpha: float, **kwargs
) -> data.EncodedCorpus:
    """`data.encode_corpus` of `copies` copies of `corpus`, each sampled anew.

    Args:
      tokenizer: the run's (BPE) tokenizer.
      corpus: the training split.
      copies: how many segmentations of every pair.
      alpha: BPE-dropout's probability of skipping a merge.
      **kwargs: `max_len` and `cache_dir`, as for `data.encode_corpus`.

    Returns:
      The pairs of every copy, copy after copy.
    """
    repeated = dataclasses.replace(corpus, src=corpus.src * copies, tgt=corpus.tgt * copies)
    return encode_corpus(SamplingTokenizer(tokenizer, alpha), repeated, **kwargs)


def length_ratios(
    tokenizer: data.Tokenizer, corpus: data.Corpus, alpha: float
) -> tuple[float, float]:
    """Tokens of one sampled segmentation of every sentence over those of the deterministic
    one, (source, target): how much longer sampling makes the split. Counted on every
    sentence, before --max-len drops any pair: the copies are no measure, as sampling
    makes more of them too long than it does of the plain split."""
    sampling = SamplingTokenizer(tokenizer, alpha)
    return tuple(
        sum(map(len, sampling.encode_batch(texts))) / sum(map(len, tokenizer.encode_batch(texts)))
        for texts in (corpus.src, corpus.tgt)
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="bpe_dropout.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Every other flag is train.py's (see python train.py --help).",
    )
    p.add_argument("--copies", type=int, default=16, help="segmentations of each pair [16]")
    p.add_argument("--alpha", type=float, default=0.1, help="merge-skip probability [0.1]")
    args, rest = p.parse_known_args(argv)
    if args.copies < 1 or not 0 < args.alpha < 1:
        p.error("--copies must be at least 1 and --alpha between 0 and 1")

    def encode(tokenizer, corpus, *, max_len=data.batching.DEFAULT_MAX_LEN, cache_dir=None):
        if max_len is None:  # validation (train.py never truncates it): deterministic
            return encode_corpus(tokenizer, corpus, max_len=max_len, cache_dir=cache_dir)
        if tokenizer.model_type != "bpe":  # unigram sampling is another method, alpha another knob
            raise data.DataError(
                f"BPE-dropout needs the BPE tokenizer; this run's is {tokenizer.model_type} "
                "(drop --tokenizer-type, or use another --workdir)"
            )
        sampled = encode_sampled_copies(
            tokenizer, corpus, args.copies, args.alpha, max_len=max_len, cache_dir=cache_dir
        )
        ratio = length_ratios(tokenizer, corpus, args.alpha)
        print(
            f"bpe-dropout: {args.copies} copies, alpha {args.alpha}: {len(sampled)} pairs; "
            f"tokens of a sampled segmentation of the split against the deterministic one: "
            f"source {ratio[0]:.3f}, target {ratio[1]:.3f}",
            flush=True,
        )
        return sampled

    data.encode_corpus = encode
    try:
        return train.main(rest)
    finally:
        data.encode_corpus = encode_corpus


if __name__ == "__main__":
    exit_process(main)
