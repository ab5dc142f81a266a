"""Per-device memory of a run before launching it: prints the plan's table (and JSON).

  python -m specjax.preflight.memory --config=configs/pretrain.py:size=base --num_devices=8 \
      [--device=NAME] [--json=PATH]

The plan itself is specjax.preflight.plans.plan_for_config (items in memory_plan.py).
"""

from __future__ import annotations

import jax

from specjax.preflight.memory_plan import DEVICE_MEMORY_GIB, device_bytes
from specjax.preflight.plans import plan_for_config


def main(argv) -> None:
    """CLI: prints the plan's table and writes it as JSON with --json."""
    import json

    from absl import flags

    del argv
    f = flags.FLAGS
    if f.device is not None:
        device_bytes(f.device)  # unknown names fail before anything is built
    if f.num_devices:
        jax.config.update('jax_platforms', 'cpu')
        jax.config.update('jax_num_cpu_devices', f.num_devices)
    plan = plan_for_config(f.config, compile_step=f.compile_step)
    print(plan.table(f.device))
    if f.json:
        from etils import epath

        epath.Path(f.json).write_text(json.dumps(plan.to_dict(), indent=2))


if __name__ == '__main__':
    from absl import app, flags
    from ml_collections import config_flags

    config_flags.DEFINE_config_file('config', None, 'Config file of the run: path[:arg].')
    flags.DEFINE_string('device', None, f'Device to check against: {sorted(DEVICE_MEMORY_GIB)}.')
    flags.DEFINE_integer('num_devices', 0, 'Simulate this many CPU devices (plan a slice here).')
    flags.DEFINE_bool('compile_step', True, 'Lower and compile the step for its temporaries.')
    flags.DEFINE_string('json', None, 'Also write the plan as JSON to this path.')
    flags.mark_flags_as_required(['config'])
    app.run(main)
