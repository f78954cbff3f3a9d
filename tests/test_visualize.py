"""Cross-attention extraction and the attention heatmaps."""

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from matplotlib import image as mpimg
from matplotlib.text import Text

from transformer import Transformer, TransformerConfig
from transformer.visualize import (
    cross_attention_weights,
    plot_attention,
    plot_sentence_attention,
    plot_training_curve,
    png_path,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def drawn(monkeypatch):
    """The figures the plotting functions draw, in order, kept instead of saved."""
    import transformer.visualize as visualize

    figures = []
    monkeypatch.setattr(visualize, "_save_png", lambda fig, path, dpi: figures.append(fig))
    return figures


def test_cross_attention_weights_are_distributions_over_real_source_tokens():
    config = TransformerConfig.preset("tiny", vocab_size=20)
    model = Transformer(config)
    src = jnp.array([[5, 6, 7, 3], [8, 3, 0, 0]], jnp.int32)
    tgt_out = jnp.array([[9, 10, 3], [11, 3, 0]], jnp.int32)
    params = model.init(jax.random.key(0), src, tgt_out)["params"]
    layers = cross_attention_weights(model, params, src, tgt_out, bos_id=2)
    assert len(layers) == config.num_decoder_layers
    for weights in layers:
        assert weights.shape == (2, config.num_heads, 3, 4)
        np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-5)
        assert np.all(weights[1, :, :, 2:] == 0.0)  # source padding gets no attention
    assert not np.allclose(layers[0], layers[1])  # each layer its own
    # Row t is the query that predicts tgt_out[t], fed [bos] + tgt_out[:t]: a change to the
    # last token reaches no row, a change to the first every row after the first.
    last = cross_attention_weights(model, params, src, tgt_out.at[0, 2].set(12), bos_id=2)
    first = cross_attention_weights(model, params, src, tgt_out.at[0, 0].set(12), bos_id=2)
    for weights, with_last, with_first in zip(layers, last, first, strict=True):
        np.testing.assert_array_equal(with_last, weights)
        np.testing.assert_array_equal(with_first[:, :, 0], weights[:, :, 0])
        assert not np.allclose(with_first[0, :, 1:], weights[0, :, 1:])
    # The first row is the query fed bos_id: another start token changes it.
    other_start = cross_attention_weights(model, params, src, tgt_out, bos_id=4)
    assert not np.allclose(other_start[0][:, :, 0], layers[0][:, :, 0])


def test_the_layers_come_in_the_order_of_their_numbers(monkeypatch):
    # Sorted as strings, a model of 12 decoder layers would have layer_10 drawn third.
    import transformer.visualize as visualize

    sown = {
        f"layer_{i}": {"cross_attention": {"attention_weights": (np.full(1, i),)}}
        for i in range(12)
    }
    monkeypatch.setattr(visualize, "_intermediates", lambda *args: {"decoder": sown})
    layers = cross_attention_weights(None, None, np.ones((1, 2)), np.ones((1, 2)), bos_id=2)
    assert [int(weights[0]) for weights in layers] == list(range(12))


def test_plots_are_readable_pngs(tmp_path):
    rng = np.random.default_rng(0)
    src = ["\u2581Two", "\u2581dogs", "\u2581play", ".", "</s>"]
    tgt = ["\u2581Zwei", "\u2581Hunde", "\u2581spielen", ".", "</s>"]
    layers = [rng.dirichlet(np.ones(len(src)), size=(4, len(tgt))) for _ in range(2)]
    paths = plot_sentence_attention(layers, src, tgt, tmp_path / "plots", name="s1", heads=True)
    assert [p.rsplit("/", 1)[1] for p in paths] == [
        "s1_layer1.png",
        "s1_layer1_heads.png",
        "s1_layer2.png",
        "s1_layer2_heads.png",
    ]
    for path in paths:
        with open(path, "rb") as f:
            assert f.read(8) == PNG_SIGNATURE
        pixels = mpimg.imread(path)
        assert pixels.ndim == 3 and min(pixels.shape[:2]) >= 300
        assert pixels.std() > 0.05


def test_png_path_is_the_file_really_written(tmp_path):
    assert png_path(tmp_path / "curve") == tmp_path / "curve.png"
    assert png_path(f"{tmp_path}/curve.") == tmp_path / "curve.png"
    assert png_path(tmp_path / "curve.PNG") == tmp_path / "curve.PNG"
    assert png_path("v1.2.png") == Path("v1.2.png")
    for name, message in [
        (str(tmp_path), "names a directory"),
        (f"{tmp_path}/new/", "names a directory"),
        (f"{tmp_path}/curve.svg", "the plot is a PNG; name a .png file, not a .svg one"),
        (f"{tmp_path}/run.v2", "not a .v2 one"),
    ]:
        with pytest.raises(ValueError, match=message) as e:
            png_path(name)
        assert str(e.value).startswith(name)


def test_plots_go_to_exactly_the_path_returned(tmp_path):
    records = [{"step": s, "loss": 5.0 - s, "elapsed_s": 60.0 * s} for s in (1, 2, 3)]
    written = plot_training_curve(records, tmp_path / "curves" / "curve")
    assert written == str(tmp_path / "curves" / "curve.png")
    with open(written, "rb") as f:
        assert f.read(8) == PNG_SIGNATURE
    with pytest.raises(ValueError, match="curve.pdf: the plot is a PNG"):
        plot_training_curve(records, tmp_path / "curve.pdf")
    # A PNG under the name given, even without a suffix (matplotlib would add one).
    plot_attention(np.eye(2), ["a", "b"], ["c", "d"], tmp_path / "bare", title="t")
    assert (tmp_path / "bare").read_bytes()[:8] == PNG_SIGNATURE
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bare", "curves"]


def test_an_interrupted_save_leaves_the_old_picture_whole(tmp_path, monkeypatch):
    # savefig wrote straight into the file: a Ctrl-C in it left half a PNG where a good
    # one had been (the README's curve is redrawn over its old file).
    records = [{"step": s, "loss": 5.0 - s, "elapsed_s": 60.0 * s} for s in (1, 2, 3)]
    path = plot_training_curve(records, tmp_path / "curve.png")
    old = Path(path).read_bytes()
    from matplotlib.figure import Figure

    def interrupted(self, fname, **kwargs):
        Path(fname).write_bytes(PNG_SIGNATURE)  # the first bytes, then the interrupt
        raise KeyboardInterrupt

    monkeypatch.setattr(Figure, "savefig", interrupted)
    with pytest.raises(KeyboardInterrupt):
        plot_training_curve(records[:2], tmp_path / "curve.png")
    assert Path(path).read_bytes() == old
    assert [p.name for p in tmp_path.iterdir()] == ["curve.png"]  # no temporary file left


def test_the_curve_legend_covers_no_plotted_point(drawn):
    # The legend sat inside the axes ("center right"), where a short run's points can be.
    records = []
    for step in range(1, 21):  # a training loss through the middle, right edge included
        records.append({"step": step, "loss": 4.0, "elapsed_s": 30.0 * step})
        if step % 2 == 0:  # a validation loss, and BLEU every other one (--bleu-every)
            val = {"val_loss": 2.0 + 4 * (step % 4 == 0)} | (
                {"val_bleu": 1.5 * step} if step % 4 == 0 else {}
            )
            records.append({"step": step, "elapsed_s": 30.0 * step, **val})
    plot_training_curve(records, "unused.png")
    [fig] = drawn
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    [legend] = fig.legends or [a.get_legend() for a in fig.axes if a.get_legend()]
    box = legend.get_window_extent(renderer)
    points = np.concatenate(
        [line.get_transform().transform(line.get_xydata()) for ax in fig.axes for line in ax.lines]
    )
    assert len(points) == 20 + 10 + 5  # training loss, validation loss, BLEU
    inside = (box.x0 <= points[:, 0]) & (points[:, 0] <= box.x1)
    inside &= (box.y0 <= points[:, 1]) & (points[:, 1] <= box.y1)
    assert not inside.any(), points[inside]
    # Below the axes and their labels: placed at the figure's foot without room made for it
    # ("lower center"), it covered the x axis's label.
    assert box.y1 <= min(ax.get_tightbbox(renderer).y0 for ax in fig.axes)


def test_a_run_with_one_training_record_draws_its_point(drawn):
    # A line through one point has no length: it was an empty plot with a legend.
    plot_training_curve([{"step": 50, "elapsed_s": 12.0, "loss": 5.1}], "unused.png")
    [fig] = drawn
    [line] = [line for ax in fig.axes for line in ax.lines]
    assert line.get_xydata().tolist() == [[0.2, 5.1]]
    assert line.get_marker() not in (None, "", " ", "None", "none")


def test_a_heatmap_draws_the_mean_of_the_heads_outputs_as_rows(tmp_path, drawn):
    # Drawn transposed, or from one head under a "mean of 4 heads" title, it passed.
    rng = np.random.default_rng(0)
    src = ["\u2581Two", "\u2581dogs", "\u2581play", ".", "</s>"]
    tgt = ["\u2581Zwei", "\u2581Hunde", "</s>"]
    weights_HTS = rng.dirichlet(np.ones(len(src)), size=(4, len(tgt)))
    plot_sentence_attention([weights_HTS], src, tgt, tmp_path, name="s1", heads=True)
    mean, grid = drawn
    [image] = mean.axes[0].images
    np.testing.assert_allclose(np.asarray(image.get_array()), weights_HTS.mean(axis=0))
    assert [t.get_text() for t in mean.axes[0].get_xticklabels()] == src
    assert [t.get_text() for t in mean.axes[0].get_yticklabels()] == tgt
    heads = [np.asarray(ax.images[0].get_array()) for ax in grid.axes if ax.images]
    for head, weights_TS in zip(heads, weights_HTS, strict=True):
        np.testing.assert_allclose(head, weights_TS)
    # Colours run up to the largest weight drawn: the mean's, and one scale for all heads
    # (a head on its own scale cannot be compared with the others).
    assert image.get_clim() == (0.0, weights_HTS.mean(axis=0).max())
    assert {ax.images[0].get_clim() for ax in grid.axes if ax.images} == {(0.0, weights_HTS.max())}


def test_importing_and_plotting_leave_the_matplotlib_backend_alone(tmp_path):
    # The import switched the whole process to Agg: a notebook's plt.show() showed nothing.
    code = (
        "import matplotlib, numpy as np\n"
        "from transformer.visualize import plot_attention\n"
        f"plot_attention(np.eye(2), ['a', 'b'], ['c', 'd'], {str(tmp_path / 'a.png')!r}, "
        "title='t')\n"
        "print(matplotlib.get_backend())\n"
    )
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "MPLBACKEND": "svg"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["svg"]
    assert (tmp_path / "a.png").read_bytes()[:8] == PNG_SIGNATURE


def _unwrapped(title: str) -> str:
    """A title as one line again: textwrap broke it at spaces and after hyphens."""
    return title.replace("-\n", "-").replace("\n", " ")


# evaluate.py's names, and a longer one: its title on one line is wider than the figure
# (the first one's just fits, so a title left unwrapped passed).
@pytest.mark.parametrize("name", ["sentence_0002", "newstest2014_sentence_0002"])
def test_a_long_title_is_whole_inside_a_tall_narrow_plot(tmp_path, drawn, name):
    # Centred over the axes of a narrow figure, it was cut off on the left
    # ("ntence_0002: decoder layer 1 ...").
    rng = np.random.default_rng(0)
    src = ["\u2581Zwei", "\u2581Hunde", ".", "</s>"]
    tgt = [f"\u2581w{i}" for i in range(40)]
    weights_HTS = rng.dirichlet(np.ones(len(src)), size=(4, len(tgt)))
    plot_sentence_attention([weights_HTS], src, tgt, tmp_path, name=name, heads=True)
    titles = [
        f"{name}: decoder layer 1 cross-attention (mean of 4 heads)",
        f"{name}: decoder layer 1 cross-attention per head",
    ]
    for fig, title in zip(drawn, titles, strict=True):
        fig.canvas.draw()
        # Wrapped at spaces and after hyphens ("cross-" and "attention" on two lines).
        [text] = [t for t in fig.findobj(Text) if _unwrapped(t.get_text()) == title]
        box, page = text.get_window_extent(), fig.bbox
        assert page.x0 <= box.x0 and box.x1 <= page.x1, (box, page)
        assert page.y0 <= box.y0 and box.y1 <= page.y1, (box, page)


@pytest.mark.parametrize("heads", [8, 3, 1])  # base: 8 heads, a 3 x 3 grid with one spare
def test_the_heads_grid_draws_each_head_once_with_labels_on_its_outer_panels(
    tmp_path, drawn, heads
):
    rng = np.random.default_rng(0)
    src, tgt = ["\u2581Zwei", "\u2581Hunde", "</s>"], ["\u2581Two", "\u2581dogs", "</s>"]
    weights_HTS = rng.dirichlet(np.ones(len(src)), size=(heads, len(tgt)))
    plot_sentence_attention([weights_HTS], src, tgt, tmp_path, name="s1", heads=True)
    grid = drawn[1]
    cols = int(np.ceil(np.sqrt(heads)))
    panels = [ax for ax in grid.axes if ax.get_label() != "<colorbar>"]
    assert len(panels) == cols * int(np.ceil(heads / cols))
    shown = [ax for ax in panels if ax.axison]
    assert [ax.get_title() for ax in shown] == [f"head {h + 1}" for h in range(heads)]
    for h, ax in enumerate(shown):
        np.testing.assert_allclose(np.asarray(ax.images[0].get_array()), weights_HTS[h])
    assert not any(ax.images for ax in panels[heads:])  # the spare panels are blank
    # Source labels under the lowest panel of each column, output labels left of each row.
    lowest = {max(h for h in range(heads) if h % cols == c) for c in range(min(cols, heads))}
    assert {h for h, ax in enumerate(shown) if ax.get_xlabel()} == lowest
    assert {h for h, ax in enumerate(shown) if ax.get_ylabel()} == set(range(0, heads, cols))


def _curve_lines(fig):
    """{label: [[minutes, value], ...]} of every line drawn on the curve's axes."""
    return {line.get_label(): line.get_xydata().tolist() for ax in fig.axes for line in ax.lines}


def test_the_curve_draws_each_kind_of_record_at_its_own_minutes(drawn):
    # Training records every minute; each validation (its record written 30 s after its
    # step's), BLEU at the later two: each line at its own records' times, BLEU on an axis of
    # its own, every line named in the legend.
    validations = {2: {"val_loss": 5.5}, 4: {"val_loss": 4.5, "val_bleu": 7.0}}
    validations[6] = {"val_loss": 4.0, "val_bleu": 9.0}
    records = []
    for s in range(1, 7):
        records.append({"step": s, "loss": 6.0 - s / 2, "elapsed_s": 60.0 * s})
        if s in validations:
            records.append({"step": s, "elapsed_s": 60.0 * s + 30, **validations[s]})
    plot_training_curve(records, "unused.png")
    [fig] = drawn
    loss_ax, bleu_ax = fig.axes
    assert _curve_lines(fig) == {
        "train loss": [[s, 6.0 - s / 2] for s in range(1, 7)],
        "val loss": [[2.5, 5.5], [4.5, 4.5], [6.5, 4.0]],
        "val BLEU": [[4.5, 7.0], [6.5, 9.0]],
    }
    assert [line.get_label() for line in bleu_ax.lines] == ["val BLEU"]
    assert loss_ax.get_xlabel() == "training time (minutes)"
    assert loss_ax.get_ylabel() == "loss (label-smoothed cross-entropy)"
    assert bleu_ax.get_ylabel() == "validation BLEU (sacreBLEU, greedy)"
    [legend] = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == ["train loss", "val loss", "val BLEU"]
    # The steps and time of the last training record (not the validation after it).
    assert loss_ax.get_title() == "6 steps in 6.0 min"


def test_a_run_without_validation_draws_its_training_loss_alone(drawn):
    # No BLEU axis and no legend entry for lines that have no points.
    records = [{"step": s, "loss": 5.0 - s, "elapsed_s": 30.0 * s} for s in (1, 2)]
    plot_training_curve(records, "unused.png")
    [fig] = drawn
    [loss_ax] = fig.axes
    [line] = loss_ax.lines
    assert line.get_xydata().tolist() == [[0.5, 4.0], [1.0, 3.0]]
    assert line.get_linestyle() == "-"  # two records are a line, not two dots
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["train loss"]


def test_validation_without_bleu_draws_no_bleu_axis(drawn):
    # --bleu-every 0: validation losses only, and no empty BLEU axis or legend entry.
    records = [
        {"step": 1, "loss": 5.0, "elapsed_s": 60.0},
        {"step": 1, "elapsed_s": 90.0, "val_loss": 4.5},
    ]
    plot_training_curve(records, "unused.png")
    [fig] = drawn
    assert len(fig.axes) == 1 and _curve_lines(fig) == {
        "train loss": [[1.0, 5.0]],
        "val loss": [[1.5, 4.5]],
    }
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["train loss", "val loss"]


def test_a_run_with_one_validation_draws_its_loss_and_bleu(drawn):
    records = [
        {"step": 1, "loss": 5.0, "elapsed_s": 60.0},
        {"step": 2, "loss": 4.0, "elapsed_s": 120.0},
        {"step": 2, "elapsed_s": 150.0, "val_loss": 4.5, "val_bleu": 3.0},
    ]
    plot_training_curve(records, "unused.png")
    [fig] = drawn
    lines = _curve_lines(fig)
    assert lines["val loss"] == [[2.5, 4.5]] and lines["val BLEU"] == [[2.5, 3.0]]


def test_records_without_a_time_are_left_out_and_none_leaves_no_folder(tmp_path, drawn):
    # metrics.jsonl of a run begun before elapsed_s was logged (c88c33b), then resumed: its
    # first records have no time to draw them at (a KeyError before).
    untimed = [{"step": 1, "loss": 5.0}, {"step": 1, "val_loss": 4.9, "val_bleu": 1.0}]
    timed = [
        {"step": 2, "loss": 4.0, "elapsed_s": 60.0},
        {"step": 2, "val_loss": 4.5, "val_bleu": 2.0, "elapsed_s": 90.0},
    ]
    plot_training_curve(untimed + timed, "unused.png")
    assert _curve_lines(drawn[0]) == {
        "train loss": [[1.0, 4.0]],
        "val loss": [[1.5, 4.5]],
        "val BLEU": [[1.5, 2.0]],
    }
    # Nothing to draw: the error, and no folder made for a picture that was not written.
    with pytest.raises(ValueError, match="no training records with a time"):
        plot_training_curve(untimed, tmp_path / "plots" / "curve.png")
    assert list(tmp_path.iterdir()) == []


def test_each_head_panel_labels_its_source_columns_and_output_rows(tmp_path, drawn):
    # The grid's panels had no check of their tick labels (source and output swapped passed).
    rng = np.random.default_rng(0)
    src = ["\u2581Zwei", "\u2581Hunde", "\u2581spielen", "</s>"]
    tgt = ["\u2581Two", "\u2581dogs", "</s>"]
    weights_HTS = rng.dirichlet(np.ones(len(src)), size=(3, len(tgt)))
    plot_sentence_attention([weights_HTS], src, tgt, tmp_path, name="s1", heads=True)
    mean, grid = drawn
    panels = [mean.axes[0]] + [ax for ax in grid.axes if ax.images]
    assert len(panels) == 4
    for ax in panels:
        assert [t.get_text() for t in ax.get_xticklabels()] == src
        assert [t.get_text() for t in ax.get_yticklabels()] == tgt
        # Upright, source pieces side by side overlap one another.
        assert {t.get_rotation() for t in ax.get_xticklabels()} == {90.0}
    assert (mean.axes[0].get_xlabel(), mean.axes[0].get_ylabel()) == (
        "source tokens",
        "output tokens",
    )
    # Each of the 2 x 2 panels as large as the one heatmap of the mean.
    np.testing.assert_allclose(grid.get_size_inches(), 2 * mean.get_size_inches())


def test_the_titles_name_the_sentence_the_layer_and_the_number_of_heads(tmp_path, drawn):
    # 3 heads and 5 source tokens: a title counting anything else says so.
    rng = np.random.default_rng(0)
    src = ["\u2581Two", "\u2581dogs", "\u2581play", ".", "</s>"]
    tgt = ["\u2581Zwei", "</s>"]
    layers = [rng.dirichlet(np.ones(len(src)), size=(3, len(tgt))) for _ in range(2)]
    plot_sentence_attention(layers, src, tgt, tmp_path, name="s7", heads=True)
    assert [_unwrapped(fig.get_suptitle()) for fig in drawn] == [
        "s7: decoder layer 1 cross-attention (mean of 3 heads)",
        "s7: decoder layer 1 cross-attention per head",
        "s7: decoder layer 2 cross-attention (mean of 3 heads)",
        "s7: decoder layer 2 cross-attention per head",
    ]
