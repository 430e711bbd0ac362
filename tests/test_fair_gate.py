"""FairGate (pipeline/tenancy/fair_gate.py): the order in which a stage's slots go to tenants (no Ray)."""

from __future__ import annotations

import asyncio

import pytest

from pipeline.tenancy.fair_gate import FairGate


async def _grant_order(gate: FairGate, arrivals: list[tuple[str, float]], hold_s: float = 0.0) -> list[str]:
    """Queue `arrivals` (tenant, cost) in order while one slot is held, then release it:
    the order in which the queued items got their slot."""
    order: list[str] = []
    most_held = 0

    async def item(tenant: str, cost: float):
        nonlocal most_held
        async with gate.slot(tenant, cost):
            most_held = max(most_held, gate.held)
            order.append(tenant)
            await asyncio.sleep(hold_s)

    blocker = asyncio.Event()

    async def hold_first():
        async with gate.slot("blocker"):
            await blocker.wait()

    first = asyncio.create_task(hold_first())
    await asyncio.sleep(0)
    tasks = []
    for tenant, cost in arrivals:
        tasks.append(asyncio.create_task(item(tenant, cost)))
        await asyncio.sleep(0)  # arrive in this order
    blocker.set()
    await asyncio.gather(first, *tasks)
    assert most_held <= gate.capacity and gate.held == 0 and gate.waiting == 0
    return order


def test_first_come_first_served_puts_a_late_tenant_behind_the_whole_flood():
    order = asyncio.run(_grant_order(FairGate(1, fair=False), [("a", 1)] * 8 + [("b", 1)]))
    assert order == ["a"] * 8 + ["b"]


def test_fair_gate_serves_a_late_tenant_after_at_most_one_item_of_the_flood():
    order = asyncio.run(_grant_order(FairGate(1), [("a", 1)] * 8 + [("b", 1)]))
    assert order.index("b") <= 1, order
    assert order.count("a") == 8


def test_tenants_with_backlogs_alternate():
    order = asyncio.run(_grant_order(FairGate(1), [("a", 1)] * 6 + [("b", 1)] * 6))
    assert order[:2] == ["a", "a"] or order[:2] == ["a", "b"]
    # After the first, never two of one tenant in a row while the other still waits.
    for i in range(1, 10):
        assert order[i : i + 2] in (["a", "b"], ["b", "a"]), order


def test_weights_share_slots_in_proportion():
    order = asyncio.run(_grant_order(FairGate(1, weights={"a": 3}), [("a", 1)] * 30 + [("b", 1)] * 30))
    first = order[:24]
    assert first.count("a") == pytest.approx(18, abs=2) and first.count("b") == pytest.approx(6, abs=2), order


def test_cost_counts_against_the_tenant():
    # a's items cost 4 each; b's 1: b gets about four items for each of a's while both wait.
    order = asyncio.run(_grant_order(FairGate(1), [("a", 4)] * 10 + [("b", 1)] * 20))
    assert order[:15].count("b") >= 10, order


def test_an_idle_tenant_banks_no_credit():
    async def scenario():
        gate = FairGate(1)
        for _ in range(100):  # a alone for a long while
            async with gate.slot("a"):
                pass
        return await _grant_order(gate, [("b", 1)] * 10 + [("a", 1)] * 10)

    order = asyncio.run(scenario())
    # b arrived first, but a's long run alone gives b no right to go ten times in a row.
    assert order[:4].count("a") >= 1 and order[:4].count("b") >= 1, order


def test_capacity_bounds_the_holders():
    order = asyncio.run(_grant_order(FairGate(3), [("a", 1)] * 10 + [("b", 1)] * 10, hold_s=0.001))
    assert sorted(order) == ["a"] * 10 + ["b"] * 10


def test_a_waiter_that_leaves_frees_nothing_it_did_not_hold_and_is_skipped():
    async def scenario():
        gate = FairGate(1)
        got: list[str] = []
        release = asyncio.Event()

        async def hold(tenant: str):
            async with gate.slot(tenant):
                got.append(tenant)
                await release.wait()

        holder = asyncio.create_task(hold("a"))
        await asyncio.sleep(0)
        leaver = asyncio.create_task(hold("b"))
        stayer = asyncio.create_task(hold("c"))
        await asyncio.sleep(0)
        assert gate.waiting == 2
        leaver.cancel()
        await asyncio.sleep(0)
        assert gate.waiting == 1 and gate.held == 1
        release.set()
        await asyncio.gather(holder, stayer)
        with pytest.raises(asyncio.CancelledError):
            await leaver
        return got, gate

    got, gate = asyncio.run(scenario())
    assert got == ["a", "c"] and gate.held == 0 and gate.waiting == 0


def test_a_waiter_cancelled_as_it_is_granted_passes_the_slot_on():
    async def scenario():
        gate = FairGate(1)
        got: list[str] = []
        first_in = asyncio.Event()
        release = asyncio.Event()

        async def hold(tenant: str):
            async with gate.slot(tenant):
                got.append(tenant)
                first_in.set()
                await release.wait()

        holder = asyncio.create_task(hold("a"))
        await first_in.wait()
        granted_then_cancelled = asyncio.create_task(hold("b"))
        later = asyncio.create_task(hold("c"))
        await asyncio.sleep(0)
        release.set()
        await asyncio.sleep(0)  # a leaves: b's grant is set, b has not run yet
        granted_then_cancelled.cancel()
        await asyncio.gather(holder, later)
        with pytest.raises(asyncio.CancelledError):
            await granted_then_cancelled
        return got, gate

    got, gate = asyncio.run(scenario())
    assert got == ["a", "c"] and gate.held == 0


def test_capacity_must_be_positive():
    with pytest.raises(ValueError):
        FairGate(0)


def test_fair_sharing_config_defaults_on_and_refuses_weights_that_are_not_positive():
    from pydantic import ValidationError

    from deployments.config import IrisConfig

    config = IrisConfig()
    assert config.fair_sharing.enabled and config.fair_sharing.preprocess_slots == "auto"
    IrisConfig.model_validate({"fair_sharing": {"tenant_weights": {"key-abc": 2.5}, "encoder_slots": 4}})
    for bad in ({"tenant_weights": {"a": 0}}, {"preprocess_slots": 0}, {"encoder_slots": "many"}, {"fair": True}):
        with pytest.raises(ValidationError):
            IrisConfig.model_validate({"fair_sharing": bad})
