"""Cross-attention extraction and the attention heatmaps."""

import jax
import jax.numpy as jnp
import numpy as np
from matplotlib import image as mpimg

from transformer import Transformer, TransformerConfig
from transformer.visualize import cross_attention_weights, plot_sentence_attention

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


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
