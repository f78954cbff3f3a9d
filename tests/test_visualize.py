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


def test_a_long_title_is_whole_inside_a_tall_narrow_plot(tmp_path, drawn):
    # Centred over the axes of a narrow figure, it was cut off on the left
    # ("ntence_0002: decoder layer 1 ...").
    rng = np.random.default_rng(0)
    src = ["\u2581Zwei", "\u2581Hunde", ".", "</s>"]
    tgt = [f"\u2581w{i}" for i in range(40)]
    weights_HTS = rng.dirichlet(np.ones(len(src)), size=(4, len(tgt)))
    plot_sentence_attention([weights_HTS], src, tgt, tmp_path, name="sentence_0002", heads=True)
    titles = [
        "sentence_0002: decoder layer 1 cross-attention (mean of 4 heads)",
        "sentence_0002: decoder layer 1 cross-attention per head",
    ]
    for fig, title in zip(drawn, titles, strict=True):
        fig.canvas.draw()
        [text] = [t for t in fig.findobj(Text) if " ".join(t.get_text().split()) == title]
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
