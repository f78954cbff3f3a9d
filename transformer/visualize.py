"""Encoder-decoder attention pictures: which source tokens each output token looked at.

The weights come from a teacher-forced pass over a (decoded) target: every
`MultiHeadAttention` sows its weights [batch, heads, queries, keys] into the
"intermediates" collection, and the decoder's cross-attention query at
position t is the one that produced output token t.
"""

from __future__ import annotations

import functools
import math
import os
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from data.text import write_atomically

_CMAP = "viridis"


def _figure(figsize: tuple[float, float]) -> Figure:
    """A figure drawn by Agg on its own, not through pyplot: importing or plotting here
    changes no process-wide state (the backend of a notebook's `plt.show()`)."""
    fig = Figure(figsize=figsize, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _suptitle(fig: Figure, title: str, fontsize: float) -> None:
    """The figure's title, wrapped to its width: a long one on a narrow (tall) plot was
    centred over the axes and cut off on the left."""
    # DejaVu Sans averages about 0.55 em a character; 0.65 leaves a margin.
    chars = max(20, int(fig.get_figwidth() * 72 / (0.65 * fontsize)))
    fig.suptitle(textwrap.fill(title, chars), fontsize=fontsize)


def _save_png(fig: Figure, path: str | os.PathLike, dpi: int) -> None:
    """Saves `fig` as a PNG at `path` through a temporary file, so that an interrupted
    save leaves the old picture or none, never half of one."""
    write_atomically(path, lambda f: fig.savefig(f, dpi=dpi, format="png"))


@functools.partial(jax.jit, static_argnums=0)
def _intermediates(model: nn.Module, params: Any, src_BS: jax.Array, tgt_in_BT: jax.Array):
    """The teacher-forced pass's "intermediates" collection, compiled as one program (run op
    by op, a sentence took about 4 s on a 2-core CPU, most of it compiling each op)."""
    _, state = model.apply({"params": params}, src_BS, tgt_in_BT, mutable=["intermediates"])
    return state["intermediates"]


def cross_attention_weights(
    model: nn.Module, params: Any, src_BS: jax.Array, tgt_out_BT: jax.Array, *, bos_id: int
) -> list[np.ndarray]:
    """Cross-attention weights of every decoder layer for given outputs.

    Args:
      model: the encoder-decoder module (its decoder layers are
        `decoder/layer_{i}/cross_attention`).
      params: its parameters.
      src_BS: int source ids [batch, src_len], padding on the right.
      tgt_out_BT: int output ids [batch, tgt_len] (a hypothesis followed by
        the end token, then padding).
      bos_id: start token, fed before the first output.

    Returns:
      One float32 array [batch, heads, tgt_len, src_len] per decoder layer:
      row t is the attention of the query that predicted output token t.
    """
    tgt_out_BT = jnp.asarray(tgt_out_BT, jnp.int32)
    tgt_in_BT = jnp.concatenate(
        [jnp.full((tgt_out_BT.shape[0], 1), bos_id, jnp.int32), tgt_out_BT[:, :-1]], axis=1
    )
    decoder = _intermediates(model, params, jnp.asarray(src_BS, jnp.int32), tgt_in_BT)["decoder"]
    layers = sorted((k for k in decoder if k.startswith("layer_")), key=lambda k: int(k[6:]))
    return [np.asarray(decoder[k]["cross_attention"]["attention_weights"][0]) for k in layers]


def _draw(
    ax,
    weights_TS: np.ndarray,
    src_tokens: Sequence[str],
    tgt_tokens: Sequence[str],
    *,
    vmax: float,
    xlabel: bool = True,
    ylabel: bool = True,
):
    # Token strings are SentencePiece pieces as they are: U+2581 marks a word start.
    image = ax.imshow(weights_TS, cmap=_CMAP, vmin=0.0, vmax=vmax, aspect="auto")
    ax.set_xticks(range(len(src_tokens)), list(src_tokens), rotation=90)
    ax.set_yticks(range(len(tgt_tokens)), list(tgt_tokens))
    ax.tick_params(axis="both", labelsize=8, length=0)
    if xlabel:
        ax.set_xlabel("source tokens")
    if ylabel:
        ax.set_ylabel("output tokens")
    return image


def _size(n_src: int, n_tgt: int) -> tuple[float, float]:
    """Figure size in inches giving every token row and column about a quarter inch."""
    return max(5.0, 0.26 * n_src + 2.5), max(3.0, 0.26 * n_tgt + 2.0)


def plot_attention(
    weights_TS: np.ndarray,
    src_tokens: Sequence[str],
    tgt_tokens: Sequence[str],
    path: str | os.PathLike,
    *,
    title: str,
) -> None:
    """Writes one attention heatmap as a PNG: output tokens as rows, source tokens as columns.

    Args:
      weights_TS: attention weights [tgt_len, src_len] (e.g. averaged over heads).
      src_tokens: the src_len source token strings (column labels).
      tgt_tokens: the tgt_len output token strings (row labels).
      path: the PNG file to write (exactly this name; no suffix is added).
      title: figure title (e.g. which sentence and layer).
    """
    fig = _figure(_size(len(src_tokens), len(tgt_tokens)))
    ax = fig.subplots()
    # The colour scale ends at the largest weight: averaged heads rarely come near 1.
    image = _draw(ax, weights_TS, src_tokens, tgt_tokens, vmax=float(weights_TS.max()) or 1.0)
    fig.colorbar(image, ax=ax, shrink=0.8, label="attention weight")
    _suptitle(fig, title, fontsize=10)
    _save_png(fig, path, dpi=120)


def plot_attention_heads(
    weights_HTS: np.ndarray,
    src_tokens: Sequence[str],
    tgt_tokens: Sequence[str],
    path: str | os.PathLike,
    *,
    title: str,
) -> None:
    """Writes a grid of per-head attention heatmaps with one shared colour scale as a PNG.

    Args:
      weights_HTS: attention weights [heads, tgt_len, src_len].
      src_tokens: the src_len source token strings (column labels).
      tgt_tokens: the tgt_len output token strings (row labels).
      path: the PNG file to write.
      title: figure title; each panel is titled with its head.
    """
    heads = weights_HTS.shape[0]
    cols = math.ceil(math.sqrt(heads))
    rows = math.ceil(heads / cols)
    width, height = _size(len(src_tokens), len(tgt_tokens))
    fig = _figure((width * cols, height * rows))
    axes = fig.subplots(rows, cols, squeeze=False)
    for h, ax in enumerate(axes.flat):
        if h >= heads:
            ax.axis("off")
            continue
        image = _draw(
            ax,
            weights_HTS[h],
            src_tokens,
            tgt_tokens,
            vmax=float(weights_HTS.max()) or 1.0,
            xlabel=h + cols >= heads,
            ylabel=h % cols == 0,
        )
        ax.set_title(f"head {h + 1}", fontsize=10)
    _suptitle(fig, title, fontsize=12)
    fig.colorbar(image, ax=axes, shrink=0.6, label="attention weight")
    _save_png(fig, path, dpi=100)


def plot_sentence_attention(
    layer_weights: Sequence[np.ndarray],
    src_tokens: Sequence[str],
    tgt_tokens: Sequence[str],
    out_dir: str | os.PathLike,
    *,
    name: str,
    heads: bool = False,
) -> list[str]:
    """Writes the cross-attention pictures of one sentence, one PNG per decoder layer.

    Args:
      layer_weights: per layer, weights [heads, tgt_len, src_len] for this
        sentence (padding already cut off).
      src_tokens: source token strings (src_len).
      tgt_tokens: output token strings (tgt_len).
      out_dir: directory to write into (created if missing).
      name: file name stem and title prefix, e.g. "sentence_001".
      heads: also write a per-head grid per layer.

    Returns:
      The paths written.
    """
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for layer, weights_HTS in enumerate(layer_weights, start=1):
        path = os.path.join(out_dir, f"{name}_layer{layer}.png")
        title = f"{name}: decoder layer {layer} cross-attention (mean of {len(weights_HTS)} heads)"
        plot_attention(weights_HTS.mean(axis=0), src_tokens, tgt_tokens, path, title=title)
        paths.append(path)
        if heads:
            path = os.path.join(out_dir, f"{name}_layer{layer}_heads.png")
            title = f"{name}: decoder layer {layer} cross-attention per head"
            plot_attention_heads(weights_HTS, src_tokens, tgt_tokens, path, title=title)
            paths.append(path)
    return paths


def png_path(path: str | os.PathLike) -> Path:
    """The file a PNG plot named `path` is written to.

    Decided here, not by matplotlib, which would append ".png" to a name without
    a suffix and switch to another format for another suffix, so that a caller
    can report the file that is really written.

    Args:
      path: the name asked for.

    Returns:
      `path` if it ends in .png (any case), else `path` with ".png" appended.

    Raises:
      ValueError: `path` is a directory (or ends in a separator), or has a suffix
        other than .png; the message starts with `path`.
    """
    name = os.fspath(path)
    if name.endswith(("/", os.sep)) or Path(name).is_dir():
        raise ValueError(f"{name} names a directory; name a .png file")
    suffix = Path(name).suffix
    if suffix in ("", "."):  # "." is the suffix of "curve." from Python 3.14 on
        return Path(name + ("png" if name.endswith(".") else ".png"))
    if suffix.lower() != ".png":
        raise ValueError(f"{name}: the plot is a PNG; name a .png file, not a {suffix} one")
    return Path(name)


def plot_training_curve(records: Sequence[dict[str, float]], path: str | os.PathLike) -> str:
    """Training loss and validation BLEU against training time, as one PNG.

    Args:
      records: the lines of a run's metrics.jsonl (`read_metrics`): training
        records carry "loss", validation records "val_loss" and maybe
        "val_bleu"; all carry "elapsed_s".
      path: the file to write, named as :func:`png_path` says (.png added to a
        name without a suffix).

    Returns:
      The path written.

    Raises:
      ValueError: `path` is not a PNG name (see :func:`png_path`), or no record
        has a training loss and a time.
    """
    path = png_path(path)
    train = [r for r in records if "loss" in r and "elapsed_s" in r]
    if not train:
        raise ValueError("metrics.jsonl has no training records with a time yet")
    path.parent.mkdir(parents=True, exist_ok=True)
    val = [r for r in records if "val_loss" in r and "elapsed_s" in r]
    bleu = [r for r in records if "val_bleu" in r and "elapsed_s" in r]
    minutes = lambda rs: [r["elapsed_s"] / 60 for r in rs]  # noqa: E731
    fig = _figure((7.5, 4.2))
    loss_ax = fig.subplots()
    # One record (a run between its first and second log) is a line of no length: a dot.
    loss_ax.plot(
        minutes(train),
        [r["loss"] for r in train],
        "." if len(train) == 1 else "-",
        color="tab:blue",
        label="train loss",
    )
    if val:
        loss_ax.plot(
            minutes(val), [r["val_loss"] for r in val], "o-", color="tab:cyan", label="val loss"
        )
    loss_ax.set_xlabel("training time (minutes)")
    loss_ax.set_ylabel("loss (label-smoothed cross-entropy)")
    loss_ax.grid(alpha=0.3)
    handles, labels = loss_ax.get_legend_handles_labels()
    if bleu:
        bleu_ax = loss_ax.twinx()
        bleu_ax.plot(
            minutes(bleu), [r["val_bleu"] for r in bleu], "s-", color="tab:red", label="val BLEU"
        )
        bleu_ax.set_ylabel("validation BLEU (sacreBLEU, greedy)")
        more_handles, more_labels = bleu_ax.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    # Below the axes, not in them, where it would cover the points of some runs.
    fig.legend(handles, labels, loc="outside lower center", ncols=len(handles), frameon=False)
    loss_ax.set_title(f"{train[-1]['step']:.0f} steps in {train[-1]['elapsed_s'] / 60:.1f} min")
    _save_png(fig, path, dpi=120)
    return str(path)
