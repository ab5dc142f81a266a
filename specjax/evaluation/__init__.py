"""Evaluating a target-draft pair: spec_eval (acceptance, tau, measured and predicted speedup),
serving latency, the pair loader, prompts, timing helpers and table formatting."""
