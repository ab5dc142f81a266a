"""specjax: speculative decoding and draft distillation in JAX."""
