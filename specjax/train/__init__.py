"""Training: losses, optimizer, train state, pure step functions and the loop every mode shares.

losses.py     next-token cross-entropy on packed rows (float32, masked), per-domain sums
optimizer.py  AdamW + warmup/cosine + global-norm clipping from config.train
config.py     config.train defaults and validation
state.py      TrainState pytree, sharded init plan (StatePlan) on a mesh
steps.py      train_step / eval_step, jitted once with explicit shardings
loop.py       run_loop(Task): resume, checkpoints, SIGTERM, non-finite checks, metrics, eval
metrics.py    metrics.jsonl + TensorBoard + progress line
pretrain.py   the 'pretrain' mode: config -> Task -> run_loop -> results.json
"""
