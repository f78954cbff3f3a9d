"""The training workdir: its config, its Orbax checkpoints, and reading parameters back.

Layout of a workdir::

    workdir/config.json       {"model": TransformerConfig.to_dict(), "data": {...}, "train": {...},
                               "environments": [software_environment() + "step", one per start]}
    workdir/tokenizer.model   the SentencePiece model
    workdir/checkpoints/<step>/{params,opt_state,meta,metrics}   one Orbax checkpoint per step
    workdir/metrics.jsonl     one JSON object per logged step
    workdir/events.out.tfevents.*   TensorBoard

A checkpoint at step N holds the state after N optimizer updates: the float32
parameters, the optimizer state, and a JSON "meta" item (step, RNG key, data iterator
position). Checkpoints that were scored on the validation set carry an Orbax metric
`val_bleu`; the manager keeps the last `keep` checkpoints plus the one with the best
`val_bleu`. A checkpoint a stop saved between the scheduled ones carries the metric
`interim`: it counts toward none of the `keep`, so a stop deletes no scheduled
checkpoint, and the next scheduled save deletes it, so a resumed run keeps the
checkpoints an uninterrupted one keeps. Orbax writes each step to a temporary directory
and renames it when complete, so a killed process never leaves a step directory that
looks finished but is not. A finished one that was damaged later is renamed to
`<step>.damaged` when a resume skips it, so that the step is trained and saved again
(and the damaged files are kept for a look).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import platform
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import jax
import numpy as np
import orbax.checkpoint as ocp

from data.text import write_text_atomically

CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.model"
CHECKPOINT_DIR = "checkpoints"
METRICS_FILE = "metrics.jsonl"
BEST_METRIC = "val_bleu"
INTERIM_METRIC = "interim"  # a checkpoint saved off the schedule, by a stop
# What to wait for where a run under way has saved nothing yet (`training_there`).
FIRST_CHECKPOINT = "evaluate once it has saved its first checkpoint"
# The lock of a run under way, which holds its process id (train.py's LOCK_FILE).
LOCK_FILE = "train.lock"
# What else train.py keeps in a workdir: its tokenized splits, that lock, and TensorBoard's
# event files (a prefix).
RUN_ENTRIES = (CONFIG_FILE, TOKENIZER_FILE, CHECKPOINT_DIR, METRICS_FILE, "cache", LOCK_FILE)
EVENTS_PREFIX = "events.out.tfevents"
# How a step's folder is named (`checkpoints/1000`): given to the manager, and used
# by `update_meta` to find one step's folder.
_STEP_NAME_FORMAT = ocp.path.step.standard_name_format()
# The packages whose versions can change a run's numbers (or its BLEU), recorded with it.
RECORDED_PACKAGES = (
    "jax",
    "jaxlib",
    "flax",
    "optax",
    "orbax-checkpoint",
    "numpy",
    "sentencepiece",
    "sacrebleu",
)

PyTree = Any


class CheckpointError(Exception):
    """A workdir or checkpoint problem; str() is a one-line message for the user."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint that could not be written (a full disk): not the workdir's fault."""


class TrainCheckpoint(NamedTuple):
    """One restored training checkpoint.

    Attributes:
      step: optimizer updates done.
      params: float32 parameter pytree (host numpy, unreplicated).
      opt_state: optimizer state pytree (host numpy, unreplicated).
      meta: the JSON item saved with it (step, rng, data iterator state, ...).
    """

    step: int
    params: PyTree
    opt_state: PyTree
    meta: dict[str, Any]


def _stderr(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _quiet_orbax() -> Iterator[None]:
    """Silences Orbax's absl INFO/WARNING chatter (read-only notes, steps saved without metrics)."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _not_from_orbax(record: logging.LogRecord) -> bool:
    """A logging filter: False for Orbax's records and for asyncio's about Orbax's tasks.

    Those include the reads of a damaged checkpoint: its arrays are read side by side, the
    first failure is reported (a resume or evaluate.py skips the checkpoint, warning), and
    asyncio logs each other failed read, whose message names the OCDBT database Orbax
    writes, as a "Future exception was never retrieved" when it is collected."""
    if "/orbax/" in record.pathname.replace(os.sep, "/"):
        return False
    if record.name != "asyncio":
        return True
    message = record.getMessage()
    return not ("orbax" in message or "OCDBT database" in message)


def silence_orbax_logs() -> None:
    """Drops Orbax's log records, and asyncio's about its tasks, for the rest of the process.

    For command-line programs: when a background save fails (a full disk), Orbax's
    threads log the failure with tracebacks, hundreds of lines in all, and asyncio logs
    its unretrieved task errors at exit; `Checkpoints` raises the failure as a one-line
    CheckpointError, which the program prints. A damaged checkpoint that is read logged
    up to 60 lines of asyncio's beside the program's one-line warning.
    """
    for name in ("absl", "asyncio"):
        logging.getLogger(name).addFilter(_not_from_orbax)  # a no-op when it is on already


def silence_abandoned_writes() -> None:
    """Drops the warnings about the coroutines of a failed Orbax save, for the rest of the
    process.

    For command-line programs, after a `CheckpointWriteError`: Orbax leaves the rest of
    the save's coroutines unstarted, and Python prints two lines for each at exit
    ("coroutine '_create_paths' was never awaited", "Enable tracemalloc ...") after the
    error's one line. The project has no coroutines of its own.
    """
    warnings.filterwarnings("ignore", r"coroutine '.*' was never awaited", RuntimeWarning)


@contextlib.contextmanager
def _write_errors(directory: Path) -> Iterator[None]:
    """Turns a failed checkpoint write (a full disk: Orbax raises TensorStore's ValueError,
    or an OSError) into a one-line CheckpointWriteError that says how to go on."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as e:
        text = str(e)
        reason = "no space left on device" if "No space left" in text else _first_line(e)
        raise CheckpointWriteError(
            f"cannot write a checkpoint in {directory}: {reason}; make room there (or fix "
            "what stops the write), then run the same command to resume from the last "
            "checkpoint"
        ) from e


def _is_stray_read_error(unraisable: Any) -> bool:
    """Whether an unraisable exception is a late read of a failed restore calling its closed loop.

    Orbax stops waiting at the first array it cannot read and closes its event loop;
    the other reads of that restore finish later in TensorStore's threads, and each
    one's callback into the closed loop raises RuntimeError("Event loop is closed")
    there, with no object it belongs to.
    """
    if not isinstance(unraisable.exc_value, RuntimeError) or unraisable.object is not None:
        return False
    if str(unraisable.exc_value) != "Event loop is closed" or unraisable.exc_traceback is None:
        return False
    return unraisable.exc_traceback.tb_frame.f_code.co_name == "call_soon_threadsafe"


# Numbers the barriers of `Checkpoints._set_aside`, whose names must not repeat.
_set_aside_barriers = itertools.count()
_stray_reads_lock = threading.Lock()
_stray_reads_dropped = False


def _drop_stray_read_errors() -> None:
    """From now on, drops the tracebacks of the reads a failed restore left running.

    They come dozens to a damaged checkpoint, at any time after the restore failed
    (some before the failure reaches the caller, so `Checkpoints.__init__` calls this
    before any read), and say nothing more than the one-line error or warning
    that reports the damage. Every other unraisable exception still goes to the
    hook that was there before.
    """
    global _stray_reads_dropped
    with _stray_reads_lock:
        if _stray_reads_dropped:
            return
        _stray_reads_dropped = True
        previous = sys.unraisablehook

        def hook(unraisable: Any) -> None:
            if not _is_stray_read_error(unraisable):
                previous(unraisable)

        sys.unraisablehook = hook


def name_aside(path: Path, suffix: str) -> Path:
    """The first of `<path>.<suffix>`, `<path>.<suffix>.2`, `<path>.<suffix>.3`, ... that
    is not taken: where to move `path` aside without overwriting one moved there before."""
    aside = path.with_name(f"{path.name}.{suffix}")
    for n in range(2, 1000):
        if not aside.exists():
            break
        aside = path.with_name(f"{path.name}.{suffix}.{n}")
    return aside


def checkpoint_dir(workdir: str | os.PathLike) -> Path:
    """The directory holding the Orbax step directories of `workdir`."""
    return Path(workdir).resolve() / CHECKPOINT_DIR


def save_run_config(workdir: str | os.PathLike, config: dict[str, Any]) -> Path:
    """Writes `config` as workdir/config.json (human-readable), atomically.

    Args:
      workdir: the run directory (created if missing).
      config: {"model": ..., "data": ..., "train": ...}, JSON-serializable.

    Returns:
      The path written.
    """
    path = Path(workdir) / CONFIG_FILE
    write_text_atomically(path, json.dumps(config, indent=2, sort_keys=True) + "\n")
    return path


def is_run_file(workdir: str | os.PathLike, path: str | os.PathLike) -> bool:
    """Whether `path` is one of the files that train.py keeps in `workdir`, or is inside its
    checkpoints/ or cache/: writing there breaks the run (a config.json overwritten by
    translations cannot be made again)."""
    try:
        relative = Path(os.path.realpath(path)).relative_to(os.path.realpath(workdir))
    except ValueError:
        return False
    first = relative.parts[0] if relative.parts else ""
    return first in RUN_ENTRIES or first.startswith(EVENTS_PREFIX)


def training_process(workdir: str | os.PathLike) -> int | None:
    """The process id of a train.py that is training in `workdir` now (the one in its lock
    file, where that process is alive), else None: no run under way, or one that was killed
    and left its lock file behind."""
    if os.name != "posix":  # no lock file there; and Windows' os.kill would end the process
        return None
    try:
        pid = int((Path(workdir) / LOCK_FILE).read_text(encoding="utf-8").strip())
        if pid <= 0:  # 0 and -1 would ask about a group of processes, or all of them
            return None
        os.kill(pid, 0)  # signal 0: only whether the process exists
    except PermissionError:  # it does, under another user
        return pid
    except (OSError, ValueError, OverflowError):  # no file, not a pid, no such process
        return None
    return pid


def training_there(workdir: str | os.PathLike, what: str) -> str:
    """`what` to wait for, where a train.py is training in `workdir` now, as the end of an
    error that found nothing to read there yet; else ''."""
    pid = training_process(workdir)
    if pid is None:
        return ""
    return f"; train.py (process {pid}) is training in {workdir}: {what}"


def tokenizer_section(fingerprint: str) -> dict[str, str]:
    """config.json's record of the run's tokenizer: the SHA-256 of its model file
    (`data.Tokenizer.fingerprint`), which its checkpoints' token ids are of."""
    return {"sha256": fingerprint}


def check_run_tokenizer(workdir: str | os.PathLike, config: dict[str, Any], fingerprint: str):
    """A CheckpointError where the workdir's tokenizer (SHA-256 `fingerprint`) is not the one
    its config.json records: one of the same size but other pieces (another run's, or one
    trained again by another SentencePiece version) would give every id another meaning to
    the checkpoints, and training or translating would go on with no error. A config from
    before the record is not checked."""
    recorded = (config.get("tokenizer") or {}).get("sha256")
    if recorded is None or recorded == fingerprint:
        return
    raise CheckpointError(
        f"{Path(workdir) / TOKENIZER_FILE} is not the tokenizer this run trained with "
        f"(SHA-256 {fingerprint[:12]}..., where {CONFIG_FILE} records {recorded[:12]}...): "
        "its ids would be other pieces to the checkpoints; put back the run's own "
        "tokenizer.model, or train into a new --workdir"
    )


def load_run_config(workdir: str | os.PathLike) -> dict[str, Any]:
    """Reads workdir/config.json.

    Args:
      workdir: a directory written by train.py.

    Returns:
      The parsed dict with keys "model", "data" and "train".

    Raises:
      CheckpointError: the workdir or its config.json is missing or unreadable.
    """
    path = Path(workdir) / CONFIG_FILE
    if Path(workdir).exists() and not Path(workdir).is_dir():
        raise CheckpointError(f"workdir {workdir} is a file, not a directory")
    if not Path(workdir).is_dir():
        raise CheckpointError(
            f"workdir {workdir} does not exist; train into it with train.py first"
        )
    if not path.is_file():
        if wait := training_there(workdir, FIRST_CHECKPOINT):  # setting up: data, tokenizer
            raise CheckpointError(f"{path} is not written yet{wait}")
        raise CheckpointError(f"{path} is missing; is {workdir} a workdir written by train.py?")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); restore it or retrain") from None
    if not isinstance(config, dict) or "model" not in config:
        raise CheckpointError(f"{path} has no 'model' section; is it a config written by train.py?")
    restore = "it was edited or damaged: restore the one its run wrote"
    for section in ("model", "data", "train"):
        if section in config and not isinstance(config[section], dict):
            there = json.dumps(config[section])[:40]
            raise CheckpointError(
                f"{path}: its {section!r} section is {there}, not an object; {restore}"
            )
    environments = config.get("environments", [])
    if not isinstance(environments, list) or not all(isinstance(e, dict) for e in environments):
        raise CheckpointError(f"{path}: its 'environments' is not a list of objects; {restore}")
    return config


def _code_revision() -> str | None:
    """The git commit of this code (with "-dirty" if tracked files differ), or None outside git.

    None too for an installed copy (site-packages), even inside some other git checkout.
    """
    repo = str(Path(__file__).resolve().parents[1])

    def git(*args: str) -> str:
        run = subprocess.run(
            ["git", "-C", repo, *args], capture_output=True, text=True, timeout=10, check=True
        )
        return run.stdout.strip()

    try:
        if Path(git("rev-parse", "--show-toplevel")).resolve() != Path(repo):
            return None
        commit = git("rev-parse", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{commit}-dirty" if changed else commit


def _cpu_model() -> str | None:
    """e.g. "AMD EPYC, family 25 model 17, AVX-512" (Linux), else `platform.processor()`.

    Family, model, vector width and bfloat16 instructions ("AMX-BF16" or
    "AVX512-BF16", when present), since hosts behind one model name differ, and XLA and
    its matmul kernels pick code for the CPU they find.
    """
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block is enough
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    if "model name" not in fields:
        return platform.processor() or None
    flags = set(fields.get("flags", "").split())

    def first_present(*candidates: tuple[str, str]) -> str | None:
        return next((name for flag, name in candidates if flag in flags), None)

    widest = first_present(("avx512f", "AVX-512"), ("avx2", "AVX2"))
    # bfloat16 instructions (a matrix unit, or dot products), which decide the speed of
    # `matmul_dtype="bfloat16"`.
    bfloat16 = first_present(("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX512-BF16"))
    parts = [fields["model name"]]
    if "cpu family" in fields and "model" in fields:
        parts.append(f"family {fields['cpu family']} model {fields['model']}")
    return ", ".join(parts + [name for name in (widest, bfloat16) if name])


def software_environment() -> dict[str, Any]:
    """What besides its settings decides a run's numbers: code, packages, Python, devices.

    Training is deterministic for one code revision and one set of package versions on
    one kind of machine; a new jaxlib or XLA may round differently and so end elsewhere.

    Returns:
      {"code": git commit or None, "packages": {name: version or None}, "python": ...,
       "platform": ..., "cpu": ..., "devices": "N x kind"}.
    """
    packages = {}
    for name in RECORDED_PACKAGES:
        try:
            packages[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            packages[name] = None
    return {
        "code": _code_revision(),
        "packages": packages,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
    }


def environment_changes(before: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The differences that can change numbers between two `software_environment()` records.

    Returns:
      e.g. ["jaxlib 0.10.2 -> 0.10.3", "code abc -> def"]; empty if none.
    """
    old = before.get("packages", {})
    changes = [
        f"{name} {old.get(name)} -> {version}"
        for name, version in now["packages"].items()
        if old.get(name) != version
    ]
    for key in ("code", "python", "devices"):
        if before.get(key) != now[key]:
            changes.append(f"{key} {before.get(key)} -> {now[key]}")
    return changes


def record_environment(workdir: str | os.PathLike, step: int) -> list[str]:
    """Appends this process's `software_environment()` at `step` to workdir/config.json.

    Args:
      workdir: a workdir whose config.json exists.
      step: the step training starts (0) or resumes from.

    Returns:
      `environment_changes` from the last record before this one (empty on a fresh run).
    """
    config = load_run_config(workdir)
    records = config.setdefault("environments", [])
    now = software_environment()
    changes = environment_changes(records[-1], now) if records else []
    records.append({"step": step, **now})
    save_run_config(workdir, config)
    return changes


def _best_metric(metrics: dict[str, float]) -> float:
    return float(metrics.get(BEST_METRIC, float("-inf")))


class _KeptCheckpoints:
    """Which checkpoints a run keeps (an Orbax preservation policy): the last `keep` saved
    on the schedule, any saved off it (by a stop) after the newest of those, and the best
    by `val_bleu` (the newest of tied ones).

    Orbax's LatestN counted a stop's checkpoint among the last `keep`: the stop deleted
    the oldest scheduled one for good, and `evaluate.py`'s average of the last checkpoints
    then took the stop's step in place of it, so a stopped and resumed run scored other
    parameters than one that never stopped."""

    def __init__(self, keep: int):
        self.keep = keep

    def should_preserve(self, checkpoints: Sequence[Any], *, context: Any) -> list[bool]:
        del context
        steps = sorted(((i.step, i.metrics or {}) for i in checkpoints), key=lambda s: s[0])
        last = set(_kept_last(steps, self.keep))
        scored = [(float(m[BEST_METRIC]), step) for step, m in steps if BEST_METRIC in m]
        best = max(scored)[1] if scored else None
        return [info.step in last or info.step == best for info in checkpoints]


def _kept_last(steps: Sequence[tuple[int, dict[str, Any]]], keep: int) -> list[int]:
    """The steps a run keeps as its last ones: its last `keep` checkpoints saved on the
    schedule and any a stop saved after the newest of them.

    Args:
      steps: (step, metrics) of each checkpoint, ascending.
      keep: the run's `keep`.
    """
    scheduled = [step for step, m in steps if INTERIM_METRIC not in m]
    latest, newest = set(scheduled[-keep:]), scheduled[-1] if scheduled else -1
    return [step for step, _ in steps if step in latest or step > newest]


def tree_shapes(tree: PyTree) -> dict[str, tuple[int, ...]]:
    """The shape of every leaf of a parameter pytree, by its path ("encoder/layer_0/...")."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return {
        jax.tree_util.keystr(path, simple=True, separator="/"): tuple(x.shape) for path, x in leaves
    }


def shape_difference(saved: PyTree, wanted: PyTree) -> tuple[str, Any, Any] | None:
    """The first parameter whose shape differs between two pytrees, or None.

    Args:
      saved: parameters (or their metadata) as a checkpoint holds them.
      wanted: parameters (arrays or ShapeDtypeStructs) of the model at hand.

    Returns:
      (name, its shape in `saved`, its shape in `wanted`), "absent" for a missing one.
    """
    got, want = tree_shapes(saved), tree_shapes(wanted)
    for name in sorted(set(got) | set(want)):
        if got.get(name) != want.get(name):
            return name, got.get(name, "absent"), want.get(name, "absent")
    return None


class Checkpoints:
    """The Orbax checkpoints of one workdir: save, list, and restore with fallback.

    Keeps the last `keep` checkpoints plus the one with the best validation
    BLEU (the `val_bleu` metric given to `save`).

    Example:
      ckpts = Checkpoints(workdir, keep=3)
      ckpts.save(step, params, opt_state, {"rng": [...], "data": batcher.state()})
      restored = ckpts.restore_latest(params_like, opt_state_like)
      ckpts.close()

    Args:
      workdir: the run directory; checkpoints go under workdir/checkpoints.
      keep: how many of the most recent checkpoints to keep (>= 1).
      async_save: write in a background thread (the Trainer does), so `save`
        returns at once; `wait` or `close` must then come before the process ends,
        or the checkpoint is lost. False: `save` returns once it is written.
      read_only: never write or delete (for evaluation).
      log: receives one-line warnings (e.g. a damaged checkpoint being skipped).
    """

    def __init__(
        self,
        workdir: str | os.PathLike,
        *,
        keep: int = 3,
        async_save: bool = False,
        read_only: bool = False,
        log: Callable[[str], None] = _stderr,
    ):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.directory = checkpoint_dir(workdir)
        self._log = log
        self._read_only = read_only
        # Before any read: a damaged checkpoint can fail in `item_metadata` (the shape
        # check) as well as in the restore, with the same late reads after it.
        _drop_stray_read_errors()
        policy = _KeptCheckpoints(keep)
        if read_only and not self.directory.is_dir():
            raise CheckpointError(
                f"no checkpoints in {Path(workdir)} ({self.directory} is missing)"
                + training_there(workdir, FIRST_CHECKPOINT)
            )
        _check_metrics_files(workdir, self.directory)
        # Registering the handlers up front lets `item_metadata` read shapes before any restore.
        handlers = {
            "params": ocp.StandardCheckpointHandler(),
            "opt_state": ocp.StandardCheckpointHandler(),
            "meta": ocp.JsonCheckpointHandler(),
        }
        with _quiet_orbax():
            options = ocp.CheckpointManagerOptions(
                preservation_policy=None if read_only else policy,
                # best_fn makes Orbax write each save's metrics; which step is best is
                # BestN's choice above and `best_step`'s (the newest of tied scores).
                best_fn=_best_metric,
                enable_async_checkpointing=async_save and not read_only,
                read_only=read_only,
                create=not read_only,
                # A save killed outside the schedule (SIGKILL after a SIGTERM's save) left
                # its temporary folder for ever: no later save of that step replaced it.
                cleanup_tmp_directories=not read_only,
                step_name_format=_STEP_NAME_FORMAT,
            )
            self._manager = ocp.CheckpointManager(
                self.directory, options=options, item_handlers=handlers
            )

    def steps(self) -> list[int]:
        """Steps with a finished checkpoint, ascending."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest step, or None."""
        return self._manager.latest_step()

    def ranked_steps(self) -> list[int]:
        """The steps with a `val_bleu`, highest first (the newest first among tied ones)."""
        metrics = [(s, self._manager.metrics(s)) for s in self.steps()]
        scored = [(_best_metric(m), s) for s, m in metrics if m and BEST_METRIC in m]
        return [s for _, s in sorted(scored, reverse=True)]

    def best_step(self) -> int | None:
        """The step with the highest `val_bleu` (the newest of tied ones, which BestN keeps),
        or None if no checkpoint has one."""
        ranked = self.ranked_steps()
        return ranked[0] if ranked else None

    def metrics(self, step: int) -> dict[str, float] | None:
        """The metrics saved with `step` (e.g. {"val_bleu": 27.1}), or None."""
        return self._manager.metrics(step)

    def save(
        self,
        step: int,
        params: PyTree,
        opt_state: PyTree,
        meta: dict[str, Any],
        *,
        val_bleu: float | None = None,
        interim: bool = False,
    ) -> None:
        """Writes a checkpoint for `step` (after `step` updates); no-op if it exists.

        The arrays should be unreplicated host values (`jax.device_get`); with
        `async_save` they are written in the background while training goes on.

        Args:
          step: optimizer updates done.
          params: float32 parameter pytree.
          opt_state: optimizer state pytree.
          meta: JSON-serializable dict; "step" is added.
          val_bleu: validation BLEU of these parameters, if measured (used to
            keep the best checkpoint).
          interim: saved off the schedule (by a stop): kept only until the next save on
            the schedule, and not counted among the last `keep`.
        """
        if val_bleu is not None and interim:
            raise ValueError("a checkpoint with a validation BLEU is on the schedule, not interim")
        if step in self._manager.all_steps():
            return
        args = ocp.args.Composite(
            params=ocp.args.StandardSave(params),
            opt_state=ocp.args.StandardSave(opt_state),
            meta=ocp.args.JsonSave({**meta, "step": int(step)}),
        )
        metrics = None if val_bleu is None else {BEST_METRIC: float(val_bleu)}
        if interim:
            metrics = {INTERIM_METRIC: 1.0}
        with _quiet_orbax(), _write_errors(self.directory):
            self._manager.save(step, args=args, metrics=metrics, force=True)

    def record_bleu(self, step: int, val_bleu: float) -> None:
        """Gives the saved checkpoint of `step` the validation BLEU that `save(...,
        val_bleu=)` would have given it (for a validation a stop skipped, run on resume),
        so that it competes for the best."""
        metrics = json.dumps({BEST_METRIC: float(val_bleu)})
        self._rewrite_saved(step, "metrics/metrics", lambda _: metrics)
        self._manager.reload()  # Orbax keeps each step's metrics in memory

    def record_meta(self, step: int, changes: dict[str, Any]) -> None:
        """Rewrites entries of the saved meta item of `step` (as `update_meta` does), for
        what a resume from it must know that was not known at the save (a validation a
        stop skipped has been run since)."""
        merged = lambda path: json.dumps(_merged(path, changes))  # noqa: E731
        self._rewrite_saved(step, f"meta/{_META_FILE}", merged)

    def _rewrite_saved(self, step: int, file: str, content: Callable[[Path], str]) -> None:
        """Replaces `file` (where Orbax's save wrote it) of the saved checkpoint of `step`
        with `content(path)`, written whole by process 0 once the saves are done."""
        self.wait()
        step_dir = ocp.path.step.build_step_path(self.directory, _STEP_NAME_FORMAT, step)
        path = Path(step_dir) / file
        if jax.process_index() == 0:
            with _write_errors(self.directory):
                write_text_atomically(path, content(path))
        ocp.multihost.sync_global_processes(f"rewrite_{file.replace('/', '_')}_{step}")

    def check_compatible(self, step: int, params_like: PyTree) -> None:
        """Raises a one-line CheckpointError if `step`'s parameters do not fit `params_like`.

        Args:
          step: a checkpoint step.
          params_like: a parameter pytree (arrays or ShapeDtypeStructs) of the current model.

        Raises:
          CheckpointError: the shapes differ (not checked where the checkpoint's parameter
            metadata is missing: the restore finds out whether the parameters are there).
        """
        saved = self._saved_tree(step, "params")
        difference = saved is not None and shape_difference(saved, params_like)
        if difference:
            name, there, now = difference
            raise CheckpointError(
                f"checkpoint step {step} in {self.directory} does not match the model config: "
                f"parameter {name} is {there} there but {now} now; resume with the config in "
                f"the workdir's {CONFIG_FILE} or use a new --workdir"
            )

    def _saved_tree(self, step: int, item: str) -> PyTree | None:
        """The metadata tree (shapes, no values) of one item of `step`, or None where its
        metadata file is missing (the restore itself then says whether the item is whole)."""
        with _quiet_orbax():
            saved = self._manager.item_metadata(step)[item]
        tree = getattr(saved, "tree", saved)
        return tree if jax.tree_util.tree_leaves(tree) else None

    def restore(
        self,
        step: int,
        params_like: PyTree,
        opt_state_like: PyTree,
        other_opt_states: Sequence[tuple[PyTree, Callable[[PyTree], PyTree]]] = (),
    ) -> TrainCheckpoint:
        """Restores one training checkpoint onto the structure of the given templates.

        Args:
          step: the step to restore.
          params_like: parameter pytree of the right structure (host values).
          opt_state_like: optimizer state pytree of the right structure.
          other_opt_states: other forms the optimizer state may have been saved in
            (by other training settings), each with the function that turns it into
            the form of `opt_state_like`; the form whose leaves the checkpoint has is
            restored.

        Returns:
          The checkpoint, with host numpy arrays.

        Raises:
          CheckpointError: the shapes do not match the current model, or the optimizer
            state is of none of the given forms.
          Exception: whatever Orbax raises for an unreadable checkpoint.
        """
        self.check_compatible(step, params_like)
        saved = self._saved_tree(step, "opt_state")
        forms = [(opt_state_like, lambda state: state), *other_opt_states]
        if saved is not None:
            forms = [form for form in forms if tree_shapes(form[0]) == tree_shapes(saved)]
        if not forms:
            raise CheckpointError(
                f"checkpoint step {step} in {self.directory} holds an optimizer state of "
                "another form than these training settings make; resume with the settings "
                f"in the workdir's {CONFIG_FILE} or use a new --workdir"
            )
        template, to_this_form = forms[0]
        args = ocp.args.Composite(
            params=ocp.args.StandardRestore(params_like),
            opt_state=ocp.args.StandardRestore(template),
            meta=ocp.args.JsonRestore(),
        )
        restored = self._read(step, args)
        meta = restored["meta"]
        if not isinstance(meta, dict) or "rng" not in meta:  # valid JSON, but not our meta
            raise ValueError(f"its meta item has no RNG key: {str(meta)[:80]}")
        opt_state = to_this_form(restored["opt_state"])
        return TrainCheckpoint(step, restored["params"], opt_state, meta)

    def _read(self, step: int, args: Any) -> Any:
        """Orbax's restore of `step` (the late reads of a failed one are silenced since
        `__init__`)."""
        with _quiet_orbax():
            return self._manager.restore(step, args=args)

    def restore_latest(
        self,
        params_like: PyTree,
        opt_state_like: PyTree,
        other_opt_states: Sequence[tuple[PyTree, Callable[[PyTree], PyTree]]] = (),
    ) -> TrainCheckpoint | None:
        """Restores the newest readable checkpoint, skipping (and reporting) damaged ones.

        Once an older one is restored, the damaged newer ones are renamed to
        `<step>.damaged` (unless read-only), so that training saves those steps
        again instead of finding them taken, and a later resume does not meet
        them again.

        Args:
          params_like: parameter pytree of the right structure.
          opt_state_like: optimizer state pytree of the right structure.
          other_opt_states: as for `restore`.

        Returns:
          The checkpoint, or None when there is none to resume from.

        Raises:
          CheckpointError: the checkpoints belong to another model config,
            every checkpoint is damaged, or a damaged one cannot be renamed.
        """
        steps = self.steps()
        damaged: list[_Unreadable] = []
        for step in reversed(steps):
            try:
                restored = self.restore(step, params_like, opt_state_like, other_opt_states)
            except CheckpointError:
                raise
            except Exception as e:  # noqa: BLE001 - any read failure means "damaged"
                damaged.append(_Unreadable(step, self.directory, e))
                continue
            for unreadable in damaged:
                aside = None if self._read_only else self._set_aside(unreadable.step)
                self._log(unreadable.skipped(older=True, kept_as=aside))
            return restored
        for i, unreadable in enumerate(damaged):
            self._log(unreadable.skipped(older=i + 1 < len(damaged)))
        if steps:
            raise CheckpointError(
                f"every checkpoint in {self.directory} is damaged; delete it to start over"
            )
        return None

    def _set_aside(self, step: int) -> Path:
        """Renames the damaged checkpoint of `step` to `<step>.damaged`, which no listing counts.

        Returns:
          Its new path.

        Raises:
          CheckpointError: it cannot be renamed.
        """
        path = Path(ocp.path.step.build_step_path(self.directory, _STEP_NAME_FORMAT, step))
        aside = name_aside(path, "damaged")  # an earlier one of the same step is kept too
        barrier = f"set_aside_{step}_{next(_set_aside_barriers)}"
        # Every process names it before process 0 renames it: one that came later would
        # find the name taken and log the next one.
        ocp.multihost.sync_global_processes(f"{barrier}_named")
        if jax.process_index() == 0:
            try:
                path.rename(aside)
            except OSError as e:
                raise CheckpointError(
                    f"checkpoint step {step} in {self.directory} is damaged and cannot be "
                    f"renamed to {aside.name} ({e.strerror}); move or delete it, then resume"
                ) from None
        # Every process lists the steps again once it is gone (the barrier is a no-op
        # on one host); one that still listed it would skip saving that step.
        ocp.multihost.sync_global_processes(barrier)
        self._manager.reload()
        return aside

    def restore_params(self, step: int) -> PyTree:
        """Restores only the parameters of `step` (host numpy, float32)."""
        args = ocp.args.Composite(params=ocp.args.StandardRestore())
        return self._read(step, args)["params"]

    def wait(self) -> None:
        """Blocks until a background save has finished."""
        with _write_errors(self.directory):
            self._manager.wait_until_finished()

    def close(self) -> None:
        """Finishes pending saves and releases the manager."""
        with _quiet_orbax(), _write_errors(self.directory):
            self._manager.wait_until_finished()
            self._manager.close()

    def __enter__(self) -> Checkpoints:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_metrics_files(workdir: str | os.PathLike, directory: Path) -> None:
    """A one-line CheckpointError where a checkpoint's metrics file (its validation BLEU)
    is not a JSON object, holds a BLEU that is not a number, or is missing where
    metrics.jsonl logged a BLEU for its step.

    Orbax reads every metrics file when it opens the folder: a damaged one was a
    JSONDecodeError traceback for every command on the run. A missing one made the
    step unscored without a word: not the best any more, and deleted by the next save
    once older than the last `keep`, however high its BLEU."""
    if not directory.is_dir():
        return
    logged = None  # step -> the last BLEU metrics.jsonl logged there, read when needed

    def logged_bleu(step: int) -> float | None:
        nonlocal logged
        if logged is None:
            try:
                records = metrics_records(Path(workdir) / METRICS_FILE)
            except OSError:
                records = []
            logged = {r["step"]: r[BEST_METRIC] for r in records if BEST_METRIC in r}
        return logged.get(step)

    for step in sorted(directory.iterdir()):
        path = step / "metrics" / "metrics"
        if not step.name.isdigit():
            continue
        if not path.is_file():
            if not step.is_dir():  # deleted since it was listed, by a run saving a newer one
                continue
            bleu = logged_bleu(int(step.name))
            if bleu is not None:
                raise CheckpointError(
                    f"checkpoint step {step.name} in {directory} has no metrics file, so "
                    f"its validation BLEU ({bleu}, logged in {METRICS_FILE}) does not count "
                    f'and a later save would delete it; write {{"{BEST_METRIC}": {bleu}}} '
                    f"into {path} (making its folder) and run the same command again"
                )
            continue
        try:
            metrics = json.loads(path.read_text(encoding="utf-8"))
            if isinstance(metrics, dict):
                if BEST_METRIC in metrics:
                    float(metrics[BEST_METRIC])  # ranked as a number at every save and load
                continue
        except (OSError, ValueError, TypeError):
            pass
        bleu = logged_bleu(int(step.name))
        if bleu is not None:
            fix = f'{{"{BEST_METRIC}": {bleu}}} (the BLEU metrics.jsonl logged there)'
        else:
            fix = "{} (metrics.jsonl logged no BLEU there)"
        raise CheckpointError(
            f"checkpoint step {step.name} in {directory} has a damaged metrics file, {path}; "
            f"write {fix} into it and run the same command again"
        )


def metrics_records(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file, in order, skipping lines that are not one.

    A run killed while appending leaves its last line torn
    (`{"step": 31, "elapsed_s": 12.3, "lo`); such a line is no record.

    Raises:
      OSError: the file cannot be read.
    """
    records = []
    for line in Path(path).read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    return records


def _first_line(e: BaseException, limit: int = 200) -> str:
    """The error's first line, cut at a word before `limit` characters ("..." marks the cut)."""
    text = str(e).strip().splitlines()
    if not text:
        return ""
    line = text[0]
    return line if len(line) <= limit else line[:limit].rsplit(" ", 1)[0] + " ..."


def checkpoint_steps(workdir: str | os.PathLike) -> list[int]:
    """The steps with a checkpoint in `workdir`, ascending ([] if none)."""
    if not checkpoint_dir(workdir).is_dir():
        return []
    with Checkpoints(workdir, read_only=True) as ckpts:
        return ckpts.steps()


def _meta_item(workdir: str | os.PathLike, step: int) -> Path:
    """The JSON "meta" item of one finished checkpoint; CheckpointError if there is none."""
    steps = checkpoint_steps(workdir)
    if step not in steps:
        raise CheckpointError(
            f"no checkpoint at step {step} in {checkpoint_dir(workdir)}; available: "
            f"{', '.join(map(str, steps)) or 'none'}"
        )
    return ocp.path.step.build_step_path(checkpoint_dir(workdir), _STEP_NAME_FORMAT, step) / "meta"


def read_meta(workdir: str | os.PathLike, step: int) -> dict[str, Any]:
    """The JSON "meta" item (step, RNG key, data position) of one finished checkpoint.

    Raises:
      CheckpointError: no checkpoint at `step`, or its meta item is no JSON object.
    """
    return _meta_object(
        ocp.JsonCheckpointHandler().restore(_meta_item(workdir, step)), workdir, step
    )


def _meta_object(meta: Any, workdir: str | os.PathLike, step: int) -> dict[str, Any]:
    """`meta`, read from checkpoint `step`'s meta item, if it is a JSON object as a save
    writes; otherwise a one-line CheckpointError (valid JSON, but no save wrote it)."""
    if not isinstance(meta, dict):
        raise CheckpointError(
            f"checkpoint step {step} in {checkpoint_dir(workdir)} has a meta item that is no "
            f"JSON object: {str(meta)[:40]}"
        )
    return meta


def update_meta(workdir: str | os.PathLike, step: int, changes: dict[str, Any]) -> dict[str, Any]:
    """Rewrites entries of the JSON "meta" item of one finished checkpoint, in place.

    For tools that resume a copy of a run with other state (another RNG key);
    the arrays of the checkpoint are left as they are.

    Args:
      workdir: a directory written by train.py.
      step: a step with a checkpoint there.
      changes: JSON-serializable entries that replace (or join) the saved ones.

    Returns:
      The meta item as now saved.

    Raises:
      CheckpointError: no checkpoint at `step`, or its meta item is no JSON object.
    """
    path = _meta_item(workdir, step) / _META_FILE
    saved = _meta_object(json.loads(path.read_text(encoding="utf-8")), workdir, step)
    meta = {**saved, **changes}
    write_text_atomically(path, json.dumps(meta))
    return meta


_META_FILE = "metadata"  # the file of a checkpoint's "meta" item, where Orbax's JsonSave writes it


def _merged(path: Path, changes: dict[str, Any]) -> dict[str, Any]:
    """The JSON object of `path` with `changes` replacing (or joining) its entries."""
    return {**json.loads(path.read_text(encoding="utf-8")), **changes}


class _Unreadable(CheckpointError):
    """One checkpoint could not be read: the error, or with `skipped` the warning of a fallback."""

    def __init__(self, step: int, directory: Path, error: BaseException):
        self.step = step
        self.where = f"checkpoint step {step} in {directory}"
        self.why = f"{type(error).__name__}: {_first_line(error)}"
        super().__init__(f"{self.where} cannot be read ({self.why})")

    def skipped(
        self, *, older: bool, kept_as: Path | None = None, then: str = "the one before it"
    ) -> str:
        """The one-line warning when reading goes on without it.

        Args:
          older: one is left to try.
          kept_as: where the damaged checkpoint was moved, if it was.
          then: which one is tried next, where one is left.
        """
        message = f"{self.where} is damaged and was skipped ({self.why})"
        if kept_as is not None:
            message += f"; kept as {kept_as.name}"
        return message + (f"; trying {then}" if older else "")


class _Deleted(CheckpointError):
    """A checkpoint was deleted while it was read: a train.py still running in the workdir
    deletes the oldest of the checkpoints it keeps as it saves a newer one."""

    def __init__(self, step: int, directory: Path):
        super().__init__(
            f"checkpoint step {step} in {directory} was deleted while it was read (a run "
            "training there keeps only its last checkpoints and its best)"
        )


def _deleted(directory: Path, step: int, wait: float = 0.5) -> bool:
    """Whether checkpoint `step` is gone, or goes within `wait` seconds (a deletion under
    way: Orbax removes a step's files before its folder)."""
    path = ocp.path.step.build_step_path(directory, _STEP_NAME_FORMAT, step)
    deadline = time.monotonic() + wait
    while path.exists():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


def _read_params(ckpts: Checkpoints, step: int) -> PyTree:
    """The float32 host parameters of one step; `_Deleted` where it went while being read,
    `_Unreadable` where it is damaged."""
    try:
        params = ckpts.restore_params(step)
    except Exception as e:  # noqa: BLE001 - any read failure means "damaged"...
        if _deleted(ckpts.directory, step):  # ...unless the checkpoint is not there any more
            raise _Deleted(step, ckpts.directory) from None
        raise _Unreadable(step, ckpts.directory, e) from None
    return jax.tree.map(lambda x: np.asarray(x, np.float32), params)


_T = TypeVar("_T")
_CHOICES = 3  # times a choice of checkpoints is made before a deletion is an error


def _chosen_again_where_deleted(read: Callable[[], _T], log: Callable[[str], None]) -> _T:
    """`read()`, which chooses checkpoints and reads them; made again where one of them was
    deleted as it was read, so that the choice is of the checkpoints there now (evaluating
    a run as it trains: its next save deletes the oldest it keeps, or a former best)."""
    for choice in range(1, _CHOICES + 1):
        try:
            return read()
        except _Deleted as e:
            if choice == _CHOICES:
                raise CheckpointError(
                    f"{e}, {_CHOICES} times in a row; evaluate once that run has stopped"
                ) from None
            log(f"{e}; choosing again from the checkpoints there now")
    raise AssertionError("unreachable")


def restore_params(
    workdir: str | os.PathLike,
    which: str | int = "best",
    *,
    log: Callable[[str], None] = _stderr,
) -> tuple[PyTree, int]:
    """Reads trained parameters from a workdir.

    Args:
      workdir: a directory written by train.py.
      which: "best" (highest validation BLEU, the next best where it is damaged;
        the newest readable if none was scored yet), "last" (newest readable; a
        damaged newest one is reported and the one before it used), or a step number.
      log: receives one-line warnings.

    Returns:
      (params, step): the unreplicated float32 parameter pytree as host numpy
      arrays, for `Transformer(config).apply({"params": params}, ...)`, and the
      step it was saved at.

    Raises:
      CheckpointError: no such checkpoint, or it cannot be read.
    """
    chosen = restore_chosen(workdir, which, log=log)
    return chosen.params, chosen.step


class Chosen(NamedTuple):
    """The parameters `restore_chosen` read, their step, and which checkpoint that is."""

    params: PyTree
    step: int
    label: str  # "best", "last" or the step; what was passed over, where one was damaged


def restore_chosen(
    workdir: str | os.PathLike,
    which: str | int = "best",
    *,
    log: Callable[[str], None] = _stderr,
) -> Chosen:
    """`restore_params`, also saying which checkpoint it read.

    Args:
      workdir, which, log: as for `restore_params`.

    Returns:
      A `Chosen`: the parameters and step `restore_params` returns, and a label that is
      `which` itself, or for "best" and "last" where that one was damaged or none was
      scored, what was read instead ("the best readable: the best, step 300, is damaged").

    Raises:
      CheckpointError: no such checkpoint, or it cannot be read.
    """
    return _chosen_again_where_deleted(lambda: _restore_chosen_once(workdir, which, log), log)


def _restore_chosen_once(
    workdir: str | os.PathLike, which: str | int, log: Callable[[str], None]
) -> Chosen:
    """`restore_chosen` from one listing of the checkpoints; `_Deleted` where the chosen
    one went while it was read."""
    with Checkpoints(workdir, read_only=True, log=log) as ckpts:
        steps = ckpts.steps()
        if not steps:
            raise CheckpointError(
                f"no checkpoints in {ckpts.directory}"
                + (training_there(workdir, FIRST_CHECKPOINT) or "; train with train.py first")
            )
        ranked = ckpts.ranked_steps() if which == "best" else []
        if which == "best":
            # A damaged best checkpoint falls back to the next best readable one, and
            # where no scored one is readable, to the newest readable one.
            candidates = ranked + [s for s in reversed(steps) if s not in ranked]
        elif which == "last":
            candidates = list(reversed(steps))
        else:
            try:
                step = int(which)
            except (TypeError, ValueError):
                raise CheckpointError(
                    f"checkpoint {which!r} is not 'best', 'last' or a step number"
                ) from None
            if step not in steps:
                raise CheckpointError(
                    f"no checkpoint at step {step} in {ckpts.directory}; available: "
                    f"{', '.join(map(str, steps))}"
                )
            candidates = [step]
        for step, after in zip(candidates, [*candidates[1:], None], strict=True):
            try:
                params = _read_params(ckpts, step)
            except _Unreadable as e:
                if after is None:
                    raise
                then = "the one before it"
                if which == "best":
                    then = "the next best" if after in ranked else "the newest one left"
                log(e.skipped(older=True, then=then))
                continue
            return Chosen(params, step, _choice_label(which, step, steps[-1], ranked))
    raise AssertionError("unreachable")


def _choice_label(which: str | int, step: int, newest: int, ranked: list[int]) -> str:
    """Which checkpoint `restore_chosen` read, where it is not plainly `which`."""
    newest_label = "the newest" if step == newest else "the newest readable"
    if which == "last" and step != newest:
        return f"the newest readable: the last, step {newest}, is damaged"
    if which == "best" and not ranked:
        return f"{newest_label}: no checkpoint has a validation BLEU"
    if which == "best" and step != ranked[0]:
        # the next best readable, or the newest readable where no scored one could be read
        taken = "the best readable" if step in ranked else newest_label
        return f"{taken}: the best, step {ranked[0]}, is damaged"
    return str(which)


def restore_last(
    workdir: str | os.PathLike, k: int, *, log: Callable[[str], None] = _stderr
) -> tuple[list[PyTree], list[int]]:
    """Reads the parameters of a workdir's last `k` checkpoints (for averaging).

    Args:
      workdir: a directory written by train.py.
      k: how many checkpoints, counted back from the newest.
      log: receives one-line warnings.

    Returns:
      (params, steps): one float32 parameter pytree per checkpoint, as
      `restore_params` returns it, and their steps, ascending.

    Raises:
      ValueError: `k` is below 1.
      CheckpointError: no checkpoint directory, fewer than `k` checkpoints, more than
        the run keeps of its last ones (the rest is its best, from before them), one
        that cannot be read, or parameters of different shapes.
    """
    if k < 1:
        raise ValueError(f"k, the number of checkpoints to read, must be at least 1; got {k!r}")
    return _chosen_again_where_deleted(lambda: _restore_last_once(workdir, k, log), log)


def _restore_last_once(
    workdir: str | os.PathLike, k: int, log: Callable[[str], None]
) -> tuple[list[PyTree], list[int]]:
    """`restore_last` from one listing of the checkpoints; `_Deleted` where one of the
    last `k` went while it was read."""
    # One manager lists the steps once and reads all k of them.
    with Checkpoints(workdir, read_only=True, log=log) as ckpts:
        steps = ckpts.steps()
        if len(steps) < k:
            raise CheckpointError(
                f"cannot average the last {k} checkpoints: {workdir} has "
                f"{len(steps)} ({', '.join(map(str, steps)) or 'none'})"
                + training_there(workdir, f"evaluate once it has saved {k}, or average fewer")
            )
        try:
            keep = kept_last(load_run_config(workdir))
        except CheckpointError:  # no config.json: the checkpoints alone are averaged
            keep = None
        # The run keeps its last `keep` scheduled checkpoints (and a stop's after them) and
        # its best: an older one is that best, and with it the average would reach back
        # past the checkpoints deleted between.
        kept = steps
        if keep is not None:
            kept = _kept_last([(step, ckpts.metrics(step) or {}) for step in steps], keep)
        if k > len(kept):
            older = ", ".join(str(s) for s in steps if s < kept[0])
            raise CheckpointError(
                f"cannot average the last {k} checkpoints of {workdir}: the run keeps its "
                f"last {len(kept)} ({', '.join(map(str, kept))}), and {older} only as its "
                f"best; average at most {len(kept)}, or evaluate the best with --checkpoint best"
            )
        chosen = steps[-k:]
        try:
            trees = [_read_params(ckpts, step) for step in chosen]
        except _Unreadable as e:
            raise CheckpointError(
                f"{e}; an average of the last {k} needs every one of them: resume training "
                "(train.py sets a damaged newest checkpoint aside), or evaluate others "
                "(evaluate.py --checkpoint STEP, or --average-last K)"
            ) from None
    for step, tree in zip(chosen[1:], trees[1:], strict=True):
        difference = shape_difference(tree, trees[0])
        if difference:
            name, there, first = difference
            raise CheckpointError(
                f"cannot average checkpoints {chosen[0]} and {step} of {workdir}: parameter "
                f"{name} is {first} in {chosen[0]} but {there} in {step} (a checkpoint of "
                "another model); evaluate them one by one with --checkpoint STEP"
            )
    return trees, chosen


def kept_last(config: dict[str, Any]) -> int | None:
    """How many of its last checkpoints a run keeps, from its config.json's dict
    (`load_run_config`); None where that does not say (an edited config)."""
    keep = (config.get("train") or {}).get("keep_checkpoints")
    return keep if isinstance(keep, int) and keep >= 1 else None


def average_params(params_list: Sequence[PyTree]) -> PyTree:
    """Elementwise mean of parameter pytrees of one structure (checkpoint averaging).

    Args:
      params_list: one or more parameter pytrees.

    Returns:
      The float32 average, as host numpy arrays.
    """
    if not params_list:
        raise ValueError("average_params needs at least one parameter tree")
    total = jax.tree.map(lambda x: np.asarray(x, np.float64), params_list[0])
    for params in params_list[1:]:
        total = jax.tree.map(lambda t, x: t + np.asarray(x, np.float64), total, params)
    return jax.tree.map(lambda t: (t / len(params_list)).astype(np.float32), total)
