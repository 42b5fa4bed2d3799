"""Replica pools behind the router: placement, stickiness, failure, draining, discovery updates, and the
pooled verifier / drafter tiers over fake clients (plus one end-to-end run over real in-process services)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import router.tiers.replicas as replicas_mod
from router.tiers.pooled import PooledDrafter, PooledVerifier, Pools, StaticDiscovery
from router.tiers.replicas import Member, ReplicaSet
from services.calls import DraftCall, OpenCall, PrefillCall, VerifyCall
from services.errors import StaleCycleError, TierUnavailableError


# ---- fakes ----------------------------------------------------------------------------------------
class Clock:
    """Stands in for the `time` module of router.tiers.replicas (asyncio keeps the real clock)."""

    def __init__(self, t: float = 1000.0):
        self.t = t

    def monotonic(self) -> float:
        return self.t


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(replicas_mod, "time", SimpleNamespace(monotonic=c.monotonic))
    return c


class FakeClient:
    """A verifier and drafter client in one: records every call, raises `fail_with` while it is set."""

    def __init__(self, address: str):
        self.address = address
        self.calls: list[tuple] = []
        self.fail_with: Exception | None = None
        self.closed = 0

    async def _call(self, name: str, *args):
        self.calls.append((name, *args))
        if self.fail_with is not None and name != "release":
            raise self.fail_with
        return (name, self.address)

    async def prefill(self, call):
        return await self._call("prefill", call.request_id)

    async def verify(self, call):
        return await self._call("verify", call.request_id, call.cycle)

    async def release(self, request_id):
        return await self._call("release", request_id)

    def forget(self, request_id):
        self.calls.append(("forget", request_id))

    async def profile(self):
        return await self._call("profile")

    async def open(self, call):
        return await self._call("open", call.request_id, call.cycle)

    async def draft(self, call):
        return await self._call("draft", call.request_id, call.cycle)

    def names(self, name: str) -> list[tuple]:
        return [c for c in self.calls if c[0] == name]


def pool(*ids: str, down_s: float = 2.0, draining: tuple[str, ...] = ()) -> ReplicaSet[FakeClient]:
    rs: ReplicaSet[FakeClient] = ReplicaSet("verifier", FakeClient, down_s=down_s)
    rs.update([Member(i, f"{i}:1", i in draining) for i in ids])
    return rs


def placed_counts(rs: ReplicaSet, request_ids) -> Counter:
    """Per member, the requests whose placement points there (what `load()` must equal)."""
    counts = Counter({m.replica_id: 0 for m in rs.members()})
    for r in request_ids:
        p = rs.placed(r)
        if p is not None:
            counts[p[0]] += 1
    return counts


# ---- ReplicaSet ---------------------------------------------------------------------------------
def test_least_loaded_placement_with_round_robin_tie_break():
    rs = pool("a", "b", "c")
    # Ties rotate: consecutive place/unplace pairs visit every member once per round.
    seen = []
    for i in range(6):
        rid, client = rs.place(f"t{i}")
        assert client is rs.client(rid) and client.address == f"{rid}:1"
        seen.append(rid)
        rs.unplace(f"t{i}")
    assert sorted(seen[:3]) == ["a", "b", "c"] and seen[3:] == seen[:3]
    assert rs.load() == {"a": 0, "b": 0, "c": 0}
    # Least loaded wins over the rotation.
    for r in ("x1", "x2", "x3"):
        rs.place(r)
    assert rs.load() == {"a": 1, "b": 1, "c": 1}
    first = rs.placed("x1")[0]
    rs.unplace("x1")
    assert rs.place("new")[0] == first  # the only member with one request less


def test_placement_is_sticky_and_counted_once():
    rs = pool("a", "b")
    rid, client = rs.place("r")
    for _ in range(3):
        assert rs.place("r") == (rid, client)
    assert rs.placed("r") == (rid, client)
    assert sum(rs.load().values()) == 1
    other = next(m.replica_id for m in rs.members() if m.replica_id != rid)
    rs.place("s")
    rs.place("t")  # now `rid` holds 2 (r, and one of s/t) or other does; r stays where it was anyway
    assert rs.place("r")[0] == rid and rs.load()[rid] + rs.load()[other] == 3
    rs.unplace("r")
    rs.unplace("r")  # twice: no effect
    assert rs.placed("r") is None and sum(rs.load().values()) == 2
    assert rs.placed("never") is None


def test_draining_member_keeps_its_requests_and_takes_no_new_ones():
    rs = pool("a", "b")
    on_a = [r for r in (f"r{i}" for i in range(4)) if rs.place(r)[0] == "a"]
    assert len(on_a) == 2
    stale = rs.update([Member("a", "a:1", draining=True), Member("b", "b:1")])
    assert stale == []
    assert rs.healthy() == ["b"] and [m.draining for m in rs.members()] == [True, False]
    for r in on_a:
        assert rs.placed(r)[0] == "a" and rs.place(r)[0] == "a"  # sticky while draining
    for i in range(5):
        assert rs.place(f"n{i}")[0] == "b"  # even though b is far more loaded
    assert rs.load() == {"a": 2, "b": 7}
    rs.update([Member("a", "a:1", draining=True)])  # b left: only a draining member remains
    with pytest.raises(TierUnavailableError):
        rs.place("another")
    assert rs.placed(on_a[0])[0] == "a"


def test_fail_marks_member_down_for_down_s_and_unplaces_its_requests(clock):
    rs = pool("a", "b", down_s=2.0)
    for i in range(4):
        rs.place(f"r{i}")
    on_a = [f"r{i}" for i in range(4) if rs.placed(f"r{i}")[0] == "a"]
    on_b = [f"r{i}" for i in range(4) if rs.placed(f"r{i}")[0] == "b"]
    rs.fail("a", TierUnavailableError("gone"))
    assert all(rs.placed(r) is None for r in on_a) and all(rs.placed(r)[0] == "b" for r in on_b)
    assert rs.load() == {"a": 0, "b": 2}
    assert rs.healthy() == ["b"]
    for r in on_a:  # the requests' recovery lands on the other member, even though it is busier
        assert rs.place(r)[0] == "b"
    clock.t += 1.9
    assert rs.healthy() == ["b"] and rs.place("late")[0] == "b"
    assert rs.healthy(now=clock.t + 0.2) == ["a", "b"]
    clock.t += 0.1  # exactly down_s later: back in placement
    assert rs.healthy() == ["a", "b"]
    assert rs.place("back")[0] == "a"
    # A second failure while down extends the window from the latest failure.
    rs.fail("a", TierUnavailableError("again"))
    clock.t += 1.0
    rs.fail("a", TierUnavailableError("and again"))
    clock.t += 1.5
    assert rs.healthy() == ["b"]
    rs.fail("unknown", TierUnavailableError("x"))  # not a member: ignored


def test_fail_with_real_clock_and_tiny_down_s():
    rs = pool("a", "b", down_s=0.05)
    rs.fail("a", TierUnavailableError("gone"))
    assert rs.healthy() == ["b"]
    time.sleep(0.06)
    assert rs.healthy() == ["a", "b"]


def test_no_healthy_member_raises_tier_unavailable(clock):
    empty: ReplicaSet[FakeClient] = ReplicaSet("drafter", FakeClient)
    with pytest.raises(TierUnavailableError, match="no healthy drafter replica"):
        empty.place("r")
    rs = pool("a", "b")
    rs.fail("a", TierUnavailableError("x"))
    rs.fail("b", TierUnavailableError("y"))
    with pytest.raises(TierUnavailableError):
        rs.place("r")
    assert rs.placed("r") is None and rs.load() == {"a": 0, "b": 0}


def test_update_adds_removes_and_returns_stale_clients():
    connected = []

    def connect(address):
        connected.append(address)
        return FakeClient(address)

    rs: ReplicaSet[FakeClient] = ReplicaSet("verifier", connect)
    assert rs.update([Member("a", "a:1"), Member("b", "b:1")]) == []
    assert connected == ["a:1", "b:1"]
    a, b = rs.client("a"), rs.client("b")
    for i in range(4):
        rs.place(f"r{i}")
    on_a = [f"r{i}" for i in range(4) if rs.placed(f"r{i}")[0] == "a"]
    # Same members again: nothing reconnects, nothing is stale.
    assert rs.update([Member("a", "a:1"), Member("b", "b:1")]) == []
    assert connected == ["a:1", "b:1"] and rs.client("a") is a
    # a leaves, c joins: a's client comes back to be closed, a's requests are unplaced.
    stale = rs.update([Member("b", "b:1"), Member("c", "c:1")])
    assert stale == [a] and connected[-1] == "c:1"
    assert sorted(rs.load()) == ["b", "c"] and rs.clients() == [b, rs.client("c")]
    assert all(rs.placed(r) is None for r in on_a)
    assert rs.load() == {"b": 2, "c": 0}
    assert rs.place(on_a[0])[0] == "c"
    c = rs.client("c")
    assert rs.update([]) == [b, c] and rs.members() == [] and rs.load() == {}


def test_update_moving_a_member_returns_its_old_client_and_keeps_counts_consistent():
    """A replica that restarts at a new address (e.g. a Ray actor restart) keeps its id: the old client is
    stale and a new one connects. Its requests' state was on the old process, and in any case the
    pool's per-member count must stay equal to the requests placed there."""
    rs = pool("a", "b")
    requests = [f"r{i}" for i in range(4)]
    for r in requests:
        rs.place(r)
    old_a = rs.client("a")
    stale = rs.update([Member("a", "a:2"), Member("b", "b:1")])
    assert stale == [old_a]
    assert rs.client("a") is not old_a and rs.client("a").address == "a:2"
    assert rs.load() == dict(placed_counts(rs, requests))
    for r in requests:
        rs.unplace(r)
    assert rs.load() == {"a": 0, "b": 0}  # no negative count left behind


# ---- property: placement invariants ----------------------------------------------------------------
OPS = st.lists(st.one_of(
    st.tuples(st.just("place"), st.integers(0, 11)),
    st.tuples(st.just("unplace"), st.integers(0, 11)),
    st.tuples(st.just("fail"), st.integers(0, 3)),
    st.tuples(st.just("drain"), st.integers(0, 3)),
    st.tuples(st.just("remove"), st.integers(0, 3)),
    st.tuples(st.just("readd"), st.integers(0, 3)),
    st.tuples(st.just("tick"), st.floats(0.0, 1.5)),
), max_size=60)


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_placement_invariants_under_random_operations(ops):
    clock = Clock()
    saved = replicas_mod.time
    replicas_mod.time = SimpleNamespace(monotonic=clock.monotonic)
    try:
        ids = ["m0", "m1", "m2", "m3"]
        members = {i: Member(i, f"{i}:1") for i in ids}
        rs: ReplicaSet[FakeClient] = ReplicaSet("verifier", FakeClient, down_s=1.0)
        rs.update(list(members.values()))
        requests = [f"r{i}" for i in range(12)]
        for op, arg in ops:
            if op == "place":
                r = f"r{arg}"
                before = rs.placed(r)
                healthy = rs.healthy()
                load = rs.load()
                if before is None and not healthy:
                    with pytest.raises(TierUnavailableError):
                        rs.place(r)
                    continue
                rid, client = rs.place(r)
                if before is not None:
                    assert (rid, client) == before  # sticky
                else:
                    assert rid in healthy  # healthy and not draining
                    assert load[rid] == min(load[h] for h in healthy)  # least loaded
                    assert client is rs.client(rid)
            elif op == "unplace":
                rs.unplace(f"r{arg}")
            elif op == "fail":
                rs.fail(ids[arg], TierUnavailableError("x"))
                assert all(p is None or p[0] != ids[arg] for p in map(rs.placed, requests))
                assert ids[arg] not in rs.healthy()
            elif op == "drain":
                if ids[arg] in members:
                    members[ids[arg]] = Member(ids[arg], f"{ids[arg]}:1", draining=True)
                    assert rs.update(list(members.values())) == []
            elif op == "remove":
                members.pop(ids[arg], None)
                rs.update(list(members.values()))
                assert all(p is None or p[0] in members for p in map(rs.placed, requests))
            elif op == "readd":
                if ids[arg] not in members:
                    members[ids[arg]] = Member(ids[arg], f"{ids[arg]}:1")
                    rs.update(list(members.values()))
            else:
                clock.t += arg
            assert rs.load() == dict(placed_counts(rs, requests))
            assert all(n >= 0 for n in rs.load().values())
            assert sorted(rs.load()) == sorted(members)
    finally:
        replicas_mod.time = saved


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 6), st.integers(0, 60))
def test_many_requests_spread_evenly(n_members, n_requests):
    rs = pool(*[f"m{i}" for i in range(n_members)])
    for i in range(n_requests):
        rs.place(f"r{i}")
    counts = list(rs.load().values())
    assert sum(counts) == n_requests and max(counts) - min(counts) <= 1


# ---- PooledVerifier -------------------------------------------------------------------------------
def test_pooled_verifier_failover_re_prefills_on_the_other_replica(clock):
    rs = pool("a", "b")
    v = PooledVerifier(rs)

    async def run():
        first = await v.prefill(PrefillCall("r", [1, 2], None, []))
        rid = first[1].split(":")[0]
        other = "b" if rid == "a" else "a"
        assert await v.verify(VerifyCall("r", 1, None)) == ("verify", f"{rid}:1")
        rs.client(rid).fail_with = TierUnavailableError("replica died")
        with pytest.raises(TierUnavailableError):
            await v.verify(VerifyCall("r", 2, None))
        assert rs.placed("r") is None and rs.healthy() == [other]
        # What the router does next: release (nothing is placed any more), then re-prefill.
        await v.release("r")
        assert rs.client(rid).names("release") == []
        assert await v.prefill(PrefillCall("r", [1, 2], None, [7])) == ("prefill", f"{other}:1")
        assert await v.verify(VerifyCall("r", 1, None)) == ("verify", f"{other}:1")
        # A verify whose request was never (or no longer) placed: the router re-prefills too.
        with pytest.raises(TierUnavailableError, match="left the pool"):
            await v.verify(VerifyCall("ghost", 1, None))
        return rid, other

    rid, other = asyncio.run(run())
    assert rs.client(rid).calls == [("prefill", "r"), ("verify", "r", 1), ("verify", "r", 2), ("forget", "r")]
    assert [c[0] for c in rs.client(other).calls] == ["prefill", "verify"]


def test_pooled_verifier_stale_cycle_does_not_mark_the_replica_down():
    rs = pool("a", "b")
    v = PooledVerifier(rs)

    async def run():
        await v.prefill(PrefillCall("r", [1], None, []))
        rid = rs.placed("r")[0]
        rs.client(rid).fail_with = StaleCycleError("unknown request")
        with pytest.raises(StaleCycleError):
            await v.verify(VerifyCall("r", 1, None))
        return rid

    rid = asyncio.run(run())
    assert rs.healthy() == ["a", "b"] and rs.placed("r")[0] == rid


def test_pooled_verifier_prefill_failure_marks_down_and_release_goes_to_the_right_client(clock):
    rs = pool("a", "b")
    v = PooledVerifier(rs)

    async def run():
        await v.prefill(PrefillCall("keep", [1], None, []))
        keep = rs.placed("keep")[0]
        other = "b" if keep == "a" else "a"
        rs.client(other).fail_with = TierUnavailableError("refused")
        with pytest.raises(TierUnavailableError):
            await v.prefill(PrefillCall("new", [1], None, []))  # least loaded: the other replica, which fails
        assert rs.healthy() == [keep] and rs.placed("new") is None
        assert await v.prefill(PrefillCall("new", [1], None, [])) == ("prefill", f"{keep}:1")
        await v.release("keep")
        assert rs.client(keep).names("release") == [("release", "keep")]
        assert rs.client(other).names("release") == []
        assert rs.placed("keep") is None and rs.load()[keep] == 1
        await v.release("keep")  # again: nothing placed, no call
        assert len(rs.client(keep).names("release")) == 1
        assert await v.profile() == ("profile", f"{keep}:1")
        rs.fail(keep, TierUnavailableError("x"))
        with pytest.raises(TierUnavailableError):
            await v.profile()

    asyncio.run(run())


# ---- PooledDrafter --------------------------------------------------------------------------------
def test_pooled_drafter_reopen_releases_old_context_and_places_anew(clock):
    rs = pool("a", "b")
    d = PooledDrafter(rs)

    async def run():
        await d.open(OpenCall("r", [1, 2], None, None, 0, "dspark"))
        rid = rs.placed("r")[0]
        other = "b" if rid == "a" else "a"
        assert rs.client(rid).names("open") == [("open", "r", 0)]
        assert await d.draft(DraftCall("r", 1, [3], 1, None, 7)) == ("draft", f"{rid}:1")
        # Reopen without a failure (e.g. after a stale cycle) while rid drains: the old context is
        # released there and the new one is placed anew, on the member that takes new requests.
        rs.update([Member(rid, f"{rid}:1", draining=True), Member(other, f"{other}:1")])
        await d.open(OpenCall("r", [1, 2, 3], None, None, 1, "dspark"))
        assert rs.client(rid).names("release") == [("release", "r")]
        assert rs.placed("r")[0] == other and rs.client(other).names("open") == [("open", "r", 1)]
        assert rs.load() == {"a": 0, "b": 0} | {other: 1}
        # A failing release of the old context does not stop the reopen.

        async def broken_release(request_id):
            raise TierUnavailableError("gone")

        rs.client(other).release = broken_release
        await d.open(OpenCall("r", [1, 2, 3], None, None, 1, "dspark"))
        assert rs.placed("r")[0] == other and rs.load()[other] == 1
        assert len(rs.client(other).names("open")) == 2 and rs.healthy() == [other]

    asyncio.run(run())


def test_pooled_drafter_draft_failure_marks_down_and_reopen_lands_elsewhere(clock):
    rs = pool("a", "b")
    d = PooledDrafter(rs)

    async def run():
        await d.open(OpenCall("r", [1, 2], None, None, 0, "dspark"))
        rid = rs.placed("r")[0]
        other = "b" if rid == "a" else "a"
        rs.client(rid).fail_with = TierUnavailableError("drafter died")
        with pytest.raises(TierUnavailableError):
            await d.draft(DraftCall("r", 1, [3], 1, None, 7))
        assert rs.healthy() == [other] and rs.placed("r") is None
        with pytest.raises(TierUnavailableError, match="left the pool"):
            await d.draft(DraftCall("r", 2, [4], 2, None, 7))
        await d.open(OpenCall("r", [1, 2, 3, 4], None, None, 2, "dspark"))
        assert rs.placed("r")[0] == other
        assert rs.client(rid).names("release") == []  # nothing placed there any more
        assert await d.draft(DraftCall("r", 3, [5], 4, None, 7)) == ("draft", f"{other}:1")
        await d.release("r")
        assert rs.client(other).names("release") == [("release", "r")] and rs.placed("r") is None
        # An open that fails marks its replica down too.
        rs.client(other).fail_with = TierUnavailableError("refused")
        with pytest.raises(TierUnavailableError):
            await d.open(OpenCall("s", [1], None, None, 0, "dspark"))
        assert rs.healthy() == [] and rs.placed("s") is None
        with pytest.raises(TierUnavailableError):
            await d.open(OpenCall("s", [1], None, None, 0, "dspark"))

    asyncio.run(run())


# ---- Pools ----------------------------------------------------------------------------------------
class FlakyDiscovery:
    def __init__(self, answers):
        self.answers, self.calls = list(answers), 0

    async def members(self):
        self.calls += 1
        answer = self.answers[min(self.calls, len(self.answers)) - 1]
        if isinstance(answer, Exception):
            raise answer
        return answer


def _pools(discovery, with_drafter=True, down_s=2.0):
    closed = []

    async def close(client):
        client.closed += 1
        closed.append(client)

    pools = Pools(discovery, FakeClient, FakeClient if with_drafter else None, close, interval_s=0.01,
                  down_s=down_s)
    return pools, closed


def test_pools_refresh_with_static_discovery_and_close_every_client():
    pools, closed = _pools(StaticDiscovery(["v1:1", "v2:1"], ["d1:1"]))

    async def run():
        await pools.refresh()
        await pools.refresh()  # unchanged: no reconnects, nothing closed
        assert [m.replica_id for m in pools.verifiers.members()] == ["v1:1", "v2:1"]
        assert [c.address for c in pools.drafters.clients()] == ["d1:1"]
        assert closed == [] and pools.verifiers.down_s == 2.0
        await pools.verifier.prefill(PrefillCall("r", [1], None, []))
        await pools.drafter.open(OpenCall("r", [1], None, None, 0, "dspark"))
        await pools.close()

    asyncio.run(run())
    every = pools.verifiers.clients() + pools.drafters.clients()
    assert sorted(c.address for c in closed) == ["d1:1", "v1:1", "v2:1"]
    assert all(c.closed == 1 for c in every)


def test_pools_refresh_closes_stale_clients_and_survives_discovery_errors():
    one = {"verifier": [Member("v1", "v1:1")], "drafter": [Member("d1", "d1:1")]}
    two = {"verifier": [Member("v2", "v2:1")], "drafter": [Member("d1", "d1:2")]}
    discovery = FlakyDiscovery([one, ConnectionError("controller restarting"), two])
    pools, closed = _pools(discovery)

    async def run():
        await pools.refresh()
        v1, d1 = pools.verifiers.client("v1"), pools.drafters.client("d1")
        with pytest.raises(ConnectionError):
            await pools.refresh()
        assert pools.verifiers.client("v1") is v1  # a failed discovery leaves the pools as they are
        await pools.refresh()
        assert closed == [v1, d1]
        assert [m.replica_id for m in pools.verifiers.members()] == ["v2"]
        assert pools.drafters.client("d1").address == "d1:2"
        # run() keeps going through discovery failures.
        discovery.answers, discovery.calls = [ConnectionError("down"), one], 0
        task = asyncio.create_task(pools.run())
        for _ in range(100):
            await asyncio.sleep(0.01)
            if pools.verifiers.members() == [Member("v1", "v1:1")]:
                break
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert pools.verifiers.members() == [Member("v1", "v1:1")] and discovery.calls >= 2

    asyncio.run(run())


def test_a_lost_replica_has_the_streams_of_all_its_requests_cancelled():
    """One failed call marks the replica down and forgets every request it held there (their streams are
    cancelled, so the replica frees them even if it was only stalled); the requests move on their next call."""
    pools, _ = _pools(StaticDiscovery(["v1:1", "v2:1"], ["d1:1", "d2:1"]))

    async def run():
        await pools.refresh()
        for r in ("r0", "r1", "r2", "r3"):
            await pools.verifier.prefill(PrefillCall(r, [1], None, []))
            await pools.drafter.open(OpenCall(r, [1], None, None, 0, "dspark"))
        victim, client = pools.verifiers.placed("r0")
        held = sorted(r for r in ("r0", "r1", "r2", "r3") if pools.verifiers.placed(r)[0] == victim)
        client.fail_with = TierUnavailableError("stalled")
        with pytest.raises(TierUnavailableError):
            await pools.verifier.verify(VerifyCall("r0", 1, None))
        assert sorted(c[1] for c in client.calls if c[0] == "forget") == held
        assert all(pools.verifiers.placed(r) is None for r in held)
        moved = await pools.verifier.prefill(PrefillCall("r0", [1], None, []))
        assert moved[1] != victim  # re-prefilled on the other replica
        _, d_client = pools.drafters.placed("r1")
        d_client.fail_with = TierUnavailableError("gone")
        with pytest.raises(TierUnavailableError):
            await pools.drafter.draft(DraftCall("r1", 1, [], 0, None, 4))
        assert "r1" in [c[1] for c in d_client.calls if c[0] == "forget"]

    asyncio.run(run())


def test_pools_wait_ready_waits_for_both_pools_and_times_out():
    empty = {"verifier": [], "drafter": []}
    only_v = {"verifier": [Member("v", "v:1")], "drafter": []}
    both = {"verifier": [Member("v", "v:1")], "drafter": [Member("d", "d:1")]}
    discovery = FlakyDiscovery([empty, only_v, both])
    pools, _ = _pools(discovery)
    no_drafter, _ = _pools(FlakyDiscovery([empty, only_v]), with_drafter=False)
    never, _ = _pools(FlakyDiscovery([only_v]))

    async def run():
        t0 = time.perf_counter()
        await pools.wait_ready(timeout_s=2.0)
        assert discovery.calls == 3 and time.perf_counter() - t0 < 1.0
        await no_drafter.wait_ready(timeout_s=2.0)
        assert no_drafter.drafter is None and no_drafter.verifiers.healthy() == ["v"]
        with pytest.raises(TimeoutError):
            await never.wait_ready(timeout_s=0.25)

    asyncio.run(run())


# ---- end to end: the real router core over pools of in-process services -----------------------------
@pytest.mark.slow
def test_router_over_pools_survives_a_lost_verifier_and_drafter_replica():
    from drafter_worker.main import drafter_service
    from drafter_worker.service import LocalDrafter
    from router.router import Router, RouterConfig
    from router.scheduling.policy import Policy
    from router.session import RouterRequest, Speculation
    from services.registry import resolve_model
    from services.tokenizer import TextTokenizer
    from services.types import SamplingParams
    from tests.tiers import PROMPTS, TARGET, drafter_settings, plain_greedy, verifier_settings
    from verifier_worker.main import load_target, verifier_service
    from verifier_worker.service import LocalVerifier

    tokenizer = TextTokenizer.from_dir(resolve_model(TARGET))
    prompt = tokenizer.encode(PROMPTS[0])
    doomed: dict[str, str] = {}

    class DoomedVerifier(LocalVerifier):
        """The replica that gets the first prefill loses its state and fails on its third verify."""

        def __init__(self, address, service):
            super().__init__(service)
            self.address, self.prefills, self.verifies = address, [], 0

        async def prefill(self, call):
            doomed.setdefault("verifier", self.address)
            self.prefills.append(len(call.resume_ids))
            return await super().prefill(call)

        async def verify(self, call):
            self.verifies += 1
            if doomed["verifier"] == self.address and self.verifies == 3:
                await self.service.release(call.request_id)
                raise TierUnavailableError("verifier replica restarted")
            return await super().verify(call)

    class DoomedDrafter(LocalDrafter):
        def __init__(self, address, service):
            super().__init__(service)
            self.address, self.opens, self.drafts = address, 0, 0

        async def open(self, call):
            doomed.setdefault("drafter", self.address)
            self.opens += 1
            return await super().open(call)

        async def draft(self, call):
            self.drafts += 1
            if doomed["drafter"] == self.address and self.drafts == 2:
                await self.service.release(call.request_id)
                raise TierUnavailableError("drafter replica unreachable")
            return await super().draft(call)

    async def run():
        model = load_target(verifier_settings())
        vservices = {a: verifier_service(verifier_settings(), model=model) for a in ("va", "vb")}
        dservices = {a: drafter_service(drafter_settings(drafters=["dspark-target-dspark"])) for a in ("da", "db")}
        for service in (*vservices.values(), *dservices.values()):
            await service.start()
        closed = []

        async def close(client):
            closed.append(client.address)

        pools = Pools(StaticDiscovery(["va", "vb"], ["da", "db"]),
                      lambda a: DoomedVerifier(a, vservices[a]), lambda a: DoomedDrafter(a, dservices[a]), close)
        await pools.wait_ready(timeout_s=5)
        router = Router(pools.verifier, pools.drafter, {"dspark"},
                        RouterConfig(default=Speculation("dspark", Policy.FIXED, 7)), tokenizer)
        tokens = []
        async for chunk in router.generate(RouterRequest(prompt, SamplingParams(max_tokens=40), request_id="e2e",
                                                         stop_token_ids=tokenizer.eos_token_ids)):
            tokens += chunk.token_ids
        verifiers = {a: pools.verifiers.client(a) for a in ("va", "vb")}
        drafters = {a: pools.drafters.client(a) for a in ("da", "db")}
        loads = [s.load() for s in vservices.values()]
        contexts = [s.load().contexts for s in dservices.values()]
        stats = (router.metrics.verifier_reprefills.labels("")._value.get(),
                 router.metrics.drafter_detached.labels("")._value.get(),
                 router.metrics.num_accepted_tokens.labels("")._value.get())
        await pools.close()
        for service in (*vservices.values(), *dservices.values()):
            await service.stop()
        return tokens, verifiers, drafters, loads, contexts, stats, closed

    t0 = time.perf_counter()
    tokens, verifiers, drafters, loads, contexts, stats, closed = asyncio.run(run())
    reprefills, detached, accepted = stats
    assert tokens == plain_greedy([prompt], [40])[0]
    lost_v, lost_d = doomed["verifier"], doomed["drafter"]
    kept_v = "vb" if lost_v == "va" else "va"
    kept_d = "db" if lost_d == "da" else "da"
    assert reprefills == 1 and verifiers[lost_v].prefills == [0] and len(verifiers[kept_v].prefills) == 1
    assert verifiers[kept_v].prefills[0] > 0  # the re-prefill resumed from the committed output
    assert detached == 1 and drafters[lost_d].opens == 1 and drafters[kept_d].opens == 1
    assert drafters[kept_d].drafts > 1 and accepted > 0  # drafting went on on the other replica
    assert all(x.running == 0 and x.kv_used == 0 for x in loads) and contexts == [0, 0]  # all released
    assert sorted(closed) == ["da", "db", "va", "vb"]
    assert time.perf_counter() - t0 < 30
