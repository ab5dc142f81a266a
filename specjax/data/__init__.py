"""Data layer: TFDS corpus (embedded stdlib or any array_record dataset), tokenizers, grain.

tok = build_tokenizer(config.data)
it = make_train_iterator(config.data, tok, global_batch_size=B, seed=s)
batch = next(it)      # int32 [B / process_count, seq_len]: tokens, segment_ids, positions,
                      # domain_ids; it.get_state() / it.set_state(state) for checkpoints
batches = make_eval_batches(config.data, tok, global_batch_size=B, max_batches=N)
corpus_identity(config.data)  # {'name', 'manifest_hash', ...}
baseline_losses(config.data, tok)  # {'bigram', 'unigram', 'num_targets'} nats/token
data_digests(config.data)  # {'corpus': {..., 'sha256'}, 'tokenizer': {..., 'sha256'}} (digests.py)
"""

from specjax.data.baselines import baseline_losses
from specjax.data.config import default_data_config
from specjax.data.corpus import prepare_stdlib
from specjax.data.digests import corpus_digest, data_digests, tokenizer_digest, used_digests
from specjax.data.hf_tokenizer import HuggingFaceTokenizer
from specjax.data.pipeline import (
    BATCH_KEYS,
    make_eval_batches,
    make_train_iterator,
    tokenized_split,
)
from specjax.data.sources import corpus_identity, open_dataset
from specjax.data.tokenizers import (
    ByteTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    build_tokenizer,
    train_sentencepiece,
)

__all__ = [
    'BATCH_KEYS',
    'ByteTokenizer',
    'HuggingFaceTokenizer',
    'SentencePieceTokenizer',
    'Tokenizer',
    'baseline_losses',
    'build_tokenizer',
    'corpus_digest',
    'corpus_identity',
    'data_digests',
    'default_data_config',
    'make_eval_batches',
    'make_train_iterator',
    'open_dataset',
    'prepare_stdlib',
    'tokenized_split',
    'tokenizer_digest',
    'train_sentencepiece',
    'used_digests',
]
