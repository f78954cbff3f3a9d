"""BLEU as papers on Multi30k report it: lowercased, Moses-tokenized text, multi-bleu.perl.

  python evaluate.py --workdir runs/m30k_en_de --split test2016 --output test2016.hyp.de
  pip install sacremoses
  python benchmarks/tokenized_bleu.py test2016.hyp.de ../shared/data/multi30k/test2016.de --lang de

Both files are prepared as the Multi30k literature prepares its data (lowercase, Moses
punctuation normalization, Moses tokenization with aggressive hyphen splitting, `-a`),
through sacremoses, and scored by sacreBLEU with no further tokenization and no
smoothing, which is multi-bleu.perl's corpus BLEU. It is for comparing with published
numbers only: the score to report is evaluate.py's (cased, detokenized, sacreBLEU's own
tokenization), since this one depends on the preprocessing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import sacrebleu  # noqa: E402

from data import DataError, read_aligned_lines  # noqa: E402


def moses_prepare(lines: list[str], lang: str) -> list[str]:
    """Lowercases, normalizes punctuation and tokenizes lines as the Multi30k papers do.

    Args:
      lines: detokenized sentences.
      lang: their language code, for Moses' language-specific rules.

    Returns:
      The sentences as space-separated lowercase tokens (hyphens split off as `@-@`).
    """
    from sacremoses import MosesPunctNormalizer, MosesTokenizer

    normalizer, tokenizer = MosesPunctNormalizer(lang=lang), MosesTokenizer(lang=lang)
    return [
        tokenizer.tokenize(
            normalizer.normalize(line.lower()),
            aggressive_dash_splits=True,
            escape=False,
            return_str=True,
        )
        for line in lines
    ]


def tokenized_bleu(hypotheses: list[str], references: list[str], lang: str) -> sacrebleu.BLEU:
    """multi-bleu.perl's BLEU of detokenized hypotheses after :func:`moses_prepare`.

    Returns:
      sacreBLEU's score object (`.score`, and its n-gram precisions when printed).
    """
    hyp, ref = moses_prepare(hypotheses, lang), moses_prepare(references, lang)
    return sacrebleu.corpus_bleu(hyp, [ref], tokenize="none", smooth_method="none", force=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("hypotheses", help="translations, one per line (evaluate.py --output)")
    p.add_argument("references", help="the raw reference file, aligned by line")
    p.add_argument("--lang", required=True, help="the language of both files, e.g. de")
    args = p.parse_args(argv)
    try:
        import sacremoses  # noqa: F401
    except ImportError:
        print("error: this needs sacremoses: pip install sacremoses", file=sys.stderr)
        return 2
    try:
        hyp, ref = read_aligned_lines(args.hypotheses, args.references)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not hyp:  # sacreBLEU fails on an empty corpus with an IndexError
        print(
            f"error: {args.hypotheses} and {args.references} are empty: nothing to score",
            file=sys.stderr,
        )
        return 2
    print(f"{tokenized_bleu(hyp, ref, args.lang)} (lowercased, Moses-tokenized -a, {args.lang})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
