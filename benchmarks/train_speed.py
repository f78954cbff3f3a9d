"""Speed of the training step: tokens/s, model FLOPs, measured peak matmul FLOP/s, utilization.

    python benchmarks/train_speed.py                        # default preset and base
    python benchmarks/train_speed.py --presets mini,small --steps 20

For each preset it times the pmapped train step (forward, backward, the
default's AdamW update, dropout on) at one fixed batch shape with no padding, so
every position is a real target token. Model FLOPs are counted from the matmuls of the
architecture (forward x 3 for forward + backward; embedding lookups, softmax,
layer norm and the optimizer are not counted, as is usual for utilization).
The peak is the best FLOP/s of a large matmul in the step's matmul dtype
(float32, or bfloat16 operands with `--matmul-dtype bfloat16`; both accumulate
in float32), timed on the same devices at the start and after every 5 timed
steps, so through the same minutes as the steps. It also reports how many batch
shapes the default data pipeline compiles on Multi30k and the compile time of
the first step.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from train import DATA_DEFAULTS, DEFAULT_PRESET, TRAIN_DEFAULTS  # noqa: E402
from transformer import Transformer, TransformerConfig  # noqa: E402
from transformer.host_memory import keep_freed_host_memory  # noqa: E402
from transformer.training import (  # noqa: E402
    TrainConfig,
    create_train_state,
    make_optimizer,
    make_train_step,
    replicate,
)

REPO = Path(__file__).resolve().parents[1]


def model_flops_per_step(cfg: TransformerConfig, rows: int, src_len: int, tgt_len: int) -> float:
    """Matmul FLOPs of one training step (forward + backward = 3 x forward).

    Args:
      cfg: the model config.
      rows: sentences in the global batch.
      src_len: source positions per sentence.
      tgt_len: target positions per sentence.

    Returns:
      FLOPs (a multiply-add counts 2).
    """
    d, f, b, s, t = cfg.d_model, cfg.d_ff, rows, src_len, tgt_len
    encoder_layer = 4 * 2 * b * s * d * d + 2 * 2 * b * s * s * d + 2 * 2 * b * s * d * f
    decoder_layer = (
        4 * 2 * b * t * d * d  # self-attention Q, K, V, O
        + 2 * 2 * b * t * t * d  # self-attention scores and weighted values
        + 2 * 2 * b * t * d * d  # cross-attention Q, O
        + 2 * 2 * b * s * d * d  # cross-attention K, V
        + 2 * 2 * b * t * s * d  # cross-attention scores and weighted values
        + 2 * 2 * b * t * d * f  # feed-forward
    )
    output_projection = 2 * b * t * d * cfg.vocab_size
    forward = (
        cfg.num_encoder_layers * encoder_layer
        + cfg.num_decoder_layers * decoder_layer
        + output_projection
    )
    return 3.0 * forward


def make_peak_probe(size: int, dtype: str = "float32") -> Callable[[], float]:
    """A function that times one [size, size] @ [size, size] matmul on each device.

    Args:
      size: the matrices' size.
      dtype: the operands' dtype; the product accumulates in float32, as the
        step's matmuls do.

    Returns:
      probe(): the FLOP/s of one such matmul per device, summed over devices.
    """
    n = jax.local_device_count()
    keys = jax.random.split(jax.random.key(0), n)
    a = jax.pmap(lambda k: jax.random.normal(k, (size, size), dtype))(keys)
    matmul = jax.pmap(lambda x: jnp.dot(x, x, preferred_element_type=jnp.float32))
    matmul(a).block_until_ready()

    def probe() -> float:
        start = time.perf_counter()
        matmul(a).block_until_ready()
        return n * 2.0 * size**3 / (time.perf_counter() - start)

    return probe


def default_rows(src_len: int, tgt_len: int) -> int:
    """Sentences per step that train.py's default token budget holds at these lengths."""
    return DATA_DEFAULTS["max_tokens"] // (src_len + tgt_len)


def step_rows(parser: argparse.ArgumentParser, rows: int | None, src_len: int, tgt_len: int) -> int:
    """--rows, or `default_rows` rounded down to a whole number per local device; a --rows
    that the devices cannot split evenly is a usage error (pmap gives each rows / devices,
    and the figures count them all). Starts JAX's backend: call it after
    `keep_freed_host_memory`."""
    n = jax.local_device_count()
    if rows is None:
        return max(n, default_rows(src_len, tgt_len) // n * n)
    if rows % n:
        parser.error(f"--rows {rows} is not a multiple of the {n} local devices, which share it")
    return rows


def add_step_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds --vocab-size, --rows, --src-len, --tgt-len and --matmul-dtype: the measured step.

    Shared by the benchmarks that time or trace this step, so that they measure
    the same one. --rows is None unless given; `step_rows` fills it in.
    """
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=DATA_DEFAULTS["vocab_size"],
        help="vocabulary size [train.py's default]",
    )
    parser.add_argument(
        "--rows",
        type=int,
        help="sentences per step [as many as train.py's default token budget holds]",
    )
    parser.add_argument("--src-len", type=int, default=16)
    parser.add_argument("--tgt-len", type=int, default=16)
    parser.add_argument(
        "--matmul-dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="the dtype the step's matmul operands are rounded to, and the peak's [float32]",
    )


def check_step_shape_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exits with a usage error where a size of `add_step_shape_arguments` is below 1, or
    the vocabulary has no id past the four special ones (the batch draws ids 4..)."""
    for name in ("vocab_size", "rows", "src_len", "tgt_len"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.vocab_size is not None and args.vocab_size < 5:
        parser.error("--vocab-size must be at least 5 (ids 0-3 are padding, unknown, start, end)")


def check_preset_names(parser: argparse.ArgumentParser, flag: str, names: list[str]) -> None:
    """Exits with a usage error naming the first of `names` that is no preset."""
    for name in names:
        try:
            TransformerConfig.check_preset_name(name)
        except ValueError as e:
            parser.error(f"{flag}: {e}")


def step_config(preset: str, args: argparse.Namespace) -> TransformerConfig:
    """The measured step's model: a preset with --vocab-size and --matmul-dtype."""
    matmul_dtype = None if args.matmul_dtype == "float32" else args.matmul_dtype
    return TransformerConfig.preset(preset, vocab_size=args.vocab_size, matmul_dtype=matmul_dtype)


def make_step_inputs(cfg: TransformerConfig, rows: int, src_len: int, tgt_len: int):
    """The pmapped train step, a replicated fresh state and one batch without padding.

    Returns:
      (step, state, batch), ready for `state, metrics = step(state, batch)`.
    """
    model = Transformer(cfg)
    # The default's optimizer: AdamW with train.py's weight decay.
    recipe = TrainConfig(steps=1000, warmup_steps=1000, weight_decay=TRAIN_DEFAULTS["weight_decay"])
    optimizer = make_optimizer(recipe, cfg.d_model)
    state = replicate(create_train_state(model, optimizer, seed=0))
    step = make_train_step(model, optimizer, label_smoothing=0.1, pad_id=cfg.pad_id)
    n = jax.local_device_count()
    if rows % n:  # each device would get rows // n: the step would not be the one measured
        raise ValueError(f"rows ({rows}) must be a multiple of the {n} local devices")
    rng = np.random.default_rng(0)

    def tokens(length):  # real tokens everywhere: ids 4.. (0-3 are pad/unk/bos/eos)
        return rng.integers(4, cfg.vocab_size, (n, rows // n, length), dtype=np.int32)

    batch = {"src": tokens(src_len), "tgt_in": tokens(tgt_len), "tgt_out": tokens(tgt_len)}
    return step, state, batch


def time_train_step(
    cfg: TransformerConfig,
    rows: int,
    src_len: int,
    tgt_len: int,
    steps: int,
    between_steps: Callable[[], object] = lambda: None,
    every: int = 5,
) -> tuple[float, float]:
    """Compiles and times the train step at one shape.

    Args:
      cfg: the model config.
      rows: sentences in the global batch.
      src_len: source positions per sentence.
      tgt_len: target positions per sentence.
      steps: timed steps.
      between_steps: called after every `every` timed steps, outside the timing
        (the benchmark samples the peak matmul there, so the peak and the steps
        are measured through the same minutes).
      every: steps run back to back between calls of `between_steps`.

    Returns:
      (seconds of the first call, compile included; median seconds per later step).
    """
    step, state, batch = make_step_inputs(cfg, rows, src_len, tgt_len)
    start = time.perf_counter()
    state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    first = time.perf_counter() - start
    times = []
    for i in range(steps):
        start = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
        if (i + 1) % every == 0:
            between_steps()
    return first, float(np.median(times))


def default_pipeline_shapes(train) -> str:
    """How many batch shapes the default pipeline makes on `train`, Multi30k en-de's."""
    import tempfile

    import data

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = data.load_or_train_tokenizer(
            tmp, train, vocab_size=DATA_DEFAULTS["vocab_size"], model_type="bpe"
        )
        encoded = data.encode_corpus(tokenizer, train, max_len=data.DEFAULT_MAX_LEN, cache_dir=tmp)
    batcher = data.TokenBatcher(
        encoded,
        max_tokens=DATA_DEFAULTS["max_tokens"],
        num_devices=jax.local_device_count(),
        pad_id=tokenizer.pad_id,
        bos_id=tokenizer.bos_id,
    )
    return (
        f"{batcher.num_shapes} batch shapes (so {batcher.num_shapes} compiled train-step "
        f"programs), padding efficiency {batcher.padding_efficiency():.1%}"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--presets",
        default=f"{DEFAULT_PRESET},base",
        help=f"comma-separated presets [train.py's default, {DEFAULT_PRESET}, and base]",
    )
    add_step_shape_arguments(parser)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per preset")
    parser.add_argument("--matmul-size", type=int, default=2048)
    parser.add_argument("--data-dir", default=str(REPO.parent / "shared" / "data" / "multi30k"))
    args = parser.parse_args(argv)
    presets = args.presets.split(",")
    # Checked before anything is timed, not when a misspelt preset's turn comes.
    check_preset_names(parser, "--presets", presets)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    check_step_shape_arguments(parser, args)
    if args.matmul_size < 1:
        parser.error("--matmul-size must be at least 1")
    train = None
    if Path(args.data_dir).is_dir():  # read before the timing, so that an error comes first
        import data

        spec = data.CorpusSpec(dataset="files", data_dir=args.data_dir, src="en", tgt="de")
        try:
            train = data.load_corpus(spec, "train")
        except data.DataError as e:
            parser.error(f"--data-dir: {e}")
    keep_freed_host_memory()  # before the first computation starts XLA's threads
    # 2048 // (16 + 16) = 64 with the defaults
    args.rows = step_rows(parser, args.rows, args.src_len, args.tgt_len)

    devices = jax.local_devices()
    print(f"devices: {len(devices)} x {devices[0].device_kind} ({jax.default_backend()})")
    # The peak is sampled at the start and after every 5 timed steps (not after
    # each: its 48 MB of operands would evict the step's data from the cache), and
    # the best sample is used: on a shared machine a peak timed only once may
    # come from a slow (or a fast) minute that the steps did not see.
    probe = make_peak_probe(args.matmul_size, args.matmul_dtype)
    peaks = [probe() for _ in range(5)]
    shape = f"{args.rows} x ({args.src_len} src + {args.tgt_len} tgt) tokens"
    results = []
    for name in presets:
        print(f"{name}: compiling, then timing {args.steps} steps ...", flush=True)
        cfg = step_config(name, args)
        first, seconds = time_train_step(
            cfg,
            args.rows,
            args.src_len,
            args.tgt_len,
            args.steps,
            between_steps=lambda: peaks.append(probe()),
        )
        flops = model_flops_per_step(cfg, args.rows, args.src_len, args.tgt_len)
        results.append((name, first, seconds, flops))
    peak = max(peaks)
    print(
        f"peak matmul: {peak / 1e9:.1f} GFLOP/s ({args.matmul_size}^3 {args.matmul_dtype}, "
        f"the best of {len(peaks)} timed through the run; "
        f"their median {np.median(peaks) / 1e9:.1f})"
    )
    for name, first, seconds, flops in results:
        tokens_per_s = args.rows * args.tgt_len / seconds
        utilization = flops / seconds / peak
        # A small --matmul-size times a peak below what the step's larger matmuls reach.
        beyond = " (over 100%: raise --matmul-size for a true peak)" if utilization > 1 else ""
        print(
            f"{name}: {shape}: first step (compile) {first:.1f} s; {seconds * 1e3:.0f} ms/step; "
            f"{tokens_per_s:,.0f} target tokens/s; {flops / 1e9:.1f} GFLOP/step; "
            f"{flops / seconds / 1e9:.1f} GFLOP/s; utilization {utilization:.1%}{beyond}"
        )
    if train is not None:
        print(f"default pipeline on Multi30k en-de: {default_pipeline_shapes(train)}")


if __name__ == "__main__":
    main()
