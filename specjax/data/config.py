"""`config.data` defaults shared by configs/*.py."""

from __future__ import annotations

import ml_collections


def default_data_config() -> ml_collections.ConfigDict:
    """The data fields every config starts from (the embedded stdlib corpus, SentencePiece 4096)."""
    c = ml_collections.ConfigDict()
    c.name = 'specjax_stdlib'  # TFDS dataset name; others must be prepared as array_record.
    c.data_dir = '~/tensorflow_datasets'  # TFDS data_dir ('~' expanded); caches go beside the data.
    c.text_feature = 'text'  # Feature holding each document's text.
    c.domain_feature = 'domain'  # ClassLabel feature for per-domain metrics, or None.
    c.train_split = 'train'  # Split for training, tokenizer training and baseline counts.
    c.eval_split = 'validation'  # Split for evaluation batches and baselines.
    c.tokenizer = 'sentencepiece'  # 'sentencepiece' (BPE on train_split), 'byte', 'huggingface'.
    c.tokenizer_path = ''  # 'huggingface': a tokenizer.json or a directory (workdir) holding one.
    c.vocab_size = 4096  # SentencePiece vocabulary size (ignored by 'byte').
    c.tokenizer_max_bytes = ml_collections.FieldReference(None, field_type=int)  # SPM text cap.
    c.seq_len = 256  # Tokens per packed row; longer documents are split into chunks.
    c.packing_bins = 64  # First-fit packing bins (more bins, less padding, more reordering).
    c.cache_tokens = True  # Tokenize each split once and cache ids beside the data (small corpora).
    c.read_threads = (
        0  # grain reader threads (0: in the main thread; >0 for on-the-fly tokenizing).
    )
    return c
