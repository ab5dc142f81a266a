"""How well a draft matches its target: α per temperature and domain, predicted τ, perplexity,
and a short measured speculative run.

Names (also the keys of results.json, T formatted with '%g': T0, T1, T0.7):
  draft_loss, draft_perplexity, target_loss (+ '/<domain>')  held-out next-token CE (nats)
  alpha_T<T> (+ '/<domain>')            mean per-token α = Σ min(p, q) at temperature T on
                                        held-out data (teacher-forced; T = 0: argmax agreement)
  alpha_generated_T<T> (+ '/<domain>')  the same over the generated tokens of the draft's own
                                        continuations of held-out prompts, sampled at T
  alpha_target_generated_T<T> (+ ...)   the same on the target's continuations at T: the
                                        contexts speculative decoding verifies in (its output
                                        follows the target), so the α that predicts τ
  tau_pred_k<k>_T<T>                    Leviathan's E[τ] = (1 − α^{k+1}) / (1 − α) from
                                        alpha_target_generated_T<T> (held-out α without
                                        generation, eval_generate_batches = 0)
  acceptance_k<k>_T<T>, accepted_fraction_k<k>_T<T>, tau_k<k>_T<T>, predicted_speedup_k<k>_T<T>
                                        the measured speculative run at the end: spec_eval's
                                        acceptance_rate, accepted_fraction, block_efficiency
                                        and predicted_speedup (specjax.sampling.pair_eval),
                                        with c, v(k) timed here (null without calibrate)
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from specjax.distill.sources import Generator, prompts_from_batch
from specjax.models import apply, merge
from specjax.parallel import to_host
from specjax.sampling import SamplingConfig, make_speculative_fn, pair_eval
from specjax.sampling import stats as stats_lib
from specjax.sampling.calibrate import calibrate
from specjax.train.losses import domain_sums, next_token_loss

# results.json key prefix -> pair_eval.point name (the same quantities spec_eval reports)
SPECULATIVE_KEYS = {
    'acceptance': 'acceptance_rate',
    'accepted_fraction': 'accepted_fraction',
    'tau': 'block_efficiency',
    'predicted_speedup': 'predicted_speedup',
}


def tname(t: float) -> str:
    return f'T{float(t):g}'


def _alpha_sums(target_logits, draft_logits, mask_BT, domain_BT, temps, sampling, num_domains):
    out = {}
    for t in temps:
        s = SamplingConfig(temperature=float(t), top_k=sampling.top_k, top_p=sampling.top_p)
        a = stats_lib.alpha_per_position(target_logits, draft_logits, s)
        sums, counts = domain_sums(jnp.where(mask_BT, a, 0.0), mask_BT, domain_BT, num_domains)
        out[tname(t)] = (jnp.sum(jnp.where(mask_BT, a, 0.0)), sums)
        out['count'] = (jnp.sum(mask_BT, dtype=jnp.float32), counts)
    return out


def heldout_sums(
    draft_gd, target_gd, draft_params, target_params, batch, *, temps, sampling, num_domains
):
    """Loss and α sums on one packed held-out batch (float32; totals and per domain)."""
    args = (batch['tokens'], batch['positions'], batch['segment_ids'])
    d_logits = apply(draft_gd, draft_params, *args)
    t_logits = apply(target_gd, target_params, *args)
    d_loss, mask = next_token_loss(d_logits, batch['tokens'], batch['segment_ids'])
    t_loss, _ = next_token_loss(t_logits, batch['tokens'], batch['segment_ids'])
    dom = batch['domain_ids'][:, 1:]
    out = _alpha_sums(t_logits[:, :-1], d_logits[:, :-1], mask, dom, temps, sampling, num_domains)
    out['draft_loss'] = (jnp.sum(d_loss), domain_sums(d_loss, mask, dom, num_domains)[0])
    out['target_loss'] = (jnp.sum(t_loss), domain_sums(t_loss, mask, dom, num_domains)[0])
    return out


def generated_sums(
    draft_gd,
    target_gd,
    draft_params,
    target_params,
    batch,
    domains_B,
    *,
    temp,
    sampling,
    num_domains,
):
    """α sums at `temp` over the generated tokens of an assembled batch."""
    args = (batch['tokens'], batch['positions'], batch['segment_ids'])
    d_logits = apply(draft_gd, draft_params, *args)
    t_logits = apply(target_gd, target_params, *args)
    mask = batch['loss_mask']
    dom = jnp.broadcast_to(domains_B[:, None], mask.shape)
    return _alpha_sums(
        t_logits[:, :-1], d_logits[:, :-1], mask, dom, (temp,), sampling, num_domains
    )


def _merge_sums(outs):
    """[{name: (total, per-domain)}] -> {name: (float, np.ndarray)} summed over batches (the
    same on every process)."""
    outs = to_host(outs)
    merged = {}
    for o in outs:
        for k, (tot, dom) in o.items():
            t0, d0 = merged.get(k, (0.0, 0.0))
            merged[k] = (t0 + float(tot), d0 + np.asarray(dom, np.float64))
    return merged


def _ratios(prefix, value, count, domains, out):
    tot, dom = value
    ctot, cdom = count
    out[prefix] = tot / ctot if ctot > 0 else float('nan')
    for name, s, c in zip(domains, dom, cdom):
        if c > 0:
            out[f'{prefix}/{name}'] = s / c


class Evaluator:
    """Evaluation of a (draft, target) pair during and after training; see the module doc."""

    def __init__(
        self,
        draft_gd,
        target_gd,
        *,
        eval_batches,
        domains,
        distill_cfg,
        sampling,
        eos_id,
        mesh,
        rules,
        batch_sharding,
        seed,
        draft_rules=None,
    ):
        self.draft_gd, self.target_gd = draft_gd, target_gd
        self.eval_batches = list(eval_batches)
        self.domains = tuple(domains) or ('all',)
        self.d = distill_cfg
        self.sampling = sampling
        self.eos_id, self.mesh, self.rules, self.seed = eos_id, mesh, rules, seed
        self.batch_sharding = batch_sharding
        self.draft_rules = rules if draft_rules is None else draft_rules
        self.temps = tuple(float(t) for t in distill_cfg.eval_temperatures)
        nd = len(self.domains)
        self._heldout = jax.jit(
            functools.partial(
                heldout_sums,
                draft_gd,
                target_gd,
                temps=self.temps,
                sampling=sampling,
                num_domains=nd,
            )
        )
        self._device_batches = [
            {
                k: jax.make_array_from_process_local_data(batch_sharding, np.asarray(b[k]))
                for k in ('tokens', 'positions', 'segment_ids', 'domain_ids')
            }
            for b in self.eval_batches
        ]
        self._generated, self._generators = {}, {}
        for t in self.temps:
            s = SamplingConfig(temperature=t, top_k=sampling.top_k, top_p=sampling.top_p)
            for role, gd, r in (
                ('draft', draft_gd, self.draft_rules),
                ('target', target_gd, rules),
            ):
                self._generators[role, t] = Generator(
                    gd,
                    distill_cfg.prompt_len,
                    distill_cfg.max_new_tokens,
                    s,
                    eos_id,
                    mesh,
                    r,
                    batch_sharding,
                )
            self._generated[t] = jax.jit(
                functools.partial(
                    generated_sums, draft_gd, target_gd, temp=t, sampling=sampling, num_domains=nd
                )
            )

    def _generated_alpha(self, role, t, draft_params, target_params, hosts, out):
        outs = []
        for i, host in enumerate(hosts):
            key = jax.random.fold_in(jax.random.key(self.seed + 1), i)
            params = draft_params if role == 'draft' else target_params
            batch = self._generators[role, t](params, host, key)
            # This process's rows' domains -> the global [B] array beside the batch's.
            domains = jax.make_array_from_process_local_data(
                self.batch_sharding, np.asarray(batch.pop('domain_ids'), np.int32)
            )
            outs.append(self._generated[t](draft_params, target_params, batch, domains))
        sums = _merge_sums(outs)
        name = 'alpha_generated' if role == 'draft' else 'alpha_target_generated'
        _ratios(f'{name}_{tname(t)}', sums[tname(t)], sums['count'], self.domains, out)

    def __call__(self, draft_params, target_params) -> dict[str, float]:
        out = {}
        if self._device_batches:
            sums = _merge_sums(
                [self._heldout(draft_params, target_params, b) for b in self._device_batches]
            )
            for name in ('draft_loss', 'target_loss'):
                _ratios(name, sums[name], sums['count'], self.domains, out)
            for name in list(out):
                if name.startswith('draft_loss') or name.startswith('target_loss'):
                    out[name.replace('_loss', '_perplexity')] = math.exp(min(out[name], 700.0))
            for t in self.temps:
                _ratios(f'alpha_{tname(t)}', sums[tname(t)], sums['count'], self.domains, out)
        hosts = self.eval_batches[: self.d.eval_generate_batches]
        for t in self.temps:
            if hosts:
                for role in ('draft', 'target'):
                    self._generated_alpha(role, t, draft_params, target_params, hosts, out)
            alpha = out.get(f'alpha_target_generated_{tname(t)}', out.get(f'alpha_{tname(t)}'))
            if alpha is not None and math.isfinite(alpha):
                for k in self.d.eval_ks:
                    tau = stats_lib.expected_block_efficiency(min(max(alpha, 0.0), 1.0), k)
                    out[f'tau_pred_k{k}_{tname(t)}'] = tau
        return out

    def speculative(self, draft_params, target_params) -> dict[str, float]:
        """Measured acceptance and τ at k = final_spec_k per temperature (+ predicted speedup),
        by specjax.sampling.pair_eval, the path spec_eval takes; flat keys for sweep tables.
        Each process decodes its own eval rows; every process gets the same figures."""
        k = int(self.d.final_spec_k)
        if not k or not self.eval_batches:
            return {}
        batches = []
        for h in self.eval_batches[: self.d.final_spec_batches]:
            prompts, lengths, _ = prompts_from_batch(h, self.d.prompt_len)
            batches.append((None, prompts, lengths))  # host rows: every global row is real
        cal, out = None, {}
        if self.d.calibrate:
            cal = calibrate(
                merge(self.target_gd, target_params),
                merge(self.draft_gd, draft_params),
                batch_size=int(batches[0][1].shape[0]),  # this process's rows
                ks=(k,),
                context_len=self.d.prompt_len,
                capacity=self.d.prompt_len + self.d.max_new_tokens + k + 1,
            )
            out.update({'cost_ratio_c': cal.c, f'verify_cost_v{k}': cal.v[k]})
        for t in self.temps:
            s = SamplingConfig(temperature=t, top_k=self.sampling.top_k, top_p=self.sampling.top_p)
            fn = make_speculative_fn(
                self.target_gd,
                self.draft_gd,
                num_draft_tokens=k,
                max_new_tokens=self.d.max_new_tokens,
                sampling=s,
                eos_id=self.eos_id,
                mesh=self.mesh,
                rules=self.rules,
                draft_rules=self.draft_rules,
            )
            params, rng = (target_params, draft_params), jax.random.key(self.seed + 2)
            p = pair_eval.point(
                pair_eval.row_table(
                    pair_eval.decode_batches(fn, params, batches, rng, host_local=True)
                ),
                k,
                cal,
            )
            for name, key in SPECULATIVE_KEYS.items():
                out[f'{name}_k{k}_{tname(t)}'] = p[key]
        return out
