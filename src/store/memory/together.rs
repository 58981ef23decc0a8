//! A call charged to several tools at once: every tenant's shard locked (in shard order), then
//! every tool's cell (in name order) — the order a call of one tool takes them in, shard then
//! tool — so the plans are decided on states nobody else changes, and written only if every
//! plan is admitted.

use std::sync::{Arc, MutexGuard};

use arc_swap::Guard;

use super::{
    find_tool, hash_tenant, lock, micros_ceil, note_period, stored, write_back, MemoryStore, Shard,
    ToolCell, ToolEntry,
};
use crate::admission::engine::{self, Plan, Snapshot};
use crate::store::{Admission, Admissions, Decision};

/// Where one plan's states live: its tenant's hash and shard, its tool's cell (borrowed from
/// the store's list of tools, read once for the call) and period.
struct Place<'c> {
    hash: u64,
    shard: usize,
    cell: &'c Arc<ToolCell>,
    period: f64,
}

/// One plan as it is decided: where its states live, the states (some 600 bytes: decided
/// where they lie, not moved about), the engine's decision once it is committed, and the
/// answer once it is made.
struct Part<'c, 'p, 'a> {
    place: Place<'c>,
    snap: Snapshot,
    call: Option<engine::Deciding<'p, 'a>>,
    admission: Option<Arc<Admission>>,
}

/// The most tools a call is charged to (the limiter refuses more).
const MAX: usize = crate::limiter::MAX_TOOLS_PER_CALL;

/// The shards a call's tenants live in, each locked once, with its index.
type Shards<'g> = [Option<(usize, MutexGuard<'g, Shard>)>; MAX];

/// Decides `plans` (of distinct tools) together: all admitted and written, or the first
/// refusal and nothing written. The tools' states are written once every plan is committed,
/// and their locks let go before the answers are made (as for a call of one tool).
pub(super) fn decide(store: &MemoryStore, plans: &[Plan<'_>]) -> Decision {
    let plans = &plans[..plans.len().min(MAX)];
    let cells = tool_cells(store, plans);
    let mut parts: Vec<Part<'_, '_, '_>> = Vec::with_capacity(plans.len());
    for plan in plans {
        let place = place(store, &cells, plan);
        let (snap, call, admission) = (Snapshot::default(), None, None);
        parts.push(Part {
            place,
            snap,
            call,
            admission,
        });
    }
    let mut shards = lock_shards(store, &parts);
    let mut tools = lock_tools(&parts);
    for ((plan, part), tool) in plans.iter().zip(&mut parts).zip(&tools) {
        let tool = tool.as_ref().expect("locked");
        part.snap = states(shard_of(&mut shards, part.place.shard), plan, &part.place);
        tool.read_into(&mut part.snap);
        let call = part.call.insert(engine::Deciding::new(plan, &part.snap));
        if let Err(r) = call.commit(&mut part.snap) {
            return Decision::Refused(r);
        }
    }
    for (part, tool) in parts.iter().zip(tools.iter_mut()) {
        let call = part.call.as_ref().expect("every plan committed");
        tool.as_mut().expect("locked").write_from(&part.snap, call);
    }
    drop(tools);
    for (plan, part) in plans.iter().zip(&mut parts) {
        let admitted = part.call.as_ref().expect("committed").answer(&part.snap);
        let expires = admitted.expires.map(micros_ceil);
        let shard = shard_of(&mut shards, part.place.shard);
        write(store, shard, plan, &part.place, &part.snap, expires);
        part.admission = Some(admitted.admission);
    }
    let admissions = parts.iter_mut().flat_map(|p| p.admission.take());
    Decision::Admitted(Admissions::of(admissions).expect("a call of several tools"))
}

/// The store's list of tools, with a cell for every plan's tool (made for those never called).
fn tool_cells(store: &MemoryStore, plans: &[Plan<'_>]) -> Guard<Arc<Vec<Arc<ToolCell>>>> {
    let cells = store.tools.load();
    if plans
        .iter()
        .all(|p| find_tool(&cells, p.tool.name()).is_some())
    {
        return cells;
    }
    drop(cells);
    for p in plans {
        store.tool_cell(p.tool.name());
    }
    // The list only grows: every plan's tool is in it now.
    store.tools.load()
}

/// Where `plan`'s states live; its tool's cell is in `cells`.
fn place<'c>(store: &MemoryStore, cells: &'c [Arc<ToolCell>], plan: &Plan<'_>) -> Place<'c> {
    let (tool, tenant) = (plan.tool.name(), &**plan.tenant.name);
    let hash = hash_tenant(&store.hasher, tool, tenant, plan.untenanted);
    let cell = find_tool(cells, tool).expect("every plan's tool has a cell");
    Place {
        hash,
        shard: store.shard_index(hash),
        period: note_period(cell, plan),
        cell,
    }
}

/// The parts' shards locked in shard order (the order a call of one tool takes one in).
fn lock_shards<'g>(store: &'g MemoryStore, parts: &[Part<'_, '_, '_>]) -> Shards<'g> {
    let mut order: [usize; MAX] = std::array::from_fn(|i| i);
    let order = &mut order[..parts.len()];
    order.sort_unstable_by_key(|&i| parts[i].place.shard);
    let mut shards: Shards<'g> = Default::default();
    let mut locked = 0;
    for &i in order.iter() {
        let shard = parts[i].place.shard;
        let held = locked > 0 && matches!(&shards[locked - 1], Some((s, _)) if *s == shard);
        if !held {
            shards[locked] = Some((shard, lock(&store.shards[shard].0)));
            locked += 1;
        }
    }
    shards
}

/// The parts' tools locked in name order (after the shards, as a call of one tool locks
/// its tool), held in the parts' order.
fn lock_tools<'c>(parts: &[Part<'c, '_, '_>]) -> [Option<MutexGuard<'c, ToolEntry>>; MAX] {
    let mut order: [usize; MAX] = std::array::from_fn(|i| i);
    let order = &mut order[..parts.len()];
    order.sort_unstable_by(|&a, &b| parts[a].place.cell.name.cmp(&parts[b].place.cell.name));
    let mut tools: [Option<MutexGuard<'c, ToolEntry>>; MAX] = Default::default();
    for &i in order.iter() {
        tools[i] = Some(lock(&parts[i].place.cell.inner));
    }
    tools
}

fn shard_of<'a>(shards: &'a mut Shards<'_>, index: usize) -> &'a mut Shard {
    let (_, guard) = shards
        .iter_mut()
        .flatten()
        .find(|(i, _)| *i == index)
        .expect("every plan's shard is locked");
    guard
}

/// The plan's tenant and instance states as stored (fresh where none is).
fn states(shard: &Shard, plan: &Plan<'_>, place: &Place<'_>) -> Snapshot {
    let entry = shard.tenants.find(place.hash, |e| {
        e.is(plan.tool.name(), plan.tenant.name, plan.untenanted)
    });
    let entry = entry.map(|e| &**e);
    let slot = entry.and_then(|e| plan.instance.map(|i| e.instances.find(i.name)));
    stored(entry, slot, place.period)
}

/// Writes an admitted plan's tenant and instance states, adding its tenant's entry if new.
fn write(
    store: &MemoryStore,
    shard: &mut Shard,
    plan: &Plan<'_>,
    place: &Place<'_>,
    snap: &Snapshot,
    expires: [u64; 3],
) {
    let (tool, tenant) = (plan.tool.name(), &**plan.tenant.name);
    if let Some(entry) = shard
        .tenants
        .find_mut(place.hash, |e| e.is(tool, tenant, plan.untenanted))
    {
        let slot = plan.instance.map(|i| entry.instances.find(i.name));
        write_back(entry, plan, snap, slot, expires, place.period);
        return;
    }
    let cell = place.cell.clone();
    store.add_tenant(shard, place.hash, cell, plan, snap, expires, place.period);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::Timestamp;
    use crate::{Caller, Cost, Policy, Store};

    const POLICY: &str = r#"
        [[tool]]
        name = "chat.requests"
        group = "chat"
        unit = "calls"
        rate = { limit = 60, per = "1m" }
        lease = "off"
        [tool.default_tenant]
        ceiling = 3
        burst = 3
        [[tool]]
        name = "chat.tokens"
        group = "chat"
        unit = "tokens"
        rate = { limit = 10000, per = "1m" }
        lease = "off"
        [tool.default_tenant]
        ceiling = 1000
        burst = 1000
    "#;

    fn plans<'p>(policy: &'p Policy, caller: &'p Caller, tokens: f64) -> Vec<Plan<'p>> {
        let now = Timestamp(1_767_225_600_000_000);
        vec![
            caller
                .charged_as(policy, "chat.requests", Cost(1.0), now)
                .unwrap(),
            caller
                .charged_as(policy, "chat.tokens", Cost(tokens), now)
                .unwrap(),
        ]
    }

    fn states(store: &MemoryStore, plans: &[Plan<'_>]) -> Vec<crate::store::Stored> {
        plans
            .iter()
            .map(|p| match store.inspect(&p.keys()) {
                crate::store::Answer::Now(r) => r.unwrap(),
                crate::store::Answer::Later(_) => unreachable!("the memory store answers at once"),
            })
            .collect()
    }

    #[test]
    fn two_tools_are_charged_together_or_not_at_all() {
        let policy = Policy::from_toml_str(POLICY).unwrap();
        let store = MemoryStore::new();
        let acme = Caller::new("acme");
        let decide = |tokens| match store.decide(&plans(&policy, &acme, tokens)) {
            crate::store::Answer::Now(r) => r.unwrap(),
            crate::store::Answer::Later(_) => unreachable!(),
        };
        let Decision::Admitted(a) = decide(600.0) else {
            panic!("both tools have room")
        };
        assert_eq!(a.len(), 2);
        let costs: Vec<f64> = a.iter().map(|a| a.charge.cost).collect();
        assert_eq!(costs, [1.0, 600.0]);
        // 400 tokens left of the ceiling: 500 more is refused by the tokens tool, and the
        // requests tool, which had room, is charged nothing.
        let before = states(&store, &plans(&policy, &acme, 500.0));
        let Decision::Refused(r) = decide(500.0) else {
            panic!("the tokens ceiling refuses")
        };
        assert_eq!(r.tool(), "chat.tokens");
        assert_eq!(before, states(&store, &plans(&policy, &acme, 500.0)));
        assert!(matches!(decide(400.0), Decision::Admitted(_)));
    }
}
