"""Sampling: logits transforms, autoregressive and speculative samplers, acceptance statistics."""

from specjax.sampling.acceptance import EXACT_RULES, RULES, Acceptance, as_acceptance
from specjax.sampling.autoregressive import autoregressive_sample, make_autoregressive_fn
from specjax.sampling.cascade import CASCADE_RULES
from specjax.sampling.common import SampleOutput, check_same_tokenizer
from specjax.sampling.emit import PAD_ID
from specjax.sampling.grammar import Grammar
from specjax.sampling.guards import NonFiniteLogitsError
from specjax.sampling.ngram import NGramDraft, ngram_tree_paths
from specjax.sampling.speculative import make_speculative_fn, speculative_sample
from specjax.sampling.stops import Stops
from specjax.sampling.task import FinishReason
from specjax.sampling.transforms import (
    SamplingConfig,
    TracedSampling,
    inverse_cdf,
    sample_from_probs,
    transform_logits,
)
from specjax.sampling.tree import DynamicTree, chain, check_tree
from specjax.sampling.tree_speculative import make_tree_speculative_fn, tree_speculative_sample
from specjax.sampling.verify import residual, verify, verify_greedy

__all__ = [
    'CASCADE_RULES',
    'EXACT_RULES',
    'RULES',
    'Acceptance',
    'DynamicTree',
    'FinishReason',
    'Grammar',
    'as_acceptance',
    'NGramDraft',
    'NonFiniteLogitsError',
    'PAD_ID',
    'SampleOutput',
    'SamplingConfig',
    'Stops',
    'TracedSampling',
    'autoregressive_sample',
    'chain',
    'check_tree',
    'make_tree_speculative_fn',
    'ngram_tree_paths',
    'tree_speculative_sample',
    'check_same_tokenizer',
    'inverse_cdf',
    'make_autoregressive_fn',
    'make_speculative_fn',
    'residual',
    'sample_from_probs',
    'speculative_sample',
    'transform_logits',
    'verify',
    'verify_greedy',
]
