"""The "Attention Is All You Need" encoder-decoder Transformer as pure Flax linen modules.

Every concept of the paper is a public name here: `TransformerConfig`,
`sinusoidal_positional_encoding`, `scaled_dot_product_attention`,
`MultiHeadAttention`, `FeedForward`, `EncoderLayer`, `DecoderLayer`, `Encoder`,
`Decoder` and `Transformer`, with the boolean masks `causal_mask` and
`padding_mask` (True where attention may look), and the searches `beam_search`
and `greedy_search` (from `transformer.decoding`).
"""

from transformer.attention import MultiHeadAttention, scaled_dot_product_attention
from transformer.config import TransformerConfig
from transformer.decoding import beam_search, greedy_search
from transformer.model import (
    Decoder,
    DecoderLayer,
    Encoder,
    EncoderLayer,
    FeedForward,
    Transformer,
    causal_mask,
    padding_mask,
    sinusoidal_positional_encoding,
)

__all__ = [
    "Decoder",
    "DecoderLayer",
    "Encoder",
    "EncoderLayer",
    "FeedForward",
    "MultiHeadAttention",
    "Transformer",
    "TransformerConfig",
    "beam_search",
    "causal_mask",
    "greedy_search",
    "padding_mask",
    "scaled_dot_product_attention",
    "sinusoidal_positional_encoding",
]
