"""Trains a Transformer translation model into a workdir, resuming from its latest checkpoint.

  python train.py                    # Multi30k en->de, the "mini" model, in runs/multi30k_en_de
  python train.py --workdir runs/x --dataset files --data-dir DIR --src fr --tgt en
  python train.py                    # again: resumes where it stopped

Everything evaluation needs lands in the workdir: config.json (model, data and
training settings, and the code revision and package versions of every start),
tokenizer.model, checkpoints/, metrics.jsonl and TensorBoard event files.
Rerunning with the same --workdir resumes with the saved settings; flags given
again may change the training schedule (e.g. more --steps) and where the data is
read from (--data-dir, where it has moved), but not the model or the data.

Exit status: 0 when done or interrupted (SIGINT, SIGTERM or SIGHUP save a
checkpoint first), 1 when the loss became non-finite, memory ran out, or a write
or other system call failed (a full disk, a --workdir name too long), 2 for bad
flags, data or workdir, 128 + the signal (130, 143, 129) when stopped before
training started.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import math
import os
import re
import shutil
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where used, so that --help starts fast
    from transformer import TransformerConfig
    from transformer.training import TrainConfig, TrainResult

# Flag name -> (TransformerConfig field, type, help).
MODEL_FLAGS = {
    "d_model": (int, "width of embeddings and every residual stream"),
    "num_heads": (int, "attention heads"),
    "d_ff": (int, "inner width of the feed-forward networks"),
    "num_encoder_layers": (int, "encoder layers N"),
    "num_decoder_layers": (int, "decoder layers N"),
    "dropout_rate": (float, "dropout on sub-layer outputs and embeddings"),
    "attention_dropout_rate": (float, "dropout on attention weights"),
    "max_len": (int, "longest pair in tokens; longer training pairs are dropped (and counted)"),
}
# TransformerConfig's on/off fields, as --name / --no-name.
MODEL_SWITCHES = {
    "share_embeddings": "one matrix for source/target embeddings and the output projection [on]",
    "attention_bias": "biases on the attention projections W^Q, W^K, W^V, W^O; "
    "the paper has none [on]",
    "pre_layer_norm": "pre-LN residual blocks instead of the paper's post-LN [off]",
}
# Training flag -> TrainConfig field, when the names differ.
TRAIN_FIELDS = {
    "lr_scale": "learning_rate_scale",
    "clip_grad_norm": "grad_clip_norm",
}
DATA_FIELDS = (
    "dataset",
    "data_dir",
    "tfds_name",
    "tfds_data_dir",
    "src",
    "tgt",
    "vocab_size",
    "tokenizer_type",
    "max_tokens",
    "max_shapes",
)
DEFAULT_PRESET = "mini"
CACHE_DIR = "cache"  # the workdir's tokenized splits
# Multi30k-sized defaults; the paper's WMT recipe used warmup 4000 and 25k-token batches.
DATA_DEFAULTS = {
    "dataset": "multi30k",
    "data_dir": None,
    "tfds_name": None,
    "tfds_data_dir": None,
    "src": "en",
    "tgt": "de",
    "vocab_size": 6000,  # against 8000: the higher mean val BLEU of the two directions (README)
    "tokenizer_type": "bpe",
    "max_tokens": 2048,
    "max_shapes": 12,
}
TRAIN_DEFAULTS = {
    "epochs": 21,
    "warmup_steps": 1600,
    "learning_rate_scale": 1.0,  # against 0.7: the higher mean en->de val BLEU over seeds (README)
    "cooldown": 0.2,
    "cooldown_shape": "linear",
    "weight_decay": 0.1,  # against plain Adam's 0: higher en->de val BLEU in two seeds (README)
    "log_every": 50,
    "eval_every": 1000,
    "bleu_every": 1000,
    "checkpoint_every": 500,
    "keep_checkpoints": 5,
}


class _Parser(argparse.ArgumentParser):
    """argparse, with a mistyped or missing flag as one line instead of the whole usage."""

    def error(self, message: str):
        self.exit(2, f"error: {message}; {self.prog} --help lists the flags\n")


class UsageError(Exception):
    """A bad flag combination; str() is one line."""


def build_parser() -> argparse.ArgumentParser:
    """The command line; every flag is documented in --help."""
    p = _Parser(
        prog="train.py",
        description=(
            "Train the 'Attention Is All You Need' Transformer (data-parallel over all local "
            "devices) into --workdir (runs/CORPUS_SRC_TGT by default). Rerun the same command "
            "to resume."
        ),
        epilog=(
            "Flags left out take the workdir's saved settings when resuming, else the defaults "
            "shown. Exit status: 0 done or interrupted, 1 non-finite loss, out of memory or a "
            "failed write or system call, 2 bad input, 130, 143 or 129 stopped before training."
        ),
        # Defaults are written into each help as [value]: a left-out flag takes the
        # workdir's saved setting when resuming, so argparse's own defaults are all None.
        argument_default=None,
    )
    p.add_argument(
        "--workdir",
        help="run directory (created; resumed if present) [runs/CORPUS_SRC_TGT, e.g. "
        "runs/multi30k_en_de]",
    )

    d = p.add_argument_group("data")
    d.add_argument(
        "--dataset",
        choices=["multi30k", "files", "tfds"],
        help="corpus source [multi30k]: Multi30k (downloaded once, or from --data-dir), a "
        "folder of {split}.{lang} files, or a TFDS dataset",
    )
    d.add_argument(
        "--data-dir",
        help="folder of {split}.{lang} files: train and val (evaluate.py --split reads the "
        "others, e.g. test2016) [none: Multi30k is downloaded]",
    )
    d.add_argument("--tfds-name", help="TFDS dataset, e.g. wmt14_translate/de-en")
    d.add_argument("--tfds-data-dir", help="TFDS data directory [TFDS default]")
    d.add_argument("--src", help="source language code [en]")
    d.add_argument("--tgt", help="target language code [de]")
    d.add_argument(
        "--vocab-size",
        type=int,
        help=f"joint SentencePiece vocabulary size [{DATA_DEFAULTS['vocab_size']}]",
    )
    d.add_argument(
        "--tokenizer-type", choices=["bpe", "unigram"], help="SentencePiece model type [bpe]"
    )
    d.add_argument(
        "--max-tokens",
        type=int,
        help="padded source+target tokens per global step, all devices together "
        f"[{DATA_DEFAULTS['max_tokens']}]",
    )
    d.add_argument(
        "--max-shapes",
        type=int,
        help="most distinct batch shapes (compiled step programs) [12]",
    )

    m = p.add_argument_group("model (TransformerConfig)")
    m.add_argument("--preset", help=f"base model: tiny, mini, small, base, big [{DEFAULT_PRESET}]")
    for name, (kind, text) in MODEL_FLAGS.items():
        m.add_argument("--" + name.replace("_", "-"), type=kind, help=f"{text} [from --preset]")
    for name, text in MODEL_SWITCHES.items():
        m.add_argument(
            "--" + name.replace("_", "-"), action=argparse.BooleanOptionalAction, help=text
        )
    m.add_argument("--dtype", choices=["float32", "bfloat16"], help="compute dtype [float32]")
    m.add_argument(
        "--matmul-dtype",
        choices=["float32", "bfloat16"],
        help="round every matmul's operands to this dtype, accumulating in float32 "
        "(bfloat16: faster on CPUs with AMX or AVX512-BF16) [--dtype]",
    )

    t = p.add_argument_group("training (TrainConfig)")
    length = t.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, help="optimizer updates in total")
    length.add_argument(
        "--epochs", type=int, help=f"passes over the training data [{TRAIN_DEFAULTS['epochs']}]"
    )
    t.add_argument(
        "--warmup-steps",
        type=int,
        help=f"learning-rate warmup steps [{TRAIN_DEFAULTS['warmup_steps']}]",
    )
    t.add_argument(
        "--lr-scale",
        type=float,
        help="factor on d_model^-0.5 * min(step^-0.5, ...) "
        f"[{TRAIN_DEFAULTS['learning_rate_scale']}]",
    )
    t.add_argument(
        "--cooldown",
        type=float,
        help="fraction of the steps, at the end, where the learning rate falls to 0 "
        f"[{TRAIN_DEFAULTS['cooldown']}]",
    )
    t.add_argument(
        "--cooldown-shape",
        choices=["linear", "sqrt"],
        help="the fall: linear, or sqrt (factor 1 - sqrt(x) at a fraction x of the "
        f"cooldown) [{TRAIN_DEFAULTS['cooldown_shape']}]",
    )
    t.add_argument("--label-smoothing", type=float, help="epsilon_ls [0.1]")
    t.add_argument(
        "--clip-grad-norm",
        type=float,
        help="clip the global gradient norm to this; 0 turns clipping off, on a resume too [off]",
    )
    t.add_argument(
        "--weight-decay",
        type=float,
        help="decoupled weight decay of the matrices (AdamW): each update also subtracts "
        "learning rate * this * the weight; 0 is plain Adam, as in the paper "
        f"[{TRAIN_DEFAULTS['weight_decay']}]",
    )
    t.add_argument("--adam-b1", type=float, help="Adam beta1 [0.9]")
    t.add_argument("--adam-b2", type=float, help="Adam beta2 [0.98]")
    t.add_argument("--adam-eps", type=float, help="Adam epsilon [1e-9]")
    t.add_argument("--seed", type=int, help="initialization, dropout and shuffling seed [0]")
    t.add_argument(
        "--log-every", type=int, help=f"steps between metric lines [{TRAIN_DEFAULTS['log_every']}]"
    )
    t.add_argument(
        "--eval-every",
        type=int,
        help=f"steps between validation losses; 0 off [{TRAIN_DEFAULTS['eval_every']}]",
    )
    t.add_argument(
        "--bleu-every",
        type=int,
        help=f"steps between validation BLEU (greedy); 0 off [{TRAIN_DEFAULTS['bleu_every']}]",
    )
    t.add_argument("--bleu-max-tokens", type=int, help="tokens per BLEU decoding batch [4096]")
    t.add_argument(
        "--bleu-max-sentences", type=int, help="score only the first N validation lines [all]"
    )
    t.add_argument(
        "--checkpoint-every",
        type=int,
        help=f"steps between checkpoints [{TRAIN_DEFAULTS['checkpoint_every']}]",
    )
    t.add_argument(
        "--keep-checkpoints",
        type=int,
        help="recent checkpoints kept, plus the best by BLEU "
        f"[{TRAIN_DEFAULTS['keep_checkpoints']}]",
    )

    o = p.add_argument_group("output and multi-host")
    o.add_argument(
        "--no-progress",
        action="store_true",
        help="a line every --log-every steps, not a progress bar (the default where stderr "
        "is not a terminal: a log file)",
    )
    cache = o.add_mutually_exclusive_group()
    cache.add_argument(
        "--compilation-cache",
        metavar="DIR",
        help="where compiled programs are kept for later runs and resumes to load "
        "[$JAX_COMPILATION_CACHE_DIR, else $TRANSFORMER_MT_CACHE/xla or "
        "~/.cache/transformer-mt/xla]",
    )
    cache.add_argument(
        "--no-compilation-cache",
        action="store_true",
        help="compile every program afresh and keep none",
    )
    o.add_argument(
        "--coordinator-address",
        help="host:port of process 0; starts jax.distributed for a multi-host run "
        "(also JAX_COORDINATOR_ADDRESS, or auto-detected with --num-processes)",
    )
    o.add_argument("--num-processes", type=int, help="hosts in a multi-host run")
    o.add_argument("--process-id", type=int, help="this host's index in a multi-host run")
    return p


def given(args: argparse.Namespace, *names: str) -> dict[str, Any]:
    """The flags among `names` that were given on the command line."""
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def _changed(
    saved: dict[str, Any], wanted: dict[str, Any], ignore: tuple[str, ...] = ()
) -> list[str]:
    """The settings, in order, whose values differ between `saved` and `wanted`."""
    names = sorted((set(saved) | set(wanted)) - set(ignore))
    return [k for k in names if saved.get(k) != wanted.get(k)]


def _differences(
    saved: dict[str, Any], wanted: dict[str, Any], ignore: tuple[str, ...] = ()
) -> list[str]:
    return [
        f"{_setting(k)} {saved.get(k)!r} there, {wanted.get(k)!r} now"
        for k in _changed(saved, wanted, ignore)
    ]


def _setting(field: str) -> str:
    """A config field as the user sets it: its flag (--d-model), or the field's own name
    where no flag sets it (pad_id, which the tokenizer gives)."""
    flags = {flag for action in build_parser()._actions for flag in action.option_strings}
    return _flag(field) if _flag(field) in flags else field


def _flag(field: str) -> str:
    """The flag that sets a config field (learning_rate_scale: --lr-scale)."""
    flag_of = {name: flag for flag, name in TRAIN_FIELDS.items()}
    return "--" + flag_of.get(field, field).replace("_", "-")


# Where the data is read from, not what it is: a run whose checkpoints were trained on data
# that has moved resumes from the new place, since the data iterator refuses to resume on
# training data other than its checkpoint's (`TokenBatcher.restore`).
DATA_LOCATIONS = ("data_dir", "tfds_data_dir")


def resumed_changes(saved: dict[str, Any], train_cfg, data_cfg: dict[str, Any]) -> list[str]:
    """What a resume changes of the run's saved settings, as "--flag old -> new": its
    training settings (a larger --steps, say) and where its data is read from."""
    saved_data = saved.get("data") or {}
    # A setting newer than the run's config.json had, there, the value that kept its training.
    defaults = {f.name: f.default for f in dataclasses.fields(train_cfg)}
    changes = []
    for there, now in (
        (defaults | (saved.get("train") or {}), train_cfg.to_dict()),
        (
            {k: saved_data.get(k) for k in DATA_LOCATIONS},
            {k: data_cfg.get(k) for k in DATA_LOCATIONS},
        ),
    ):
        changes += [
            f"{_flag(k)} {_shown(k, there.get(k))} -> {_shown(k, now.get(k))}"
            for k in _changed(there, now)
        ]
    return changes


def _shown(field: str, value: Any) -> Any:
    """A setting's value as resumed_changes writes it: no gradient clipping is "off"."""
    return "off" if field == "grad_clip_norm" and value is None else value


def default_workdir(args: argparse.Namespace) -> Path:
    """runs/CORPUS_SRC_TGT from the data flags and defaults, e.g. runs/multi30k_en_de.

    CORPUS is "multi30k", the --data-dir folder's name for --dataset files, or the TFDS
    dataset's name, so the same flags again find the same run (and resume it).
    """
    settings = data_settings(args, None)
    corpus = settings["dataset"]
    if corpus == "files" and settings["data_dir"]:
        corpus = Path(settings["data_dir"]).name
    elif corpus == "tfds" and settings["tfds_name"]:
        corpus = settings["tfds_name"].split("/")[0].split(":")[0]
    return Path("runs") / f"{corpus}_{settings['src']}_{settings['tgt']}"


def data_settings(args: argparse.Namespace, saved: dict[str, Any] | None) -> dict[str, Any]:
    """The "data" section: saved settings (or defaults) with the given flags on top."""
    settings = {**DATA_DEFAULTS, **((saved or {}).get("data") or {})}
    flags = given(args, *DATA_FIELDS)
    if "data_dir" in flags:
        flags["data_dir"] = str(Path(flags["data_dir"]).resolve())
    if "tfds_data_dir" in flags:
        flags["tfds_data_dir"] = str(Path(flags["tfds_data_dir"]).resolve())
    for name in ("vocab_size", "max_tokens", "max_shapes"):
        if name in flags and flags[name] < 1:
            flag = _flag(name)
            raise UsageError(f"bad data settings: {flag} must be >= 1, got {flags[name]}")
    settings.update(flags)
    return settings


def check_preset(args: argparse.Namespace) -> None:
    """A --preset that names no preset is a usage error, before anything uses it."""
    from transformer import TransformerConfig

    if args.preset is not None:
        try:
            TransformerConfig.check_preset_name(args.preset)
        except ValueError as e:
            raise UsageError(f"--preset: {e}") from None


def model_config(
    args: argparse.Namespace, saved: dict[str, Any] | None, vocab_size: int, pad_id: int
):
    """The TransformerConfig: the saved one (resume) or a preset, with flag overrides."""
    from transformer import TransformerConfig

    overrides = given(args, *MODEL_FLAGS, *MODEL_SWITCHES, "dtype", "matmul_dtype")
    overrides.update(vocab_size=vocab_size, pad_id=pad_id)
    try:
        if saved is not None and args.preset is None:
            return TransformerConfig.from_dict(saved["model"]).replace(**overrides)
        return TransformerConfig.preset(args.preset or DEFAULT_PRESET, **overrides)
    except ValueError as e:
        raise UsageError(f"bad model settings: {_in_flag_words(e, TransformerConfig)}") from None
    except TypeError as e:  # a saved model section without its fields
        raise UsageError(
            f"the workdir's config.json has incomplete model settings ({e}); it was edited "
            "or damaged: restore the one its run wrote"
        ) from None


def train_config(args: argparse.Namespace, saved: dict[str, Any] | None):
    """The TrainConfig: saved (resume) or defaults, with the given flags on top."""
    from transformer.training import TrainConfig

    settings = dict((saved or {}).get("train") or TRAIN_DEFAULTS)
    names = [f.name for f in dataclasses.fields(TrainConfig)] + list(TRAIN_FIELDS)
    flags = {TRAIN_FIELDS.get(k, k): v for k, v in given(args, *names).items()}
    if "grad_clip_norm" in flags:
        norm = flags["grad_clip_norm"]
        if not 0 <= norm < math.inf:  # NaN fails too
            raise UsageError(
                f"--clip-grad-norm must be a finite number > 0, or 0 to turn clipping off; "
                f"got {norm}"
            )
        flags["grad_clip_norm"] = norm or None  # 0: off, where a resumed run had it on
    if "steps" in flags:
        settings["epochs"] = None
    if "epochs" in flags:
        settings["steps"] = None
    settings.update(flags)
    try:
        return TrainConfig(**settings)
    except (TypeError, ValueError) as e:
        raise UsageError(f"bad training settings: {_in_flag_words(e, TrainConfig)}") from None


def _in_flag_words(error: Exception, config_class: type) -> str:
    """A config error's message with its fields named as flags (learning_rate_scale: --lr-scale)."""
    fields = [f.name for f in dataclasses.fields(config_class)]
    return re.sub(rf"\b({'|'.join(fields)})\b", lambda m: _flag(m[1]), str(error))


def check_resume_matches(
    workdir: Path, saved: dict[str, Any], section: str, now: dict, preset: str | None = None
) -> None:
    """Raises a one-line error if a resumed run asks for another model or data setup;
    `preset`: the --preset given, whose values the model flags left out take."""
    from transformer.checkpoints import CheckpointError, checkpoint_steps

    ignore = DATA_LOCATIONS if section == "data" else ()
    diffs = _differences(saved.get(section) or {}, now, ignore)
    if diffs and checkpoint_steps(workdir):
        flags = "those flags" if preset is None else f"--preset {preset} and those flags"
        raise CheckpointError(
            f"{workdir} holds a run with other {section} settings ({'; '.join(diffs)}); "
            f"leave {flags} out to resume it, or train into a new --workdir"
        )


def forget_unchecked_tokenizer(
    workdir: Path, saved: dict[str, Any] | None, data_cfg: dict, log, main_process: bool
) -> Path | None:
    """Moves aside a workdir's tokenizer that nothing ties to these data settings.

    A run that was killed between training its tokenizer and its first checkpoint
    leaves `tokenizer.model` with no run config, or with a config of other data
    settings that `check_resume_matches` lets go (no checkpoint depends on them);
    reusing it would tokenize this corpus with another's vocabulary, so it becomes
    `tokenizer.model.old` (`.old.2`, ... where that is taken).

    Returns:
      Where it was moved, or None if it was not.
    """
    import orbax.checkpoint as ocp

    from data.tokenizer import TOKENIZER_FILENAME
    from transformer.checkpoints import checkpoint_steps, name_aside

    path = workdir / TOKENIZER_FILENAME
    aside = None
    # Checkpoints tie it to their training data, wherever that is now.
    ignore = DATA_LOCATIONS if checkpoint_steps(workdir) else ()
    if path.is_file() and (
        saved is None or _differences(saved.get("data") or {}, data_cfg, ignore)
    ):
        aside = name_aside(path, "old")
        log(f"{path} is not from a run with these data settings: moved to {aside.name}")
    # Every process looks before process 0 moves it: one that looked later would not find
    # it, or log the next free name.
    ocp.multihost.sync_global_processes("tokenizer_looked")
    if aside is not None and main_process:
        path.replace(aside)
    # On a shared workdir no process reads the tokenizer before it is moved (the barrier
    # is a no-op on one host); one that did would tokenize with the stale vocabulary.
    ocp.multihost.sync_global_processes("tokenizer_checked")
    return aside


def folders_to_make(workdir: Path) -> list[Path]:
    """The folders that do not exist yet on the way to `workdir` (it included), innermost
    first: what a run that makes it should remove again if it leaves them empty."""
    made = []
    folder = workdir.absolute()
    while not folder.exists() and folder != folder.parent:
        made.append(folder)
        folder = folder.parent
    return made


def remove_while_empty(folders: list[Path]) -> None:
    """Removes `folders` in order (innermost first) up to the first that is not empty."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:  # not empty: something else wrote there
            break


LOCK_FILE = "train.lock"


# OSErrors of the system, not of the flags or files the user gave: exit 1, as in training.
SYSTEM_ERRNOS = frozenset(
    getattr(errno, name)
    for name in ("ENOSPC", "EDQUOT", "EIO", "ENOMEM", "EMFILE", "ENFILE", "ENAMETOOLONG")
    if hasattr(errno, name)
)


def setup_error(error: OSError) -> Exception:
    """What an OSError while the workdir and the data are set up ends the run with: a
    UsageError (exit 2) for the user's setup, such as a folder that cannot be written or
    a data file that cannot be read, and the OSError itself (exit 1, as in training) for
    the system's, such as a full disk."""
    from data.errors import os_error_line

    if error.errno in SYSTEM_ERRNOS:
        return error
    return UsageError(os_error_line(error))


def _open_and_lock(path: Path, workdir: Path, fcntl: Any):
    """`path` opened and locked with `flock` (unlocked, with a warning, where the file
    system has no locks); a UsageError naming the process that holds it."""
    while True:
        try:
            lock = open(path, "a+", encoding="utf-8")
        except OSError as e:  # a folder that cannot be written
            raise setup_error(e) from None
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "unknown"
            lock.close()
            raise UsageError(
                f"another train.py (process {holder}) is training in {workdir}; let it finish "
                "or stop it (Ctrl-C saves a checkpoint), or use another --workdir"
            ) from None
        except OSError as e:  # a file system without locks (some network ones): train anyway
            print(
                f"warning: cannot lock {path} ({e.strerror}); nothing stops a second run "
                "in this workdir",
                file=sys.stderr,
            )
            return lock
        # A run that ends unlinks its file: one opened just before that is locked in vain,
        # since the next run opens a new file. Lock the file that is there now.
        with contextlib.suppress(OSError):
            if os.path.samestat(os.fstat(lock.fileno()), os.stat(path)):
                return lock
        lock.close()


@contextlib.contextmanager
def workdir_locked(workdir: Path, enabled: bool = True):
    """Holds an exclusive lock on the workdir while the run uses it, so that a second
    train.py started in the same workdir stops with an error instead of training over
    the first one's checkpoints, tokenizer and logs.

    The lock is `flock` on `LOCK_FILE` in the workdir, which holds the pid of the run;
    the kernel releases it when the process ends, however it ends, so a killed run's
    file does not block the next. The file (and the workdir, if this made it and it is
    empty again) is removed when the run ends. Where `fcntl` is missing (Windows) the
    run goes on without a lock.
    """

    try:
        import fcntl
    except ImportError:
        fcntl = None
    if not enabled or fcntl is None:
        yield
        return
    made = folders_to_make(workdir)
    path = workdir / LOCK_FILE
    if workdir.is_symlink() and not workdir.exists():  # mkdir says only "File exists"
        raise UsageError(
            f"--workdir {workdir} is a link to {os.readlink(workdir)}, which is not there: "
            "make or mount it, or use another --workdir"
        )
    try:
        workdir.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a --workdir under a file, or in a folder that cannot be written
        raise setup_error(e) from None
    lock = _open_and_lock(path, workdir, fcntl)
    with lock:
        lock.seek(0)
        lock.truncate()
        lock.write(f"{os.getpid()}\n")
        lock.flush()
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                path.unlink()
            remove_while_empty(made)


@contextlib.contextmanager
def removed_if_stopped_before_training(
    workdir: Path, main_process: bool, training: threading.Event, moved_aside: Path | None
):
    """Takes back what the run wrote into the workdir if it ends before training starts.

    Loading trains `tokenizer.model` and fills `cache/`, and the checkpoint manager
    makes `checkpoints/`, before the run can find, say, that no pair is short enough
    to train on, or sees a stop request; such a run should leave the workdir as it
    found it. Only what was not there before is removed (and the workdir and the
    folders above it that this run made, where empty again), so a resume's files
    are never touched, and nothing is once `training` is set. `moved_aside`, the
    tokenizer that `forget_unchecked_tokenizer` moved aside, if any, is put back. A
    second Ctrl-C while that is done is ignored, so that it is done whole.
    """
    from data.tokenizer import TOKENIZER_FILENAME
    from transformer.checkpoints import checkpoint_dir

    made = folders_to_make(workdir)
    paths = (workdir / TOKENIZER_FILENAME, workdir / CACHE_DIR, checkpoint_dir(workdir))
    new = [path for path in paths if not path.exists()]
    try:
        yield
    except BaseException:
        if main_process and not training.is_set():
            # Best effort, so that the error that ended the run is the one reported; a
            # second Ctrl-C must not cut it short and leave the stray tokenizer aside.
            with sigint_ignored():
                _take_back(new, made, moved_aside, workdir / TOKENIZER_FILENAME)
        raise


def _take_back(new: list[Path], made: list[Path], moved_aside: Path | None, tokenizer: Path):
    """Removes the `new` paths and the `made` folders, where empty, and puts the
    tokenizer moved aside back at `tokenizer`."""
    for path in new:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        elif path.exists():
            with contextlib.suppress(OSError):
                path.unlink()
    if moved_aside is not None:
        with contextlib.suppress(OSError):
            moved_aside.replace(tokenizer)
    remove_while_empty(made)


@contextlib.contextmanager
def sigint_ignored():
    """SIGINT is ignored inside (in the main thread; elsewhere it cannot be set)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        # None: a handler not set from Python, which cannot be put back; Python's own then.
        signal.signal(signal.SIGINT, signal.default_int_handler if previous is None else previous)


# Where a host of a multi-host run that ends with an error posts "STATUS LINE".
FAILURE_KEY = "train.py/failure"
FAILURE_BARRIER_MS = 10_000  # how long a host that ends waits for the others to read why
FINISHED_BARRIER_MS = 600_000  # how long a host that ended well waits for the others
# How long process 0, whose exit ends the coordination service, outlives the barrier after
# a failure: a host still there when the service goes is aborted by JAX with a crash report.
LAST_EXIT_S = 2.0


class HostFailures:
    """Ends every host of a multi-host run when one of them ends with an error.

    A host that ended alone would leave the others waiting in a collective until JAX
    missed its heartbeat (100 s) and aborted them with a crash report, or for ever. So a
    failing host posts its exit status and error line to JAX's coordination service, and
    a thread on every host waits for such a post, prints it and ends its process with the
    same status. Both wait at a barrier first (at most 10 s): the coordination service
    lives in process 0, which must outlive the post.
    """

    def __init__(self, client: Any, process: int):
        self._client, self._process = client, process
        self._ending = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="host-failures", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._ending.is_set():
            try:  # waits a second at a time, so that close() ends the thread soon
                post = self._client.blocking_key_value_get(FAILURE_KEY, 1000)
            except Exception as e:  # jax.errors.JaxRuntimeError
                if "DEADLINE_EXCEEDED" in str(e):
                    continue
                return  # the service is gone, and JAX ends this process itself
            if self._ending.is_set():  # this host's own post
                return
            status, line = post.split(" ", 1)
            print(f"error: {line}", file=sys.stderr, flush=True)
            self._end(int(status))

    def fail(self, status: int, line: str) -> None:
        """Posts this host's error line for the others and ends the process with `status`."""
        self._ending.set()
        with contextlib.suppress(Exception):  # another host posted first
            self._client.key_value_set(FAILURE_KEY, f"{status} process {self._process}: {line}")
        self._end(status)

    def _end(self, status: int) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        with contextlib.suppress(Exception):  # a host that died never comes
            self._client.wait_at_barrier("train.py/failure_read", FAILURE_BARRIER_MS)
        if self._process == 0:  # the others end at once; the service must outlive them
            time.sleep(LAST_EXIT_S)
        os._exit(status)  # Python's exit would wait 5 minutes for the others' shutdown

    def close(self) -> None:
        """Ends a run that ended well here: waits until every host has (watching on, so
        that a host that fails meanwhile still ends this one with its line), then stops
        watching."""
        with contextlib.suppress(Exception):  # timed out: a host far behind, or gone
            self._client.wait_at_barrier("train.py/finished", FINISHED_BARRIER_MS)
        self._ending.set()
        self._thread.join()


def maybe_initialize_distributed(args: argparse.Namespace) -> HostFailures | None:
    """Starts jax.distributed when the flags or environment ask for a multi-host run;
    then returns the HostFailures of this host."""
    import jax

    env_address = os.environ.get("JAX_COORDINATOR_ADDRESS")
    wanted = (
        args.coordinator_address is not None
        or args.num_processes is not None
        or args.process_id is not None
        or env_address
    )
    if not wanted:
        return None
    processes, process, address = args.num_processes, args.process_id, args.coordinator_address
    if processes is not None and processes < 1:
        raise UsageError(f"--num-processes must be >= 1, got {processes}")
    if process is not None and not 0 <= process < (processes or process + 1):
        raise UsageError(f"--process-id must be in [0, --num-processes), got {process}")
    if address is not None:
        found = re.fullmatch(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):(\d{1,5})", address)
        if not found or not 0 < int(found[2]) < 2**16:
            raise UsageError(
                f"--coordinator-address must be HOST:PORT (an IPv6 host in brackets), "
                f"got {address!r}"
            )
    if process:
        print(
            f"process {process}: waiting for the coordinator at {address or 'its address'} "
            "(JAX gives up after 5 minutes)",
            file=sys.stderr,
            flush=True,
        )
    elif process == 0 and (processes or 0) > 1 and (coordinator := address or env_address):
        others = processes - 1  # it says nothing until they join
        print(
            f"process 0: coordinating at {coordinator}; waiting for the other "
            f"{others} process{'es' if others > 1 else ''} to join (JAX gives up after 5 "
            "minutes)",
            file=sys.stderr,
            flush=True,
        )
    try:
        jax.distributed.initialize(
            coordinator_address=address, num_processes=processes, process_id=process
        )
    except (ValueError, RuntimeError) as e:  # flags JAX could not complete, no coordinator
        reason = " ".join(str(e).split())[:300]
        raise UsageError(
            f"cannot start the multi-host run ({reason}); give every host "
            "--coordinator-address HOST:PORT, --num-processes N and its --process-id"
        ) from None
    if jax.process_count() == 1:
        return None
    import orbax.checkpoint as ocp

    return HostFailures(ocp.multihost.get_jax_distributed_client(), jax.process_index())


@dataclasses.dataclass
class TrainingData:
    """The data side of a run, ready for the Trainer."""

    tokenizer: Any
    batcher: Any
    validation: Any  # transformer.training.ValidationData or None
    summary: list[str]
    cache_files: list[Path]  # the tokenized splits in the workdir's cache/ that it reads


def load_training_data(
    workdir: Path,
    settings: dict[str, Any],
    max_len: int,
    seed: int,
    log,
    bleu_max_sentences: int | None = None,
) -> TrainingData:
    """Corpus -> tokenizer -> ids -> bucketed batches, plus validation data (whose first
    `bleu_max_sentences` lines, or all, are scored for BLEU)."""
    import jax

    import data
    from transformer.training import ValidationData

    def no_usable_pairs(which: str, corpus: data.Corpus, advice: str) -> data.DataError:
        files = f" in {corpus.src_path} and {corpus.tgt_path}" if corpus.src_path else ""
        return data.DataError(
            f"the {which} split has no usable pairs{files} ({corpus.summary}); {advice}"
        )

    spec = data.CorpusSpec.from_settings(settings)
    train = data.load_corpus(spec, "train")
    if len(train) == 0:
        raise no_usable_pairs("training", train, "fix its files")
    # Validation is read before anything is written: only a split that is not there
    # means a run without it; a broken one is an error like broken training data.
    try:
        val = data.load_corpus(spec, "val")
        val_raw = data.load_corpus(spec, "val", clean=False)
    except data.MissingSplitError as e:
        log(f"warning: no validation: {e}")
        val = val_raw = None
    if val is not None and len(val) == 0:
        raise no_usable_pairs("validation", val, "fix or remove its files")
    tokenizer = data.load_or_train_tokenizer(
        workdir, train, vocab_size=settings["vocab_size"], model_type=settings["tokenizer_type"]
    )
    cache = workdir / CACHE_DIR

    def batcher_of(encoded: data.EncodedCorpus, shuffle: bool) -> data.TokenBatcher:
        return data.TokenBatcher(
            encoded,
            max_tokens=settings["max_tokens"],
            num_devices=jax.local_device_count(),
            pad_id=tokenizer.pad_id,
            bos_id=tokenizer.bos_id,
            seed=seed,
            shuffle=shuffle,
            process_index=jax.process_index(),
            process_count=jax.process_count(),
            max_shapes=settings["max_shapes"],
        )

    encoded = data.encode_corpus(tokenizer, train, max_len=max_len, cache_dir=cache)
    batcher = batcher_of(encoded, shuffle=True)
    summary = [
        f"data: {train.summary}",
        f"data: {encoded}; tokenizer {tokenizer.model_type}, {tokenizer.vocab_size} pieces",
        f"data: {batcher.num_shapes} batch shapes (rows, src, tgt): "
        + " ".join(f"{r}x{s}x{t}" for r, s, t in batcher.shapes)
        + f"; padding efficiency {batcher.padding_efficiency():.1%}; "
        f"~{batcher.batches_per_epoch} batches per epoch",
    ]
    padded = [r * (s + t) for r, s, t in batcher.shapes]
    over = [n for n in padded if n > batcher.max_tokens]
    if over:
        rows = min(r for r, _, _ in batcher.shapes)
        summary.append(
            f"warning: --max-tokens {batcher.max_tokens} holds fewer than {rows} rows of "
            f"{len(over)} of the {batcher.num_shapes} shapes, and a batch never has fewer "
            f"rows (a multiple of 8 and of the device count), so those batches go over it, "
            f"up to {max(over)} padded tokens; --max-tokens {max(over)} or more keeps to it"
        )
    cached = [data.encoded_cache_file(tokenizer, train, cache, max_len=max_len)]
    if val is None:
        return TrainingData(tokenizer, batcher, None, summary, cached)
    cached.append(data.encoded_cache_file(tokenizer, val, cache, max_len=None))
    val_encoded = data.encode_corpus(tokenizer, val, max_len=None, cache_dir=cache)
    val_batches = batcher_of(val_encoded, shuffle=False).one_pass()
    # Validation drops no pair (as evaluate.py); one far longer than training's can run
    # out of memory at the first validation, which is better known at the start.
    longer = [n for n in map(len, val_encoded.src + val_encoded.tgt) if n > max_len]
    if longer:
        summary.append(
            f"warning: validation sentences longer than max_len {max_len} tokens: "
            f"{len(longer)} (the longest {max(longer)} tokens); they are validated whole, "
            "in memory that grows with the square of their length"
        )
    references = val_raw.references()
    bleu_lines = f"{len(val_raw)} lines"
    if bleu_max_sentences and bleu_max_sentences < len(val_raw):
        bleu_lines = f"the first {bleu_max_sentences} of its {len(val_raw)} lines"
    summary.append(
        f"data: validation {val.summary}; {len(val_batches)} loss batches, {bleu_lines} for BLEU"
    )
    validation = ValidationData(
        batches=lambda: val_batches,
        sources=val_raw.src,
        references=references,
        tokenizer=tokenizer,
    )
    return TrainingData(tokenizer, batcher, validation, summary, cached)


def compiles_side_by_side() -> bool:
    """Whether the step programs are compiled side by side before the first step: on a GPU
    or TPU, where the default run's 12 train-step programs took 74.1 s against 264.5 s
    one by one (an H100 with XLA's autotuning off, README). On the CPU each program is
    compiled as its shape first comes: XLA:CPU already keeps the cores busy compiling one
    program, and the pool gained nothing on 2 cores (benchmarks/EXPERIMENTS.md).
    """
    import jax

    return jax.default_backend() != "cpu"


def validates_between(config, start: int, total_steps: int) -> bool:
    """Whether a validation (loss, or loss and BLEU) is due at a step in (start, total]."""
    return any(
        every > 0 and total_steps // every > start // every
        for every in (config.eval_every, config.bleu_every)
    )


def compile_step_programs(
    trainer, loaded: TrainingData, log, *, start: int, total_steps: int, stop: StopRequest
) -> None:
    """Compiles the train step for every batch shape, and the eval step for every
    validation one if a validation is due, side by side before the first step (not one by
    one as shapes come). A stop request ends it without waiting for the compilations
    under way, which `exit_process` does not wait for either."""
    import jax

    from transformer.compilation_cache import available_cores
    from transformer.training import batch_layout

    validating = loaded.validation is not None and validates_between(
        trainer.config, start, total_steps
    )
    evals = {batch_layout(b) for b in loaded.validation.batches()} if validating else set()
    train = loaded.batcher.array_shapes()
    log(
        f"compiling: {len(train)} train-step and {len(evals)} validation-loss programs, "
        f"up to {available_cores()} at a time"
    )
    began = time.time()
    # With several hosts a stop is agreed on in the steps: the run trains 1-2 and saves.
    stop.compiling = jax.process_count() == 1
    try:
        count = trainer.compile_steps(train, evals, stop=stop)
    finally:
        stop.compiling = False
    if stop.is_set():
        log(f"compiling stopped: {count} of {len(train) + len(evals)} programs compiled")
    else:
        log(f"compiled: {count} programs in {time.time() - began:.1f} s")


class PreTrainingStop(Exception):
    """A stop request (SIGINT, SIGTERM or SIGHUP) that came before the training loop:
    nothing to save.

    `signum` is the request's signal, which the exit status reports."""

    def __init__(self, message: str, signum: int = signal.SIGINT):
        super().__init__(message)
        self.signum = signum


class StopRequest(threading.Event):
    """Set by SIGINT, SIGTERM or SIGHUP; `signum` says which came first. `compiling` is
    True while the step programs are compiled before the first step, where a stop (with
    one host) saves nothing."""

    signum: int | None = None
    compiling: bool = False


# A closed terminal or a dropped SSH session sends SIGHUP, whose default ends the run
# without saving what it trained since the last checkpoint.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM) + (
    (signal.SIGHUP,) if hasattr(signal, "SIGHUP") else ()
)


def request_stop(stop: StopRequest, training: threading.Event, signum: int) -> str:
    """Sets `stop` (`signum` is kept where it is the first) and says what the run does."""
    if stop.signum is None:
        stop.signum = signum
    stop.set()
    if stop.compiling:
        return "stopping the compiling; nothing new was trained, so nothing is saved"
    if training.is_set():
        # A second Ctrl-C ends the run at once: a save that hangs (a full disk, a dead
        # network mount) cannot then keep it from ending.
        return "saving a checkpoint, then stopping (a Ctrl-C now stops at once, maybe before it)"
    return "before training starts, then stopping"


def log_until_stdout_closes(write, stop: StopRequest, training: threading.Event):
    """`write` (of a line to stdout), where stdout closing stops the run as a hang-up does.

    Piped into a command that ended (`| head`, a `tee` that was killed), a log line raised
    BrokenPipeError, and the run ended unsaved. Stdout now goes to /dev/null from there
    on, and the run stops as for a signal (SIGPIPE: saving a checkpoint where it trains),
    saying so on stderr."""

    def log(line: str) -> None:
        try:
            write(line)
        except BrokenPipeError:
            from data.text import discard_writes

            with contextlib.suppress(OSError, ValueError):  # no descriptor: nothing to move
                discard_writes([sys.stdout.fileno()])
            what = request_stop(stop, training, getattr(signal, "SIGPIPE", signal.SIGTERM))
            print(f"stdout was closed (a broken pipe): {what}", file=sys.stderr, flush=True)

    return log


def install_stop_handlers(stop: StopRequest, log, training: threading.Event) -> dict[int, Any]:
    """SIGINT, SIGTERM and SIGHUP set `stop`: once `training` is set the loop then saves
    and exits; before it, `check_stop_before_training` ends the run. A second SIGINT
    aborts, except while `removed_if_stopped_before_training` takes back what the run
    wrote. After a SIGHUP, output that went to the terminal is dropped: writing to a
    terminal that hung up fails (EIO), and a log line would then end the run before it
    saves."""
    from data.text import discard_writes

    # Found now: a hung-up terminal is no longer a tty to `isatty`.
    terminal_fds = [stream.fileno() for stream in (sys.stdout, sys.stderr) if stream.isatty()]

    def handler(signum, frame):
        if stop.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if signum == getattr(signal, "SIGHUP", None):
            discard_writes(terminal_fds)
        log(f"{signal.Signals(signum).name}: {request_stop(stop, training, signum)}")

    previous = {}
    for sig in STOP_SIGNALS:
        previous[sig] = signal.signal(sig, handler)
    return previous


def check_stop_before_training(stop: StopRequest) -> None:
    """Ends the run where a stop request came while the data or the state was loading.

    In a multi-host run every host checks at the same points, and all end if any of them
    was asked to: a host that ended alone would leave the others waiting for it."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    signum = (stop.signum or signal.SIGINT) if stop.is_set() else 0
    if jax.process_count() > 1:
        signum = int(np.max(multihost_utils.process_allgather(np.int32(signum))))
    if signum:
        by = "" if stop.is_set() else "another host was asked to stop; "
        raise PreTrainingStop(
            f"stopped before training started: {by}nothing new was trained, so nothing was "
            "saved; run the same command to go on",
            signum,
        )


def run(args: argparse.Namespace) -> int:
    """Trains as the flags say; returns the exit status."""
    from tqdm.auto import tqdm

    # From here a stop request is seen: before training it ends the run at the next
    # check, in training the loop saves a checkpoint and exits.
    stop, training = StopRequest(), threading.Event()
    log = log_until_stdout_closes(tqdm.write, stop, training)
    previous_handlers = install_stop_handlers(stop, log, training)
    try:
        return _run(args, log, stop, training)
    except PreTrainingStop as e:
        print(f"error: {e}", file=sys.stderr)
        return 128 + e.signum  # as the shell reports a signal
    finally:
        for sig, handler in previous_handlers.items():
            signal.signal(sig, handler)


@dataclasses.dataclass
class RunSettings:
    """A run's workdir and the settings its flags and the workdir's config.json give."""

    workdir: Path
    saved: dict[str, Any] | None  # the workdir's config.json, None for a new run
    data: dict[str, Any]
    train: TrainConfig


def run_settings(args: argparse.Namespace, log) -> RunSettings:
    """Reads the workdir's config.json and checks the flags against it, before anything is
    written: a contradiction or a change a resume cannot take is a UsageError here."""
    import data
    from transformer.checkpoints import CONFIG_FILE, checkpoint_steps, load_run_config

    for flag, value in [
        ("--workdir", args.workdir),
        ("--data-dir", args.data_dir),
        ("--tfds-data-dir", args.tfds_data_dir),
    ]:
        if value == "":  # "--data-dir $DATA" with $DATA unset read the current folder
            raise UsageError(f"{flag} is empty: name a folder, or leave the flag out")
    workdir = Path(args.workdir) if args.workdir else default_workdir(args)
    if not args.workdir:
        log(f"workdir: {workdir} (the default for these data flags; --workdir to choose)")
    if workdir.exists() and not workdir.is_dir():
        raise UsageError(f"--workdir {workdir} is a file, not a directory")
    saved = load_run_config(workdir) if (workdir / CONFIG_FILE).is_file() else None

    check_preset(args)
    data_cfg = data_settings(args, saved)
    # Contradicting data flags are an error before anything is written.
    data.CorpusSpec.from_settings(data_cfg).check()
    if args.tfds_data_dir and data_cfg["dataset"] != "tfds":  # else silently not read
        raise UsageError(
            f"--tfds-data-dir {args.tfds_data_dir} is for --dataset tfds, not "
            f"{data_cfg['dataset']}; add --dataset tfds or drop --tfds-data-dir"
        )
    train_cfg = train_config(args, saved)
    if saved is not None:  # the seed drew the checkpoint's data order and dropout keys
        saved_seed = (saved.get("train") or {}).get("seed", train_cfg.seed)
        check_resume_matches(
            workdir, {"train": {"seed": saved_seed}}, "train", {"seed": train_cfg.seed}
        )
    # The model flags are checked before the tokenizer is trained into the workdir, and
    # on a resume against the run's model before the data is read (the vocabulary of the
    # tokenizer against the checkpoints' once it is loaded).
    model_cfg = model_config(args, saved, data_cfg["vocab_size"], pad_id=0)
    # The pairs kept are the model's: a --preset given where a run was started (and killed
    # before its first checkpoint) is the model asked for, max_len included.
    data_cfg["max_len"] = model_cfg.max_len
    if saved is not None:
        from_tokenizer = {k: v for k, v in saved["model"].items() if k in ("vocab_size", "pad_id")}
        check_resume_matches(
            workdir, saved, "model", model_cfg.to_dict() | from_tokenizer, args.preset
        )
        check_resume_matches(workdir, saved, "data", data_cfg)
        changes = resumed_changes(saved, train_cfg, data_cfg)
        if changes and checkpoint_steps(workdir):
            log(f"resuming with settings other than the run's: {'; '.join(changes)}")
    return RunSettings(workdir, saved, data_cfg, train_cfg)


def _run(args: argparse.Namespace, log, stop: threading.Event, training: threading.Event) -> int:
    """`run`'s work once the stop handlers are in place."""
    import jax

    main_process = jax.process_index() == 0
    settings = run_settings(args, log)
    with workdir_locked(settings.workdir, enabled=main_process):
        return _run_locked(args, settings, main_process, log, stop, training)


def _run_locked(
    args: argparse.Namespace,
    settings: RunSettings,
    main_process: bool,
    log,
    stop: threading.Event,
    training: threading.Event,
) -> int:
    """`_run`'s work while it holds the workdir's lock."""
    from data.text import is_a_terminal
    from transformer.checkpoints import check_run_tokenizer, checkpoint_steps

    workdir, saved = settings.workdir, settings.saved
    if args.no_progress:  # nor TFDS's bars while it downloads and prepares a dataset
        from data import tfds_source

        tfds_source.show_progress_bars(False)
    moved_aside = forget_unchecked_tokenizer(workdir, saved, settings.data, log, main_process)
    with removed_if_stopped_before_training(workdir, main_process, training, moved_aside):
        try:
            loaded = load_training_data(
                workdir,
                settings.data,
                settings.data["max_len"],
                settings.train.seed,
                log,
                settings.train.bleu_max_sentences,
            )
        except OSError as e:  # an unwritable --workdir, an unreadable data file
            raise setup_error(e) from None
        check_stop_before_training(stop)
        model_cfg = model_config(args, saved, loaded.tokenizer.vocab_size, loaded.tokenizer.pad_id)
        if saved is not None:
            check_resume_matches(workdir, saved, "model", model_cfg.to_dict(), args.preset)
            if checkpoint_steps(workdir):  # their ids are of the tokenizer the run recorded
                check_run_tokenizer(workdir, saved, loaded.tokenizer.fingerprint)
        for line in loaded.summary:
            log(line)
        train_cfg = settings.train
        total_steps = train_cfg.steps or train_cfg.epochs * loaded.batcher.batches_per_epoch
        result = train_loaded(
            settings,
            model_cfg,
            loaded,
            total_steps,
            log,
            stop,
            training,
            main_process=main_process,
            # Redirected (`> train.log 2>&1`), the bar's redrawing filled the log with
            # one long line, and the step lines were not printed.
            progress=not args.no_progress and is_a_terminal(sys.stderr),
        )
    if result is None:
        return 0
    if result.interrupted and result.step == 0:
        log(
            "interrupted before the first update: nothing was trained, so no checkpoint was "
            f"saved. Start again with: python train.py --workdir {workdir}"
        )
        return 0
    if result.interrupted:
        log(
            f"interrupted at step {result.step}; checkpoint saved in {result.checkpoint_dir}. "
            f"Resume with: python train.py --workdir {workdir}"
        )
        return 0
    best = (
        f"best validation BLEU {result.best_bleu:.2f} at step {result.best_step}"
        if result.best_bleu is not None
        else "no validation BLEU yet"
    )
    log(
        f"done: step {result.step} of {total_steps} in {_duration(result.seconds)}; {best}; "
        f"checkpoints in {result.checkpoint_dir}"
    )
    return 0


def train_loaded(
    settings: RunSettings,
    model_cfg: TransformerConfig,
    loaded: TrainingData,
    total_steps: int,
    log,
    stop: threading.Event,
    training: threading.Event,
    *,
    main_process: bool,
    progress: bool,
) -> TrainResult | None:
    """Restores or initializes the state and trains to `total_steps`; `training` is set, and
    config.json written (by the `main_process` only), once the loop is about to start.
    Returns the Trainer's result, or None where the checkpoint has already reached that
    step."""
    import jax

    import data
    from data import prefetch
    from transformer.checkpoints import record_environment, save_run_config, tokenizer_section
    from transformer.training import Trainer, with_data_state

    workdir, train_cfg = settings.workdir, settings.train
    trainer = Trainer(
        model_cfg,
        train_cfg,
        workdir,
        pad_id=loaded.tokenizer.pad_id,
        log=log,
        progress=progress,
        is_main_process=main_process,
        total_steps=total_steps,
    )
    batches = None
    try:
        start = trainer.restore_or_init(loaded.batcher)
        check_stop_before_training(stop)
        # Nothing to train (config.json keeps the run's own steps), unless a validation that
        # a stop skipped at the last step is to be run.
        if start >= total_steps and trainer.validation_skipped_at != start:
            log(
                f"already at step {start} of the {total_steps} asked for: nothing to train; "
                "pass a larger --steps to go on"
            )
            return None
        training.set()
        if main_process:  # only once the checkpoint took these settings
            sections = {
                "model": model_cfg.to_dict(),
                "data": settings.data,
                "train": train_cfg.to_dict(),
                "tokenizer": tokenizer_section(loaded.tokenizer.fingerprint),
            }
            save_run_config(workdir, {**(settings.saved or {}), **sections})  # keeps "environments"
            # The tokenized splits of data or a tokenizer this run no longer has (edited
            # files, a tokenizer trained again) would stay for ever. Only now: a run that
            # stops before training leaves the workdir as it found it.
            removed, failed = data.prune_encoded_cache(workdir / CACHE_DIR, loaded.cache_files)
            if removed:
                log(
                    f"data: removed {len(removed)} tokenized split(s) of other data or another "
                    f"tokenizer from {workdir / CACHE_DIR}"
                )
            for line in failed:
                log(f"warning: could not remove a stale tokenized split: {line}")
        num_params = sum(x.size for x in jax.tree.leaves(trainer.params()))
        log(
            f"model: {num_params / 1e6:.2f}M parameters, d_model {model_cfg.d_model}, "
            f"{model_cfg.num_encoder_layers}+{model_cfg.num_decoder_layers} layers; "
            f"{jax.device_count()} {jax.devices()[0].platform} device(s) on "
            f"{jax.process_count()} host(s)"
        )
        warn_of_cpu_fallback(log)
        if start:
            log(f"resumed from step {start} in {trainer.checkpoints.directory}")
        if main_process:
            changes = record_environment(workdir, start)
            if start and changes:
                log(
                    "warning: resuming with other software than before "
                    f"({'; '.join(changes)}); training goes on, but will not repeat "
                    "an uninterrupted run to the last digit"
                )
        began = time.time()
        trainer.open_metrics()  # its clock counts compiling, whichever way it is done
        if compiles_side_by_side():
            compile_step_programs(
                trainer, loaded, log, start=start, total_steps=total_steps, stop=stop
            )
        batches = prefetch(loaded.batcher, size=2)
        result = trainer.run(
            with_data_state(batches), total_steps, loaded.validation, stop_event=stop
        )
        # The "done" line's time counts the compiling too, as metrics.jsonl's clock does.
        return dataclasses.replace(result, seconds=time.time() - began)
    finally:
        if batches is not None:
            batches.close()
        trainer.close()


def warn_of_cpu_fallback(log) -> None:
    """Warns where JAX runs on the CPU although an accelerator's plugin and device were
    found: `keep_freed_host_memory` then left the CPU step's malloc settings off."""
    import jax

    from transformer import host_memory

    if jax.default_backend() == "cpu" and host_memory.accelerator_expected():
        log(
            "warning: JAX runs on the CPU although a GPU or TPU plugin and device are "
            "installed (JAX's own warning may say why), so the CPU step runs without its "
            "memory settings, slower; set JAX_PLATFORMS=cpu to train on the CPU at full speed"
        )


def _duration(seconds: float) -> str:
    """HH:MM:SS, the hours not wrapped at a day (a 25-hour run is 25:00:00, not 01:00:00)."""
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes // 60:02d}:{minutes % 60:02d}:{secs:02d}"


OUT_OF_MEMORY_ADVICE = (
    "lower --max-tokens (the batch), or choose a smaller model (--preset, --d-model, --d-ff, "
    "--num-encoder-layers, --num-decoder-layers), in a new --workdir (a resume keeps its "
    "run's settings); where memory was short only for a while, the same command resumes "
    "from the last checkpoint"
)


def main(argv: list[str] | None = None) -> int:
    """Entry point: parses flags, trains, maps library errors to `error: ...` lines."""
    parser = build_parser()
    args = parser.parse_args(argv)
    from data import DataError
    from data.errors import os_error_line, out_of_memory_line
    from transformer.checkpoints import (
        CheckpointError,
        CheckpointWriteError,
        silence_abandoned_writes,
        silence_orbax_logs,
    )
    from transformer.compilation_cache import (
        EMPTY_CACHE_FLAG,
        abandon_threads_at_exit,
        persistent_compilation_cache,
    )
    from transformer.host_memory import keep_freed_host_memory
    from transformer.training import NonFiniteLossError

    if args.compilation_cache == "":  # would be the current folder
        parser.error(EMPTY_CACHE_FLAG)

    keep_freed_host_memory()  # before the first computation starts XLA's threads
    silence_orbax_logs()  # a failed checkpoint write is one error line (CheckpointError)
    cache = persistent_compilation_cache(
        args.compilation_cache,
        enabled=not args.no_compilation_cache,
    )
    hosts = None
    try:
        with cache:
            hosts = maybe_initialize_distributed(args)
            status = run(args)
        if hosts is not None:
            hosts.close()
        return status
    except (DataError, CheckpointError, UsageError) as e:
        status, line = (1 if isinstance(e, CheckpointWriteError) else 2), str(e)
        if isinstance(e, CheckpointWriteError):  # Orbax's threads of the save wait forever
            silence_abandoned_writes()
            abandon_threads_at_exit()
    except NonFiniteLossError as e:
        status, line = 1, str(e)
    except OSError as e:  # a --workdir name too long, a full disk: not a usage error
        status, line = 1, os_error_line(e, again="training resumes")
    except Exception as e:
        status, line = 1, out_of_memory_line(e, OUT_OF_MEMORY_ADVICE)
        if line is None and hosts is None:
            raise
        if line is None:  # a defect: its traceback, then its line for the other hosts
            traceback.print_exc()
            line = " ".join(f"unexpected {type(e).__name__}: {e}".split())[:300]
    except KeyboardInterrupt:  # a second Ctrl-C, or one before the stop handlers
        status, line = 130, "interrupted; run the same command to resume from the last checkpoint"
    print(f"error: {line}", file=sys.stderr)
    if hosts is not None:
        hosts.fail(status, line)
    return status


def _interrupted_while_starting(signum, frame) -> None:
    """SIGINT before `run`'s stop handlers, while the libraries load: the workdir is not
    touched yet, so the command ends at once. A KeyboardInterrupt raised then printed a
    traceback, or was dropped by JAX's garbage-collection callback and training went on."""
    os.write(2, b"error: interrupted before training started\n")
    os._exit(130)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, _interrupted_while_starting)  # until `run` sets its own
    build_parser().parse_args()  # --help and a mistyped flag answer before JAX is loaded
    from transformer.compilation_cache import exit_process

    exit_process(main)  # without waiting for programs still compiling after a stop
