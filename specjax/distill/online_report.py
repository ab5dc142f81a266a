"""What the online mode reports: per-window rows for each arm, the shift's summary, the plot.

A window is `config.stream.window` consecutive requests (one domain: windows never straddle
the shift). Per window and arm (online, frozen, retrained), from counts summed over its rounds:
  alpha          mean over served positions of the draft's acceptance probability
                 sum_v min(p_v, q_v) at the serving temperature (argmax agreement at T = 0),
                 re-scored from the served rows (docs/design.md, "Quantities")
  acceptance_rate  accepted / examined proposals (the sampler's estimate of alpha)
  tau            tokens emitted per target call, excluding prefill (block efficiency)
  tokens_per_s   tokens served / wall seconds of the sampler calls (the arms take turns each
                 round, so load drift on a shared machine hits them alike)
  serve_cpu_s    CPU seconds of the sampler calls, per request
  update_cpu_s   CPU seconds per request of what online distillation adds: re-scoring the served
                 rows, choosing buffer entries, and the updates' steps (0 for the other arms);
                 rescore_cpu_s and step_cpu_s split it
  tokens_sha256  digest of the tokens the arm served in the window (tokens_digest per call)
Summary: per post-shift window the recovery (alpha_online - alpha_frozen) / (alpha_retrained -
alpha_frozen), the first post-shift window from which it stays >= 0.5 (`recovered_from`), whether
that lies in the first half of the post-shift stream (`recovery_target_met`), the first window
where it reaches 0.5 at all (`reached_at`; `reached_in_first_half`), and the update's
CPU time over the serving CPU time of the online arm (`update_fraction`, target <= 0.2).
"""

from __future__ import annotations

import hashlib
import math
import os

import jax
import numpy as np

ARMS = ('online', 'frozen', 'retrained')
SUMS = (
    'requests', 'emitted', 'rounds', 'accepted', 'examined', 'alpha_sum', 'alpha_count',
    'serve_wall_s', 'serve_cpu_s', 'update_cpu_s', 'update_wall_s', 'rescore_cpu_s',
    'step_cpu_s', 'updates', 'steps', 'added', 'added_wrong',
)  # fmt: skip
RECOVERY_GOAL = 0.5
UPDATE_FRACTION_GOAL = 0.2
TIMING_FIELDS = (  # measured, so they differ between otherwise identical runs
    'tokens_per_s', 'serve_cpu_s', 'update_cpu_s', 'update_wall_s', 'rescore_cpu_s',
    'step_cpu_s', 'update_fraction', 'update_fraction_wall', 'serve_cpu_s_total',
    'update_cpu_s_total', 'seconds',
)  # fmt: skip


def empty_windows() -> dict:
    """Per arm: the SUMS at 0 and 'digests', one tokens_digest per round."""
    return {arm: dict(dict.fromkeys(SUMS, 0.0), digests=[]) for arm in ARMS}


def tokens_digest(tokens_BN, lengths_B) -> str:
    """sha256 of one sampler call's served tokens int32 [B, N] and lengths int32 [B]."""
    h = hashlib.sha256(np.ascontiguousarray(np.asarray(tokens_BN, np.int32)).tobytes())
    h.update(np.ascontiguousarray(np.asarray(lengths_B, np.int32)).tobytes())
    return h.hexdigest()


def window_digest(digests) -> str:
    """A window's served-tokens digest: sha256 over its rounds' tokens_digest, in order."""
    return hashlib.sha256(''.join(digests).encode()).hexdigest()


def add_serving(acc: dict, out, stats: dict, alpha_BT, mask_BT, wall: float, cpu: float):
    """Adds one sampler call (its SampleOutput `out`, host stats), the re-scored alpha and
    its time to a window's sums."""
    acc['digests'] = list(acc['digests']) + [
        tokens_digest(*jax.device_get((out.tokens, out.lengths)))
    ]
    mask = np.asarray(mask_BT, bool)
    acc['requests'] += len(np.asarray(stats['row_emitted']))
    acc['emitted'] += float(np.sum(stats['row_emitted']))
    acc['rounds'] += float(np.sum(stats['row_rounds']))
    acc['accepted'] += float(np.sum(stats['row_accepted']))
    acc['examined'] += float(np.sum(stats['row_examined']))
    acc['alpha_sum'] += float(np.sum(np.where(mask, np.asarray(alpha_BT, np.float64), 0.0)))
    acc['alpha_count'] += float(mask.sum())
    acc['serve_wall_s'] += wall
    acc['serve_cpu_s'] += cpu


def _ratio(num: float, den: float):
    return num / den if den > 0 else None


def window_row(window: int, arm: str, domain: str, acc: dict, buffer_entries=None) -> dict:
    n = acc['requests']
    row = {
        'window': window,
        'arm': arm,
        'domain': domain,
        'requests': int(n),
        'alpha': _ratio(acc['alpha_sum'], acc['alpha_count']),
        'acceptance_rate': _ratio(acc['accepted'], acc['examined']),
        'tau': _ratio(acc['emitted'], acc['rounds']),
        'tokens_per_s': _ratio(acc['emitted'], acc['serve_wall_s']),
        'serve_cpu_s': _ratio(acc['serve_cpu_s'], n),
        'update_cpu_s': _ratio(acc['update_cpu_s'], n),
        'update_wall_s': _ratio(acc['update_wall_s'], n),
        'rescore_cpu_s': _ratio(acc['rescore_cpu_s'], n),
        'step_cpu_s': _ratio(acc['step_cpu_s'], n),
        'tokens': int(acc['emitted']),
        'tokens_sha256': window_digest(acc['digests']),
        'updates': int(acc['updates']),
        'steps': int(acc['steps']),
        'buffer_added': int(acc['added']),
        'buffer_added_wrong': int(acc['added_wrong']),
    }
    if buffer_entries is not None:
        row['buffer_entries'] = int(buffer_entries)
    return row


def _by_arm(rows: list[dict]) -> dict[str, list[dict]]:
    return {
        arm: sorted((r for r in rows if r['arm'] == arm), key=lambda r: r['window']) for arm in ARMS
    }


def recovery(online: float, frozen: float, retrained: float):
    """(online - frozen) / (retrained - frozen); None where the gap is not positive."""
    if None in (online, frozen, retrained) or not retrained > frozen:
        return None
    return (online - frozen) / (retrained - frozen)


def _mean(rows, key, domain):
    vals = [r[key] for r in rows if r['domain'] == domain and r[key] is not None]
    return float(np.mean(vals)) if vals else None


def summarize(rows: list[dict], domains) -> dict:
    """The shift's figures from the window rows (module docstring)."""
    arms = _by_arm(rows)
    post = [i for i, r in enumerate(arms['online']) if r['domain'] == domains[1]]
    per_window = []
    for i in post:
        o, f, r = (arms[a][i]['alpha'] for a in ARMS)
        per_window.append({'window': arms['online'][i]['window'], 'recovery': recovery(o, f, r)})
    ok = [w['recovery'] is not None and w['recovery'] >= RECOVERY_GOAL for w in per_window]
    start = next((j for j in range(len(ok)) if all(ok[j:])), None)
    reached = next((j for j in range(len(ok)) if ok[j]), None)
    first_half = len(per_window) // 2 or 1
    online = arms['online']
    update_cpu = sum(r['update_cpu_s'] * r['requests'] for r in online)
    serve_cpu = sum(r['serve_cpu_s'] * r['requests'] for r in online)
    update_wall = sum(r['update_wall_s'] * r['requests'] for r in online)
    serve_wall = sum(r['tokens'] / r['tokens_per_s'] for r in online if r['tokens_per_s'])
    return {
        'alpha': {arm: {d: _mean(arms[arm], 'alpha', d) for d in domains} for arm in ARMS},
        'tau': {arm: {d: _mean(arms[arm], 'tau', d) for d in domains} for arm in ARMS},
        'tokens_per_s': {
            arm: {d: _mean(arms[arm], 'tokens_per_s', d) for d in domains} for arm in ARMS
        },
        'recovery': per_window,
        'recovered_from': None if start is None else per_window[start]['window'],
        'post_shift_windows': [w['window'] for w in per_window],
        'first_half_windows': [w['window'] for w in per_window[:first_half]],
        'recovery_target_met': start is not None and start < first_half,
        'reached_at': None if reached is None else per_window[reached]['window'],
        'reached_in_first_half': reached is not None and reached < first_half,
        'update_cpu_s_total': update_cpu,
        'serve_cpu_s_total': serve_cpu,
        'update_fraction': _ratio(update_cpu, serve_cpu),
        'update_fraction_wall': _ratio(update_wall, serve_wall),
        'update_fraction_target_met': (_ratio(update_cpu, serve_cpu) or math.inf)
        <= UPDATE_FRACTION_GOAL,
    }


def plot_alpha(rows: list[dict], domains, window: int, out_dir: str) -> str:
    """<out_dir>/online_alpha.png: alpha per window of each arm over the stream, the shift
    marked; returns its path."""
    from matplotlib.figure import Figure

    arms = _by_arm(rows)
    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot(1, 1, 1)
    styles = {
        'online': ('C0', 'o', '-'),
        'frozen': ('C1', 's', '--'),
        'retrained': ('C2', '^', ':'),
    }
    for arm in ARMS:
        xs = [(r['window'] + 1) * window for r in arms[arm]]
        ys = [math.nan if r['alpha'] is None else r['alpha'] for r in arms[arm]]
        color, marker, line = styles[arm]
        ax.plot(xs, ys, color=color, marker=marker, linestyle=line, label=f'{arm} draft')
    shift = sum(1 for r in arms['online'] if r['domain'] == domains[0]) * window
    ax.axvline(shift, color='grey', linewidth=1)
    ax.text(shift, ax.get_ylim()[1], f' {domains[0]} -> {domains[1]}', va='top', fontsize=8)
    ax.set_xlabel('requests served (end of window)')
    ax.set_ylabel('alpha = mean sum min(p, q)')
    ax.set_title('Acceptance over the stream: online vs frozen vs retrained draft')
    ax.legend(loc='lower left', fontsize=8)
    ax.grid(alpha=0.3)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, 'online_alpha.png')
    fig.savefig(path, dpi=120, bbox_inches='tight')
    return path


def write_plot(workdir, rows, domains, window) -> str:
    """Draws plots/online_alpha.png; an existing one (an interrupted earlier finish) is kept as
    online_alpha.prev[-n].png first."""
    out_dir = os.path.join(workdir, 'plots')
    path = os.path.join(out_dir, 'online_alpha.png')
    if os.path.exists(path):
        n, keep = 1, os.path.join(out_dir, 'online_alpha.prev.png')
        while os.path.exists(keep):
            n += 1
            keep = os.path.join(out_dir, f'online_alpha.prev-{n}.png')
        os.replace(path, keep)
    return plot_alpha(rows, domains, window, out_dir)
