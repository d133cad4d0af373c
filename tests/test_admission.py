"""WriteAdmission: refusals change nothing, two-phase charges released at every exit."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvtier.errors import ConfigError
from kvtier.memory import WriteAdmission, staging_capacity_pages


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def snapshot(adm: WriteAdmission) -> dict:
    stats = adm.stats()
    stats.pop("oldest_charge_age_s")
    return stats


def test_refused_admission_changes_nothing_but_the_refusal_count():
    adm = WriteAdmission(4)
    assert adm.admit("op1", 3)
    before = snapshot(adm)
    assert not adm.admit("op2", 2)
    after = snapshot(adm)
    assert after.pop("refused_total") == before.pop("refused_total") + 1
    assert after.pop("refused_pages_total") == before.pop("refused_pages_total") + 2
    assert after == before
    assert adm.charged("op2") == 0


def test_two_phase_charge_released_at_store_ack():
    adm = WriteAdmission(4)
    assert adm.admit("op", 2)
    assert adm.stats()["admitted_pages"] == 2
    adm.occupy("op", 2)
    stats = adm.stats()
    assert (stats["admitted_pages"], stats["occupied_pages"]) == (0, 2)
    assert adm.release("op", "ack") == 2
    stats = adm.stats()
    assert stats["used_pages"] == 0 and stats["charges"] == 0 and stats["released_ack_total"] == 1


def test_failure_before_host_allocation_releases_the_admitted_charge():
    adm = WriteAdmission(4)
    assert adm.admit("op", 3)
    assert adm.release("op", "failure") == 3
    assert adm.used_pages == 0 and adm.stats()["released_failure_total"] == 1


def test_failure_during_store_write_releases_the_occupied_charge():
    adm = WriteAdmission(4)
    adm.admit("op", 2)
    adm.occupy("op", 2)
    assert adm.release("op", "failure") == 2
    assert adm.used_pages == 0 and adm.can_admit(4)


def test_forced_detach_releases_every_charge_in_either_phase():
    adm = WriteAdmission(8)
    adm.admit("a", 2)
    adm.admit("b", 3)
    adm.occupy("b", 3)
    adm.occupy("c", 1)
    assert adm.detach_all() == 6
    stats = adm.stats()
    assert stats["used_pages"] == 0 and stats["released_detach_total"] == 3


def test_occupy_is_never_refused_and_counts_going_over_capacity():
    adm = WriteAdmission(2)
    assert adm.admit("a", 2)
    adm.occupy("b", 1)  # already resident: not refusable
    stats = adm.stats()
    assert stats["used_pages"] == 3 and stats["over_capacity_total"] == 1
    assert stats["free_pages"] == 0


def test_occupy_may_shrink_an_admitted_charge():
    adm = WriteAdmission(4)
    adm.admit("op", 4)
    adm.occupy("op", 1)
    assert adm.used_pages == 1 and adm.charged("op") == 1


def test_charges_are_keyed_by_operation_so_double_charging_is_misuse():
    adm = WriteAdmission(8)
    adm.admit("op", 1)
    with pytest.raises(ValueError):
        adm.admit("op", 1)
    adm.occupy("op", 1)
    with pytest.raises(ValueError):
        adm.occupy("op", 1)


def test_releasing_twice_or_an_unknown_operation_is_a_counted_no_op():
    adm = WriteAdmission(4)
    adm.admit("op", 2)
    assert adm.release("op") == 2
    assert adm.release("op") == 0
    assert adm.release("never") == 0
    assert adm.stats()["unknown_release_total"] == 2 and adm.used_pages == 0


def test_unknown_release_reason_is_misuse():
    adm = WriteAdmission(4)
    adm.admit("op", 1)
    with pytest.raises(ValueError):
        adm.release("op", "evicted")
    assert adm.charged("op") == 1


def test_stale_lists_old_charges_oldest_first():
    clock = FakeClock()
    adm = WriteAdmission(8, clock=clock)
    adm.admit("old", 1)
    clock.now = 5.0
    adm.admit("newer", 1)
    adm.occupy("old", 1)  # occupying keeps the original start time
    clock.now = 12.0
    assert adm.stale(8.0) == ["old"]
    assert adm.stale(1.0) == ["old", "newer"]
    assert adm.stats()["oldest_charge_age_s"] == 12.0


@pytest.mark.parametrize("pages, share, want", [(100, 0.5, 50), (101, 0.5, 50), (10, 0.3, 7),
                                                (10, 0.0, 10), (10, 1.0, 0), (0, 0.5, 0)])
def test_capacity_is_the_complement_of_the_prefetch_share(pages, share, want):
    assert staging_capacity_pages(pages, share) == want
    assert WriteAdmission.for_host_pool(pages, share).capacity_pages == want


def test_prefetch_share_outside_zero_to_one_is_a_config_error():
    with pytest.raises(ConfigError):
        staging_capacity_pages(10, 1.5)


class AdmissionMachine(RuleBasedStateMachine):
    """Admission against a plain dict of charges; capacity holds for admitted work."""

    def __init__(self) -> None:
        super().__init__()
        self.adm = WriteAdmission(10)
        self.model: dict[int, tuple[int, bool]] = {}
        self.next_op = 0

    @rule(pages=st.integers(0, 6))
    def admit(self, pages):
        op, self.next_op = self.next_op, self.next_op + 1
        used = sum(p for p, _ in self.model.values())
        granted = self.adm.admit(op, pages)
        assert granted == (used + pages <= 10)
        if granted:
            self.model[op] = (pages, False)

    @rule(data=st.data())
    def occupy(self, data):
        admitted = [op for op, (_, occ) in self.model.items() if not occ]
        if admitted:
            op = data.draw(st.sampled_from(admitted))
            self.adm.occupy(op, self.model[op][0])
            self.model[op] = (self.model[op][0], True)

    @rule(data=st.data(), reason=st.sampled_from(["ack", "failure", "detach"]))
    def release(self, data, reason):
        if self.model:
            op = data.draw(st.sampled_from(sorted(self.model)))
            assert self.adm.release(op, reason) == self.model.pop(op)[0]

    @invariant()
    def ledger_matches(self):
        stats = self.adm.stats()
        assert stats["used_pages"] == sum(p for p, _ in self.model.values())
        assert stats["occupied_pages"] == sum(p for p, occ in self.model.values() if occ)
        assert stats["charges"] == len(self.model)
        assert stats["used_pages"] <= 10


TestAdmissionMachine = AdmissionMachine.TestCase
TestAdmissionMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
