"""``AdmitReturning`` (the ``write_through_selective`` admission): a first sighting is refused,
pages seen before are admitted from the root, a request continuing one earlier request is
admitted whole, shared heads alone do not make a continuation, and the seen-page memory is
bounded."""

from __future__ import annotations

from array import array

import pytest

from kvtier.index.eviction import AdmitReturning


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
