"""Model definitions shared by targets, drafts, teachers and students."""

from specjax.models.config import TransformerConfig
from specjax.models.feature_draft import FeatureDraft, FeatureDraftConfig
from specjax.models.functional import abstract_model, apply, apply_cached, merge, split
from specjax.models.kv_cache import DECODE_COMPILER_OPTIONS, KVCache, check_capacity, init_cache
from specjax.models.layout import stack_layers, to_layout, unstack_layers
from specjax.models.transformer import Transformer

__all__ = [
    'DECODE_COMPILER_OPTIONS',
    'FeatureDraft',
    'FeatureDraftConfig',
    'KVCache',
    'Transformer',
    'TransformerConfig',
    'abstract_model',
    'apply',
    'apply_cached',
    'check_capacity',
    'init_cache',
    'merge',
    'split',
    'stack_layers',
    'to_layout',
    'unstack_layers',
]
