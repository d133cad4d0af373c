"""``AdmitReturning`` (the ``write_through_selective`` admission): a first sighting is refused,
pages seen before are admitted from the root, a request continuing one earlier request is
admitted whole, shared heads alone do not make a continuation, the seen-page memory is
bounded, and fresh pages are admitted exactly while probes show that they return."""

from __future__ import annotations

from array import array

import pytest

from kvtier.index.admit_returning import AdmitReturning


class Run:
    """A node: one-token pages with the given ids, used once."""

    def __init__(self, *ids: int) -> None:
        self.tokens = array("I", ids).tobytes()
        self.pages = len(ids)
        self.hits = 1


def path(*runs: Run) -> list[tuple[Run, int]]:
    return [(run, run.pages) for run in runs]


def test_first_sighting_is_refused_and_the_continuation_is_admitted_whole():
    admission = AdmitReturning()
    assert admission.admitted_pages(path(Run(1, 2)), 10) == 0
    assert admission.admitted_pages(path(Run(1, 2), Run(3, 4)), 10) == 4


def test_a_shared_head_alone_admits_only_itself():
    admission = AdmitReturning()
    head = Run(100)
    for user in range(3):
        admission.admitted_pages(path(head, Run(user + 1)), 10)
    # the head was seen 3 times: a popular prefix, not one earlier request's history
    assert admission.admitted_pages(path(head, Run(50, 51)), 10) == 1


def test_admission_never_exceeds_the_limit():
    admission = AdmitReturning()
    admission.admitted_pages(path(Run(1, 2)), 10)
    assert admission.admitted_pages(path(Run(1, 2), Run(3)), 2) == 2


def test_memory_is_bounded_oldest_forgotten_first():
    admission = AdmitReturning(memory=3)
    admission.admitted_pages(path(Run(1, 2)), 10)
    admission.admitted_pages(path(Run(7, 8)), 10)
    assert admission.admitted_pages(path(Run(1, 2)), 10) == 0   # pages 1 and 2 were dropped
    assert admission.admitted_pages(path(Run(1, 2)), 10) == 2


def test_memory_must_hold_a_page():
    with pytest.raises(ValueError, match="memory"):
        AdmitReturning(memory=0)


def first_turns(admission: AdmitReturning, sessions: range, continued: int) -> None:
    """Two-page first turns; the first ``continued`` of them come back at once as turn 2."""
    for s in sessions:
        turn1 = Run(10_000 + 2 * s, 10_001 + 2 * s)
        admission.admitted_pages(path(turn1), 10)
        if s - sessions.start < continued:
            admission.admitted_pages(path(turn1, Run(50_000 + s)), 10)


def test_fresh_pages_are_admitted_once_first_turns_are_seen_to_return():
    admission = AdmitReturning(evidence=32)
    first_turns(admission, range(40), continued=40)
    assert admission.fresh_return_rate == 1.0 and admission.admits_fresh()
    before = admission.stats()["fresh_admitted_pages"]
    assert admission.admitted_pages(path(Run(1, 2, 3)), 10) == 3  # a new first turn, whole
    assert admission.stats()["fresh_admitted_pages"] == before + 3


def test_fresh_pages_stay_refused_while_most_first_turns_never_return():
    admission = AdmitReturning(evidence=32)
    first_turns(admission, range(40), continued=12)
    assert admission.fresh_return_rate == 12 / 40
    assert admission.admitted_pages(path(Run(1, 2, 3)), 10) == 0


def test_open_probes_count_as_failed_until_resolved():
    admission = AdmitReturning(evidence=32)
    first_turns(admission, range(31), continued=31)
    assert admission.fresh_return_rate is None                 # 31 probes: not enough yet
    first_turns(admission, range(100, 140), continued=0)
    assert admission.fresh_return_rate == 31 / 71               # the 40 open ones as failed


def test_a_return_past_the_horizon_is_a_failed_probe():
    admission = AdmitReturning(memory=8, evidence=1)
    first = Run(1, 2)
    admission.admitted_pages(path(first), 10)
    for s in range(5):                                          # 10 new pages: past 8
        admission.admitted_pages(path(Run(100 + 2 * s, 101 + 2 * s)), 10)
    assert admission.resolved > 0 and admission.returned == 0
    assert admission.fresh_return_rate == 0.0


def test_a_load_asking_before_its_commit_records_nothing():
    admission = AdmitReturning()
    admission.admitted_pages(path(Run(1, 2)), 10)
    turn2 = path(Run(1, 2), Run(3, 4))
    assert admission.admitted_pages(turn2[:1], 10, observe=False) == 2
    assert admission.admitted_pages(turn2, 10) == 4   # still one earlier sighting: continues


def test_likely_must_be_a_rate():
    with pytest.raises(ValueError, match="likely"):
        AdmitReturning(likely=1.5)
