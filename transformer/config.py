"""The model's hyperparameters: one frozen dataclass, with the paper's presets."""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

import jax.numpy as jnp
import numpy as np

from transformer.dropout import check_rate

# Section 3 and Table 3 of "Attention Is All You Need".
_PRESETS: dict[str, dict[str, Any]] = {
    "base": dict(
        d_model=512,
        num_heads=8,
        d_ff=2048,
        num_encoder_layers=6,
        num_decoder_layers=6,
        dropout_rate=0.1,
    ),
    "big": dict(
        d_model=1024,
        num_heads=16,
        d_ff=4096,
        num_encoder_layers=6,
        num_decoder_layers=6,
        dropout_rate=0.3,
    ),
    # A wider Multi30k-sized model (the first default; see README).
    "small": dict(
        d_model=256,
        num_heads=4,
        d_ff=1024,
        num_encoder_layers=3,
        num_decoder_layers=3,
        dropout_rate=0.1,
        max_len=128,
    ),
    # The Multi30k default on a 2-core CPU: narrow and a little deeper, so twice the
    # epochs of `small` fit in the hour (chosen by experiment; see README).
    "mini": dict(
        d_model=128,
        num_heads=4,
        d_ff=512,
        num_encoder_layers=4,
        num_decoder_layers=4,
        dropout_rate=0.1,
        max_len=128,
    ),
    # Small enough that a test compiles and runs it in well under a second.
    "tiny": dict(
        d_model=32,
        num_heads=4,
        d_ff=64,
        num_encoder_layers=2,
        num_decoder_layers=2,
        dropout_rate=0.1,
        max_len=64,
    ),
}

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Hyperparameters of the encoder-decoder Transformer; the defaults are the `base`
    preset (the sizes and dropout of the paper's base model).

    Attributes:
      vocab_size: number of token ids (source and target share one vocabulary).
      d_model: width of every residual stream and embedding.
      num_heads: attention heads h; each has size d_model / h.
      d_ff: inner width of the position-wise feed-forward network.
      num_encoder_layers: N for the encoder stack.
      num_decoder_layers: N for the decoder stack.
      dropout_rate: P_drop on sub-layer outputs and on embeddings + positions
        (applied rounded to a multiple of 1/256: see transformer/dropout.py).
      attention_dropout_rate: dropout on the attention weights (0 in the paper).
      max_len: longest sequence (in tokens) the model is meant for; the data
        pipeline drops longer training pairs. Positional encodings are computed
        for whatever length a call needs, so decoding may go past it.
      share_embeddings: one matrix for source embedding, target embedding and
        the pre-softmax projection (paper 3.4).
      attention_bias: biases on the attention projections W^Q, W^K, W^V and
        W^O. The paper's have none (section 3.2.2); False gives its model.
        On by default: without them the default scored lower on Multi30k val
        (benchmarks/EXPERIMENTS.md).
      pre_layer_norm: False is the paper's post-LN, x = LN(x + sublayer(x));
        True is pre-LN, x = x + sublayer(LN(x)), which trains more stably.
      dtype: compute dtype name ("float32", "bfloat16" or "float16"); parameters
        are always stored in float32 and softmax runs in float32.
      matmul_dtype: the dtype every matmul's operands are rounded to, forward
        and backward; the products accumulate in float32 and come back in
        `dtype`. None takes them as they are, in `dtype`. "bfloat16" with the
        float32 `dtype` is mixed precision in the matmuls alone: layer norm,
        softmax, the loss and the gradients stay float32. It runs the step
        faster on CPUs with AMX or AVX512-BF16 (benchmarks/EXPERIMENTS.md).
      pad_id: the padding token id; masks are derived from it.
    """

    vocab_size: int
    d_model: int = 512
    num_heads: int = 8
    d_ff: int = 2048
    num_encoder_layers: int = 6
    num_decoder_layers: int = 6
    dropout_rate: float = 0.1
    attention_dropout_rate: float = 0.0
    max_len: int = 256
    share_embeddings: bool = True
    attention_bias: bool = True
    pre_layer_norm: bool = False
    dtype: str = "float32"
    matmul_dtype: str | None = None
    pad_id: int = 0

    def __post_init__(self):
        for name in (
            "vocab_size",
            "d_model",
            "num_heads",
            "d_ff",
            "num_encoder_layers",
            "num_decoder_layers",
            "max_len",
            "pad_id",
        ):
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool):
                raise ValueError(f"{name} must be an integer, got {value!r}")
            if value < 1 and name != "pad_id":
                raise ValueError(f"{name} must be >= 1, got {value}")
            object.__setattr__(self, name, int(value))  # a NumPy integer as Python's, for JSON
        for name in ("share_embeddings", "attention_bias", "pre_layer_norm"):
            value = getattr(self, name)
            if not isinstance(value, bool | np.bool_):
                raise ValueError(f"{name} must be True or False, got {value!r}")
            object.__setattr__(self, name, bool(value))
        for name in ("dropout_rate", "attention_dropout_rate"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Real) or isinstance(value, bool):
                raise ValueError(f"{name} must be a number, got {value!r}")
            check_rate(value, name)
            object.__setattr__(self, name, float(value))
        if not 0 <= self.pad_id < self.vocab_size:  # an id past the table embeds as NaN
            raise ValueError(f"pad_id must be in [0, vocab_size), got {self.pad_id}")
        if self.d_model % self.num_heads:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by num_heads ({self.num_heads})"
            )
        for name in ("dtype", "matmul_dtype"):
            value = getattr(self, name)
            if value not in _DTYPES and not (name == "matmul_dtype" and value is None):
                raise ValueError(f"{name} must be one of {sorted(_DTYPES)}, got {value!r}")

    @property
    def d_head(self) -> int:
        """Size of one attention head, d_k = d_v = d_model / h."""
        return self.d_model // self.num_heads

    @property
    def compute_dtype(self) -> jnp.dtype:
        """The jnp dtype that activations are computed in."""
        return _DTYPES[self.dtype]

    @property
    def matmul_operand_dtype(self) -> jnp.dtype | None:
        """The jnp dtype matmul operands are rounded to; None when they are not."""
        return None if self.matmul_dtype is None else _DTYPES[self.matmul_dtype]

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> TransformerConfig:
        """Builds a named preset ("base", "big", "small", "mini", "tiny"), with field overrides.

        Args:
          name: preset name.
          **overrides: any field, e.g. `vocab_size=8000`, `dropout_rate=0.2`.

        Returns:
          The config.
        """
        cls.check_preset_name(name)
        return cls(**{**_PRESETS[name], **overrides})

    @staticmethod
    def preset_names() -> list[str]:
        """The names `preset` accepts."""
        return sorted(_PRESETS)

    @staticmethod
    def check_preset_name(name: str) -> None:
        """Raises ValueError, naming the presets, where `name` is not one of them."""
        if name not in _PRESETS:
            names = ", ".join(sorted(_PRESETS))
            raise ValueError(f"unknown preset {name!r}; choose from {names}")

    def replace(self, **changes: Any) -> TransformerConfig:
        """Returns a copy with some fields changed (e.g. `dropout_rate=0.0`)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serializable dict of every field."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TransformerConfig:
        """Inverse of `to_dict`; unknown keys are an error."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown TransformerConfig fields: {', '.join(unknown)}")
        return cls(**d)
