"""Makes a small but real train.py workdir in seconds, for tests of evaluation and translation.

  python tests/make_tiny_workdir.py WORKDIR [--steps N] [--multi30k DIR]

or from a test: `make_tiny_workdir(tmp_path / "run", multi30k_dir, steps=2)`; tests also
damage a checkpoint of a workdir with `damage_checkpoint`. It writes
the first 300 train and 24 val lines of Multi30k en-de into WORKDIR/../tiny_data and
runs train.py on them with the tiny preset (vocabulary 400, max_len 64, one batch
shape, no validation), so the workdir has config.json, tokenizer.model,
metrics.jsonl and checkpoints at every 2 steps.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def tiny_train_flags(workdir: Path, data_dir: Path, steps: int) -> list[str]:
    """The train.py flags of a tiny run on a folder of {split}.{lang} files."""
    return [
        "--workdir", str(workdir), "--dataset", "files", "--data-dir", str(data_dir),
        "--preset", "tiny", "--vocab-size", "400", "--max-len", "64",
        "--max-tokens", "1024", "--max-shapes", "1", "--warmup-steps", "10",
        "--steps", str(steps), "--log-every", "1", "--checkpoint-every", "2",
        "--eval-every", "0", "--bleu-every", "0", "--no-progress",
    ]  # fmt: skip


def make_tiny_workdir(workdir: Path, multi30k_dir: Path, steps: int = 2) -> Path:
    """Trains `steps` steps of a tiny model into `workdir` (in this process) and returns it."""
    sys.path.insert(0, str(ROOT))
    import train

    workdir = Path(workdir)
    data_dir = workdir.parent / "tiny_data"
    data_dir.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", 300), ("val", 24)):
        for lang in ("en", "de"):
            lines = (Path(multi30k_dir) / f"{split}.{lang}").read_bytes().split(b"\n")[:n]
            (data_dir / f"{split}.{lang}").write_bytes(b"\n".join(lines) + b"\n")
    code = train.main(tiny_train_flags(workdir, data_dir, steps))
    if code != 0:
        raise RuntimeError(f"train.py exited with {code}")
    return workdir


def damage_checkpoint(step_dir: Path) -> None:
    """Overwrites every file of a checkpoint's parameters with garbage, as a torn write or
    a bad disk would leave them."""
    for f in (Path(step_dir) / "params").rglob("*"):
        if f.is_file():
            f.write_bytes(b"\x00garbage")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument(
        "--multi30k", type=Path, default=ROOT.parent / "shared" / "data" / "multi30k"
    )
    args = parser.parse_args()
    make_tiny_workdir(args.workdir, args.multi30k, args.steps)
