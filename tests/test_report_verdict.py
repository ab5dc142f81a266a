"""The quickstart report's verdict rows (specjax.quickstart.report_verdict) on hand-built run
records: what each figure in a row covers."""

from specjax.evaluation.tables import fmt
from specjax.quickstart import report_verdict


def test_student_row_names_the_positions_of_each_loss():
    """A reduced-vocabulary student's loss (and the target's beside it) covers the positions of
    its vocabulary; the bigram's covers every position, so the row puts it beside the target's
    loss on every position when the results have one (the SmolLM2 preset's teacher cache)."""
    d = {'target': {'eval': {'loss': 2.83}}}
    assert report_verdict._bigram_clause(d, 4.61) == f" and the bigram's {fmt(4.61)}"
    d['target']['eval']['loss_all'] = 3.08
    clause = report_verdict._bigram_clause(d, 4.61)
    assert clause.startswith(' on the same positions'), clause
    assert f"on every position the target's {fmt(3.08)} and the bigram's {fmt(4.61)}" in clause


def test_the_ngram_row_says_what_bounds_it():
    """The training-free draft's row reports proposals per round and tokens kept; where it is
    not faster it says why: rare matches (under k / 2 proposals a round) or copied runs the
    target rejects."""
    run = dict(k=4, rounds=112, drafted=50, accepted=17, speedup={'verdict': 'indistinguishable'})
    why = report_verdict._ngram_why(run)
    assert f'it proposed 50 tokens in 112 rounds ({fmt(50 / 112)} a round' in why
    assert 'the target kept 17' in why and 'repeats its context too little' in why
    why = report_verdict._ngram_why(dict(run, drafted=300, speedup={'verdict': 'slower'}))
    assert 'diverge from what the target writes' in why
    faster = report_verdict._ngram_why(dict(run, speedup={'verdict': 'faster'}))
    assert faster.endswith('the target kept 17') and report_verdict._ngram_why({'k': 4}) == ''
