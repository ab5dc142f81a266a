"""c and v(k) under each XLA CPU flag set, each in a fresh process (flags apply at jax start-up).

  python -m benchmarks.xla_flags [--out=PATH] [--batch_sizes=1,8]

Same models and arguments as benchmarks.sampling (whose flags it accepts); prints
a markdown table and writes JSON. Flags checked to exist in jaxlib 0.10 (`strings` on
libjax_common.so). About 10 minutes on the shared 2-core CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from benchmarks import cli
from benchmarks.sampling import parser
from specjax import jsonio

XLA_FLAG_SETS = (
    '',
    '--xla_cpu_multi_thread_eigen=false',
    '--xla_cpu_use_xnnpack=true',
    '--xla_cpu_experimental_xnn_fusion_type=dot',
    '--xla_cpu_experimental_onednn_fusion_type=dot',
    '--xla_cpu_experimental_ynn_fusion_type=dot',
)


def compare_xla_flags(args) -> dict:
    """v(k) and the target step under each XLA flag set, each in a fresh process."""
    out = {}
    for flags in XLA_FLAG_SETS:
        env = dict(os.environ, XLA_FLAGS=flags)
        path = f'{args.out}.vk{len(out)}.json'
        cmd = [
            sys.executable,
            '-m',
            'benchmarks.xla_flags',
            '--only_vk',
            f'--out={path}',
            f'--preset={args.preset}',
            f'--iters={args.iters}',
            f'--repeats={args.repeats}',
            '--batch_sizes=' + ','.join(str(b) for b in args.batch_sizes),
        ]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode:
            out[flags or 'default'] = {'error': proc.stderr[-2000:]}
            continue
        with open(path) as f:
            out[flags or 'default'] = json.load(f)
    from specjax.evaluation.tables import markdown_table

    rows = []
    for flags, res in out.items():
        for b, cal in res.get('calibration', {}).items():
            rows.append(
                [flags, b, 1e3 * cal['target_step_s'], cal['c']]
                + [cal['v'][str(k)] for k in range(1, 9)]
            )
    print(
        markdown_table(
            ['XLA_FLAGS', 'B', 'target step ms', 'c'] + [f'v({k})' for k in range(1, 9)], rows
        )
    )
    jsonio.write_json(args.out, out)
    return out


def only_vk(args) -> dict:
    from specjax.evaluation import measure
    from specjax.sampling.calibrate import calibrate

    target, drafts = cli.build_models(args.preset)
    res = {'environment': measure.environment(), 'calibration': {}}
    for batch in args.batch_sizes:
        cal = calibrate(
            target,
            drafts['independent'],
            batch_size=batch,
            ks=tuple(range(1, 9)),
            context_len=args.prompt_len + args.max_new // 2,
            capacity=args.prompt_len + args.max_new + 9,
            iters=args.iters,
            repeats=args.repeats,
        )
        res['calibration'][str(batch)] = cal.to_dict()
    jsonio.write_json(args.out, res)
    return res


def main(argv=None):
    p = parser()
    p.set_defaults(out='/tmp/specjax/bench_xla_flags.json')
    p.add_argument('--only_vk', action='store_true', help='one flag set, this process')
    args = p.parse_args(argv)
    cli.setup_cache(args)
    return only_vk(args) if args.only_vk else compare_xla_flags(args)


if __name__ == '__main__':
    main()
