"""TransformerConfig: the frozen description of every model (target, draft, teacher, student)."""

from __future__ import annotations

import dataclasses
from typing import Any

_DTYPES = ('float32', 'bfloat16', 'float16')


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3's rotary frequency scaling (Hugging Face `rope_type: llama3`).

    Wavelengths shorter than original_max_len / high_freq_factor are kept, those longer than
    original_max_len / low_freq_factor are divided by `factor`, and the band between is
    interpolated smoothly (see `specjax.models.layers.inv_frequencies`).
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_len: int

    def __post_init__(self):
        for name in ('factor', 'low_freq_factor', 'high_freq_factor'):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f'RopeScaling.{name} must be a number > 0, got {value!r}')
        if not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                f'RopeScaling.high_freq_factor={self.high_freq_factor!r} must be above '
                f'low_freq_factor={self.low_freq_factor!r}'
            )
        m = self.original_max_len
        if not isinstance(m, int) or isinstance(m, bool) or m < 1:
            raise ValueError(f'RopeScaling.original_max_len must be a positive int, got {m!r}')


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Llama-style decoder hyper-parameters; validated on construction.

    vocab_size, d_model (E), n_layers, n_heads (H), n_kv_heads (K, dividing H: grouped-query
    attention), d_ff (F, the SwiGLU width) and max_len (the largest position, cache scratch
    included) size the model. head_dim (D) defaults to d_model // n_heads; an explicit value
    (e.g. Qwen3, Gemma) lets H * D differ from E. It is resolved at construction, so
    `cfg.head_dim` is always an int, and `to_dict` leaves it out when it equals the default (old
    checkpoints' configs stay identical); `dataclasses.replace` of d_model or n_heads keeps a
    resolved head_dim, so pass head_dim=None with them. rope_theta is RoPE's base and
    rope_scaling an optional `RopeScaling` (a dict of its fields is accepted). tie_embeddings
    shares the embedding with the output head; norm_eps is RMSNorm's epsilon; dtype is the
    activations' compute dtype (logits and softmax are always float32) and param_dtype the
    parameters' storage dtype. scan_layers stores the blocks' parameters stacked along a
    leading 'layers' axis and runs them with one `lax.scan` body (one compiled block: faster
    compiles of deep models; see `specjax.models.layout` to convert checkpoints); `to_dict` leaves
    it out when False.
    """

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
    head_dim: int | None = None  # None: d_model // n_heads (resolved on construction)
    rope_scaling: RopeScaling | None = None  # None: plain RoPE
    scan_layers: bool = False  # blocks stacked on a leading axis, applied by one lax.scan body

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
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f'TransformerConfig.n_heads={self.n_heads} is not divisible by '
                f'n_kv_heads={self.n_kv_heads}'
            )
        if self.head_dim is None:
            if self.d_model % self.n_heads:
                raise ValueError(
                    f'TransformerConfig.d_model={self.d_model} is not divisible by '
                    f'n_heads={self.n_heads} (set head_dim explicitly for such models)'
                )
            object.__setattr__(self, 'head_dim', self.d_model // self.n_heads)
        hd = self.head_dim
        if not isinstance(hd, int) or isinstance(hd, bool) or hd < 1:
            raise ValueError(f'TransformerConfig.head_dim must be a positive int, got {hd!r}')
        if hd % 2:
            raise ValueError(
                f'TransformerConfig.head_dim={hd} is odd; rotary embeddings need an even head_dim'
            )
        if not self.rope_theta > 0:
            raise ValueError(f'TransformerConfig.rope_theta must be > 0, got {self.rope_theta!r}')
        if hasattr(self.rope_scaling, 'keys'):  # a dict or ConfigDict of RopeScaling's fields
            object.__setattr__(self, 'rope_scaling', _rope_scaling(self.rope_scaling))
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(
                'TransformerConfig.rope_scaling must be None, a RopeScaling or a dict of its '
                f'fields, got {self.rope_scaling!r}'
            )
        if not self.norm_eps > 0:
            raise ValueError(f'TransformerConfig.norm_eps must be > 0, got {self.norm_eps!r}')
        if not isinstance(self.scan_layers, bool):
            raise ValueError(
                f'TransformerConfig.scan_layers must be a bool, got {self.scan_layers!r}'
            )
        for name in ('dtype', 'param_dtype'):
            if getattr(self, name) not in _DTYPES:
                raise ValueError(
                    f'TransformerConfig.{name} must be one of {_DTYPES}, '
                    f'got {getattr(self, name)!r}'
                )

    @property
    def num_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        d, f, hd = self.d_model, self.d_ff, self.head_dim
        attn = d * (self.n_heads * hd) * 2 + d * (self.n_kv_heads * hd) * 2
        block = attn + 3 * d * f + 2 * d
        head = 0 if self.tie_embeddings else d * self.vocab_size
        return self.vocab_size * d + self.n_layers * block + d + head

    def forward_flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs per token of a causal row of seq_len tokens: 2 x matmul weights (the
        output head included, tied or not) + QK^T and AV over the mean (seq_len + 1) / 2 keys."""
        d, hd = self.d_model, self.head_dim
        attn = d * (self.n_heads * hd) * 2 + d * (self.n_kv_heads * hd) * 2
        weights = self.n_layers * (attn + 3 * d * self.d_ff) + d * self.vocab_size
        scores = self.n_layers * 2 * 2 * self.n_heads * hd * (seq_len + 1) / 2
        return 2.0 * weights + scores

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields; head_dim only when it is not d_model // n_heads, scan_layers only
        when True (older configs' dicts stay identical)."""
        d = dataclasses.asdict(self)
        if self.head_dim == self.d_model // self.n_heads and not self.d_model % self.n_heads:
            del d['head_dim']
        if not self.scan_layers:
            del d['scan_layers']
        return d

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


def _rope_scaling(d) -> RopeScaling:
    d = dict(d)
    names = {f.name for f in dataclasses.fields(RopeScaling)}
    if set(d) != names:
        raise ValueError(
            f'TransformerConfig.rope_scaling needs exactly the fields {sorted(names)}, '
            f'got {sorted(d)}'
        )
    return RopeScaling(**d)
