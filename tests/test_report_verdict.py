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
