"""The quickstart pipeline: stages (pretrain, drafts, co-training, spec_eval, serve), the
side-by-side stage runner, the SmolLM2 preset's stages, and the report with its plots."""
