"""TransformerConfig: the frozen description of every model (target, draft, teacher, student)."""

from __future__ import annotations

import dataclasses
from typing import Any

_DTYPES = ('float32', 'bfloat16', 'float16')


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Llama-style decoder hyper-parameters; validated on construction."""

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    max_len: int
    rope_theta: float = 10000.0
    tie_embeddings: bool = True
    norm_eps: float = 1e-6
    dtype: str = 'float32'  # compute dtype of activations; logits and softmax are always float32
    param_dtype: str = 'float32'  # storage dtype of parameters

    def __post_init__(self):
        for name in (
            'vocab_size',
            'd_model',
            'n_layers',
            'n_heads',
            'n_kv_heads',
            'd_ff',
            'max_len',
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f'TransformerConfig.{name} must be a positive int, got {value!r}')
        if self.d_model % self.n_heads:
            raise ValueError(
                f'TransformerConfig.d_model={self.d_model} is not divisible by '
                f'n_heads={self.n_heads}'
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f'TransformerConfig.n_heads={self.n_heads} is not divisible by '
                f'n_kv_heads={self.n_kv_heads}'
            )
        if self.head_dim % 2:
            raise ValueError(
                f'TransformerConfig head_dim = d_model / n_heads = {self.head_dim} is odd; '
                'rotary embeddings need an even head_dim'
            )
        if not self.rope_theta > 0:
            raise ValueError(f'TransformerConfig.rope_theta must be > 0, got {self.rope_theta!r}')
        if not self.norm_eps > 0:
            raise ValueError(f'TransformerConfig.norm_eps must be > 0, got {self.norm_eps!r}')
        for name in ('dtype', 'param_dtype'):
            if getattr(self, name) not in _DTYPES:
                raise ValueError(
                    f'TransformerConfig.{name} must be one of {_DTYPES}, '
                    f'got {getattr(self, name)!r}'
                )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def num_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        d, f, hd = self.d_model, self.d_ff, self.head_dim
        attn = d * (self.n_heads * hd) * 2 + d * (self.n_kv_heads * hd) * 2
        block = attn + 3 * d * f + 2 * d
        head = 0 if self.tie_embeddings else d * self.vocab_size
        return self.vocab_size * d + self.n_layers * block + d + head

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d) -> TransformerConfig:
        """Builds from a dict or ConfigDict; unknown keys are an error naming the key."""
        d = dict(d)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(
                f'Unknown TransformerConfig field(s) {unknown}; known: {sorted(names)}'
            )
        return cls(**d)
