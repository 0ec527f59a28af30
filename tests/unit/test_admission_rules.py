"""The admission bookkeeping, without sockets: the strangers' budget, per-principal
slots, and session-id reservations (the conformance suite runs them on a server)."""

from __future__ import annotations

from portico.config import Settings
from portico.core.reservations import SessionReservations
from portico.server.capacity import PrincipalSlots, Strangers, principal_cap, stranger_budget


class FakeStranger:
    def __init__(self, name: str, log: list[str]) -> None:
        self.name = name
        self.log = log

    def evict(self) -> None:
        self.log.append(self.name)


def test_a_full_budget_evicts_the_oldest_stranger() -> None:
    evicted: list[str] = []
    strangers = Strangers(2)
    a, b, c, d = (FakeStranger(n, evicted) for n in "abcd")
    strangers.arrived(a)
    strangers.arrived(b)
    strangers.left(a)  # authenticated: no longer counted, never evicted
    strangers.arrived(c)
    assert evicted == []
    strangers.arrived(d)
    assert evicted == ["b"]
    assert len(strangers) == 2


def test_the_budget_is_at_most_half_the_connections() -> None:
    assert stranger_budget(Settings(max_connections=64, max_unauthenticated_connections=16)) == 16
    assert stranger_budget(Settings(max_connections=10, max_unauthenticated_connections=16)) == 5
    assert stranger_budget(Settings(max_connections=1)) == 1


def test_principal_slots_cap_each_principal_alone() -> None:
    slots = PrincipalSlots(2)
    assert slots.take("alice")
    assert slots.take("alice")
    assert not slots.take("alice")
    assert slots.take("bob")
    slots.give("alice")
    assert slots.take("alice")


def test_without_authentication_one_principal_is_not_capped_apart() -> None:
    # Every client of `auth: none` is `local`: a per-principal cap would lock out the
    # 101st browser tab of a single-user server long before `max_connections`.
    assert principal_cap(Settings(auth="none", max_connections_per_principal=2)) is None
    assert (
        principal_cap(Settings(auth="apikey", api_keys={"k": "u"}, max_connections_per_principal=2))
        == 2
    )
    slots = PrincipalSlots(None)
    assert all(slots.take("local") for _ in range(1000))


def test_a_reserved_id_is_foreign_to_everyone_but_its_principal() -> None:
    reservations = SessionReservations()
    assert not reservations.foreign("sess-1", "bob")
    reservations.reserve("sess-1", "alice")
    assert reservations.foreign("sess-1", "bob")
    assert not reservations.foreign("sess-1", "alice")
    reservations.release("sess-1")
    assert not reservations.foreign("sess-1", "bob")
