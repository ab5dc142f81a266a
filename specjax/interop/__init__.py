"""Real checkpoints in and out: Hugging Face Llama safetensors directories (and GGUF files)."""

from specjax.interop.convert import (
    config_from_hf,
    hf_config_from,
    model_from_tensors,
    tensors_from_model,
)

__all__ = ['config_from_hf', 'hf_config_from', 'model_from_tensors', 'tensors_from_model']
