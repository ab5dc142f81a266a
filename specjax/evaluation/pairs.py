"""Target/draft pairs for experiments: from checkpoints (tokenizer identities checked) or
random init."""

from __future__ import annotations

import json

import jax
from flax import nnx

from specjax import workdir as workdir_lib
from specjax.distill.feature_mode import CONFIG_KEY as FEATURE_CONFIG_KEY
from specjax.distill.feature_mode import load_feature_draft
from specjax.models import FeatureDraft, FeatureDraftConfig, Transformer, TransformerConfig
from specjax.parallel.mesh import mesh_rules
from specjax.sampling import NGramDraft


def check_identities(
    target_meta: dict,
    draft_meta: dict,
    tokenizer_identity: dict,
    where: tuple[str, str] = ('target', 'draft'),
    draft_vocab_size: int | None = None,
) -> None:
    """ValueError unless both checkpoints and config.data's tokenizer share one identity."""
    t_id, d_id = target_meta.get('tokenizer'), draft_meta.get('tokenizer')
    for name, ident in zip(where, (t_id, d_id)):
        if not ident:
            raise ValueError(f'{name} checkpoint metadata has no tokenizer identity')
    if t_id != d_id:
        field = next(k for k in sorted(set(t_id) | set(d_id)) if t_id.get(k) != d_id.get(k))
        raise ValueError(
            f'tokenizer identity differs between {where[0]} and {where[1]}: {field} is '
            f'{t_id.get(field)!r} vs {d_id.get(field)!r} (a draft must share the target tokenizer)'
        )
    t_vocab = (target_meta.get('model_config') or {}).get('vocab_size')
    d_vocab = (draft_meta.get('model_config') or {}).get('vocab_size')
    if draft_vocab_size is not None and d_vocab == draft_vocab_size:
        pass  # a reduced-vocabulary draft (its draft_vocab.json maps it onto the target's)
    elif t_vocab != d_vocab:
        raise ValueError(
            f'vocab_size differs between {where[0]} ({t_vocab}) and {where[1]} ({d_vocab}): a '
            "draft must score the target's vocabulary"
        )
    if dict(tokenizer_identity) != dict(t_id):
        raise ValueError(
            f'config.data builds tokenizer {dict(tokenizer_identity)!r} but the checkpoints were '
            f"trained with {t_id!r}: set config.data to the checkpoints' data settings"
        )


DRAFT_VOCAB_FILE = 'draft_vocab.json'  # written by specjax.distill.reduced_train, feature_mode


def draft_vocab_ids(workdir: str) -> list[int] | None:
    """The target ids a reduced-vocabulary draft proposes (<workdir>/draft_vocab.json), or None.
    Local or remote (gs://) workdirs alike (specjax.workdir.path)."""
    if not workdir:
        return None
    path = workdir_lib.path(workdir) / DRAFT_VOCAB_FILE
    if not path.exists():
        return None
    return [int(i) for i in json.loads(path.read_text())['ids']]


DRAFT_KINDS = ('model', 'ngram')


def ngram_draft(config) -> NGramDraft | None:
    """config.draft_kind 'ngram': the training-free NGramDraft of config.ngram; 'model' (or an
    older config without the field): None. ValueError naming the field otherwise."""
    kind = config.get('draft_kind', 'model')
    if kind not in DRAFT_KINDS:
        raise ValueError(f'config.draft_kind={kind!r} must be one of {DRAFT_KINDS}')
    if kind == 'model':
        return None
    try:
        by_n = tuple(config.ngram.get('proposals_by_n', ()))
        return NGramDraft(int(config.ngram.max_n), int(config.ngram.min_n), by_n)
    except ValueError as e:
        raise ValueError(f'config.ngram: {e}') from None


def stage_ngram_draft(cfg) -> NGramDraft:
    """The n-gram draft of a stage config's flat fields (the quickstart's serve, route and tasks):
    ngram_max_n, ngram_min_n and ngram_proposals_by_n (absent or (): k proposals after any
    match). ValueError naming the fields when NGramDraft refuses them."""
    by_n = tuple(cfg.get('ngram_proposals_by_n', ()))
    try:
        return NGramDraft(int(cfg.ngram_max_n), int(cfg.ngram_min_n), by_n)
    except ValueError as e:
        raise ValueError(f'ngram_max_n / ngram_min_n / ngram_proposals_by_n: {e}') from None


def load_models(config, tok, mesh) -> tuple[Transformer, Transformer | FeatureDraft, dict]:
    """(target, draft, info): from checkpoints, or random-init when config.random_init. A
    draft_workdir of mode feature_draft gives a FeatureDraft (specjax.distill.feature_mode);
    config.draft_kind 'ngram' gives the training-free NGramDraft (no draft_workdir)."""
    ngram = ngram_draft(config)
    if ngram is not None:
        return _load_with_ngram(config, tok, mesh, ngram)
    if config.random_init:
        t_cfg = TransformerConfig.from_dict(config.model)
        d_cfg = TransformerConfig.from_dict(config.draft)
        target = Transformer(t_cfg, rngs=nnx.Rngs(config.seed))
        draft = Transformer(d_cfg, rngs=nnx.Rngs(config.seed + 1))
        info = {'source': 'random_init'}
    else:
        from specjax.checkpoint import load_model

        for field in ('target_workdir', 'draft_workdir'):
            if not config.get(field):
                raise ValueError(f'config.{field} is empty; set it or config.random_init=True')
        from specjax.checkpoint import Checkpoints

        metas = []
        for wd in (config.target_workdir, config.draft_workdir):
            with Checkpoints(wd, read_only=True) as ckpts:
                metas.append(ckpts.metadata())
        feature = FEATURE_CONFIG_KEY in metas[1]  # a feature_draft workdir (EAGLE-3 draft)
        if feature:
            vocab_size = FeatureDraftConfig.from_dict(metas[1][FEATURE_CONFIG_KEY]).vocab_size
            metas[1] = dict(metas[1], model_config={'vocab_size': vocab_size})
        ids = draft_vocab_ids(config.draft_workdir)
        check_identities(
            *metas,
            tok.identity(),
            where=(config.target_workdir, config.draft_workdir),
            draft_vocab_size=None if ids is None else len(ids),
        )
        rules, draft_rules = mesh_rules(config.mesh)
        target, t_meta = load_model(config.target_workdir, mesh=mesh, rules=rules)
        if feature:  # params on the default device; the sampler places them on the mesh
            draft, d_meta = load_feature_draft(config.draft_workdir)[0], metas[1]
        else:
            draft, d_meta = load_model(
                config.draft_workdir,
                mesh=mesh,
                rules=draft_rules,
                params_key=config.draft_params_key,
                config_key=config.draft_config_key,
            )
        info = {
            'source': 'checkpoints',
            'target_workdir': config.target_workdir,
            'draft_workdir': config.draft_workdir,
            'target_step': t_meta.get('step'),
            'draft_step': d_meta.get('step'),
        }
    ids = None if config.random_init else draft_vocab_ids(config.draft_workdir)
    for name, model in (('target', target), ('draft', draft)):
        if name == 'draft' and ids is not None and model.config.vocab_size == len(ids):
            continue  # reduced vocabulary: checked against the target by check_draft_vocab
        if model.config.vocab_size != tok.vocab_size:
            raise ValueError(
                f"{name} vocab_size={model.config.vocab_size} differs from the tokenizer's "
                f'vocab_size={tok.vocab_size}'
            )
    info.update(
        target=dict(target.config.to_dict(), num_params=target.config.num_params),
        draft=dict(draft.config.to_dict(), num_params=num_params(draft)),
    )
    return target, draft, info


def _load_with_ngram(config, tok, mesh, ngram: NGramDraft):
    """(target, NGramDraft, info): the target from its checkpoint (or random init)."""
    if config.random_init:
        target = Transformer(TransformerConfig.from_dict(config.model), rngs=nnx.Rngs(config.seed))
        info = {'source': 'random_init'}
    else:
        from specjax.checkpoint import load_model

        if not config.get('target_workdir'):
            raise ValueError('config.target_workdir is empty; set it or config.random_init=True')
        target, t_meta = load_model(
            config.target_workdir, mesh=mesh, rules=mesh_rules(config.mesh)[0]
        )
        ident = t_meta.get('tokenizer')
        if ident and dict(tok.identity()) != dict(ident):
            raise ValueError(
                f'config.data builds tokenizer {dict(tok.identity())!r} but the target was '
                f"trained with {ident!r}: set config.data to the checkpoint's data settings"
            )
        info = {
            'source': 'checkpoints',
            'target_workdir': config.target_workdir,
            'target_step': t_meta.get('step'),
        }
    if target.config.vocab_size != tok.vocab_size:
        raise ValueError(
            f"target vocab_size={target.config.vocab_size} differs from the tokenizer's "
            f'vocab_size={tok.vocab_size}'
        )
    info.update(
        target=dict(target.config.to_dict(), num_params=target.config.num_params),
        draft=dict(
            kind='ngram',
            max_n=ngram.max_n,
            min_n=ngram.min_n,
            proposals_by_n=list(ngram.proposals_by_n),
            num_params=0,
        ),
    )
    return target, ngram, info


def num_params(model) -> int:
    """Parameter count of a Transformer (its config's) or a FeatureDraft (its arrays')."""
    if isinstance(model, FeatureDraft):
        return int(sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))))
    return int(model.config.num_params)
