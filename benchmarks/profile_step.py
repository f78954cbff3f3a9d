"""Where the training step's time goes: XLA ops of the compiled step, summed by kind.

    python benchmarks/profile_step.py                  # default preset, train_speed's shape
    python benchmarks/profile_step.py --preset base --top 30

Traces a few steps of the pmapped train step (the shape and preset of
`benchmarks/train_speed.py`) with `jax.profiler`, reads the Perfetto trace it
writes, and sums the duration of every XLA op event per op name (only the innermost
ones: a `while` op's event spans those of its body's ops). It prints the total
per step of matmul ops against all other ops, then the time and count of each
kind of op (the name without its number), then the slowest single ops. An op
counts as a matmul if it is a dot or convolution, or a fusion whose fused
computation holds one (read from the compiled step's HLO): XLA:CPU runs matmuls
as YNNPACK fusions ("ynn_fusion.N"), but it runs some reductions that way too.
Op durations on different cores overlap, so the sums can exceed wall time.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import sys
import tempfile
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.train_speed import (  # noqa: E402
    add_step_shape_arguments,
    check_preset_names,
    check_step_shape_arguments,
    make_step_inputs,
    step_config,
    step_rows,
)
from train import DEFAULT_PRESET  # noqa: E402
from transformer.host_memory import keep_freed_host_memory  # noqa: E402

_MATMUL_MARKERS = ("dot", "matmul", "gemm", "convolution")
# Trace events that are not XLA ops: the Python/runtime scaffolding around them.
_SKIP_PREFIXES = (
    "$",
    "end:",
    "PjitFunction",
    "PmapFunction",
    "Execute",
    "Thunk",
    "SlinkyThreadPool",
    "PythonRefManager",
    "CommonPjRt",
    "ParseArguments",
    "DevicePut",
    "Wait for donation holds",
    "Wait for usage holds",
    "Handle input",
    "AllocateOutputBuffers",
    "ThreadpoolListener",
)


def op_durations(trace_dir: Path) -> tuple[dict[str, float], dict[str, int]]:
    """The leaf op events of the Perfetto trace under `trace_dir`: see `leaf_op_durations`."""
    paths = sorted(trace_dir.rglob("perfetto_trace.json.gz"))
    if not paths:
        raise SystemExit(f"error: jax.profiler wrote no perfetto_trace.json.gz under {trace_dir}")
    with gzip.open(paths[-1], "rt") as f:
        trace = json.load(f)
    return leaf_op_durations(trace["traceEvents"] if isinstance(trace, dict) else trace)


def leaf_op_durations(events: list[dict]) -> tuple[dict[str, float], dict[str, int]]:
    """(microseconds, count) per op name of the complete ("X") op events that hold no other.

    An op that runs others, a `while` around its body's ops or a `call`, has an
    event spanning theirs on the same thread: counting it as well would count
    that time twice, so only the innermost op events count. Events that are not
    XLA ops (`_SKIP_PREFIXES`) are dropped first, so the runtime's events around
    a whole program do not hide its ops.

    Args:
      events: Chrome/Perfetto trace events, dicts with "ph", "name", "pid",
        "tid", "ts" and "dur" (microseconds).

    Returns:
      (total microseconds per op name, events per op name).
    """
    threads: dict[tuple, list[dict]] = collections.defaultdict(list)
    for event in events:
        if event.get("ph") == "X" and not event.get("name", "").startswith(_SKIP_PREFIXES):
            threads[event.get("pid"), event.get("tid")].append(event)
    totals: dict[str, float] = collections.defaultdict(float)
    counts: dict[str, int] = collections.Counter()
    for ops in threads.values():
        # A thread's events nest: sorted by start (the outer first on a tie), an event
        # that starts before the innermost open one ends lies inside it.
        ops.sort(key=lambda e: (float(e["ts"]), -float(e.get("dur", 0.0))))
        holds_others = [False] * len(ops)
        open_ops: list[tuple[int, float]] = []  # (index, end time), innermost last
        for i, event in enumerate(ops):
            start = float(event["ts"])
            while open_ops and open_ops[-1][1] <= start:
                open_ops.pop()
            if open_ops:
                holds_others[open_ops[-1][0]] = True
            open_ops.append((i, start + float(event.get("dur", 0.0))))
        for event, skip in zip(ops, holds_others, strict=True):
            if not skip:
                totals[event["name"]] += float(event.get("dur", 0.0))
                counts[event["name"]] += 1
    return totals, counts


def matmul_fusions(hlo_text: str) -> set[str]:
    """Names of the fusion ops in compiled HLO text whose computation holds a dot or convolution.

    Args:
      hlo_text: `jax.stages.Compiled.as_text()` of a compiled program.

    Returns:
      The instruction names ("ynn_fusion.72", ...) of those fusions, nested
      computations included.
    """
    holds_matmul: set[str] = set()
    calls: dict[str, set[str]] = collections.defaultdict(set)
    fusion_calls: dict[str, str] = {}
    computation = None
    for line in hlo_text.splitlines():
        header = re.match(r"(?:ENTRY )?%([\w.\-]+) .*\{$", line)
        if header:
            computation = header.group(1)
            continue
        if computation is None:
            continue
        if re.search(r"= \S+ (?:dot|convolution)\(", line):
            holds_matmul.add(computation)
        callee = re.search(r"calls=%([\w.\-]+)", line)
        if callee:
            calls[computation].add(callee.group(1))
            fusion = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = .* fusion\(", line)
            if fusion:
                fusion_calls[fusion.group(1)] = callee.group(1)
    changed = True
    while changed:  # a computation holds a matmul if one it calls does
        changed = False
        for caller, callees in calls.items():
            if caller not in holds_matmul and callees & holds_matmul:
                holds_matmul.add(caller)
                changed = True
    return {name for name, callee in fusion_calls.items() if callee in holds_matmul}


def is_matmul(name: str, fusions: set[str]) -> bool:
    """Whether a trace op is a matrix multiply: a dot-like op, or one of `fusions`."""
    if name in fusions:
        return True
    lowered = name.lower()
    return "fusion" not in lowered and any(marker in lowered for marker in _MATMUL_MARKERS)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default=None, help="model preset [train.py's default]")
    add_step_shape_arguments(parser)
    parser.add_argument("--steps", type=int, default=5, help="traced steps")
    parser.add_argument("--top", type=int, default=20, help="slowest ops to list")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.top < 1:
        parser.error("--top must be at least 1")
    check_step_shape_arguments(parser, args)
    if args.preset is not None:
        check_preset_names(parser, "--preset", [args.preset])
    keep_freed_host_memory()  # before the first computation starts XLA's threads
    preset = args.preset or DEFAULT_PRESET
    rows = step_rows(parser, args.rows, args.src_len, args.tgt_len)
    cfg = step_config(preset, args)
    step, state, batch = make_step_inputs(cfg, rows, args.src_len, args.tgt_len)
    # Compiled once, here: the traced program is the one whose HLO names the matmul fusions.
    step = step.lower(state, batch).compile()
    fusions = matmul_fusions(step.as_text())
    for _ in range(3):  # warm up outside the trace
        state, metrics = step(state, batch)
    jax.block_until_ready(metrics)

    with tempfile.TemporaryDirectory() as tmp:
        jax.profiler.start_trace(tmp, create_perfetto_trace=True)
        for _ in range(args.steps):
            state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        jax.profiler.stop_trace()
        totals, counts = op_durations(Path(tmp))

    per_step_ms = {name: us / 1e3 / args.steps for name, us in totals.items()}
    by_kind_ms: dict[str, float] = collections.defaultdict(float)
    by_kind_count: dict[str, int] = collections.Counter()
    for name, ms in per_step_ms.items():
        kind = re.sub(r"\.\d+$", "", name)  # "ynn_fusion.374" -> "ynn_fusion"
        by_kind_ms[kind] += ms
        by_kind_count[kind] += counts[name]
    matmul = sum(ms for name, ms in per_step_ms.items() if is_matmul(name, fusions))
    other = sum(ms for name, ms in per_step_ms.items() if not is_matmul(name, fusions))
    print(
        f"{preset}: {rows} x ({args.src_len} src + {args.tgt_len} tgt) tokens, "
        f"{jax.local_device_count()} device(s), {args.steps} traced steps"
    )
    print(
        f"op time per step: matmul {matmul:.1f} ms, other {other:.1f} ms "
        f"(matmul share {matmul / max(matmul + other, 1e-9):.1%})"
    )
    print(f"op kinds by time (ms per step, ops per step), the first {args.top}:")
    for kind, ms in sorted(by_kind_ms.items(), key=lambda item: -item[1])[: args.top]:
        print(f"  {kind:<40}  {ms:8.2f}  {by_kind_count[kind] / args.steps:6.0f}")
    print(f"slowest {args.top} ops (ms per step):")
    ranked = sorted(per_step_ms.items(), key=lambda item: -item[1])[: args.top]
    width = max((len(name) for name, _ in ranked), default=0)
    for name, ms in ranked:
        kind = "matmul" if is_matmul(name, fusions) else "other"
        print(f"  {name:<{width}}  {ms:8.2f}  {kind}")


if __name__ == "__main__":
    main()
