//! A call charged to several tools at once — a model call that costs one request of
//! `chat.requests` and its tokens of `chat.tokens` — admitted only if every tool allows it:
//! the store decides the tools' plans in one atomic step, and a refusal charges none of them.
//!
//! A part spent from the caller's lease on its tool is decided here, without the store; the
//! other parts go to the store together. If the store refuses them, the parts spent from
//! leases are put back: nothing is charged anywhere.

use std::sync::atomic::Ordering::Acquire;
use std::sync::Arc;

use super::{can_fetch, Decided, Limiter};
use crate::admission::engine::Plan;
use crate::admission::Refusal;
use crate::clock::{Clock, Timestamp};
use crate::identity::{Caller, Cost};
use crate::lease::{self, FromLease, Spent};
use crate::policy::Policy;
use crate::store::{Admissions, Decision, Store, StoreError};
use crate::ticket::{Charged, Ticket};
use crate::Reason;

/// The most tools one call may be charged to.
pub const MAX_TOOLS_PER_CALL: usize = 8;

/// One tool's part of a call, as it is being decided.
struct ToolCharge<'p> {
    plan: Plan<'p>,
    /// What to ask the store for: the part's cost, or a grant for the caller's lease.
    ask: f64,
    /// How the part stands.
    now: Standing,
}

enum Standing {
    /// To be decided by the store.
    Open,
    /// Spent from the caller's lease.
    Spent(Spent),
    /// Admitted by the store.
    Charged(Charged),
    /// Its tool does not enforce (shadow mode) and would have refused it: let through
    /// uncharged.
    Shadowed(Refusal),
}

/// How one round at the store ended.
enum Round {
    /// Every open part admitted.
    Done,
    /// Asked again with each part's own cost (a grant was refused or had to borrow), or
    /// without a part its tool would only have refused in shadow mode.
    Again,
    /// Refused, or failed and refused by the tools' `on_store_error`.
    Refused(Refusal),
}

impl<S: Store, C: Clock> Limiter<S, C> {
    /// Decides one call charged to several tools — `charges` names each tool and what the
    /// call costs there — and commits it only if every tool allows it, at every level: a
    /// refusal names the tool and level that refused and charges none of them. The tools must
    /// share a [group](crate::policy::ToolPolicy::group) (so a store shared by replicas keeps
    /// their state together and decides them in one step), each named once, at most
    /// [`MAX_TOOLS_PER_CALL`]. Answers one ticket per tool, in the order of `charges`: settle
    /// or release each like any ticket. Like [`admit`](Self::admit), it spends a unit of
    /// tokio's cooperative budget first (with the `tokio` feature).
    ///
    /// ```
    /// use tower_fairshare::{Caller, Cost, Limiter, Policy};
    ///
    /// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
    /// let policy = Policy::from_toml_str(r#"
    ///     [[tool]]
    ///     name = "chat.requests"
    ///     group = "chat"
    ///     unit = "calls"
    ///     rate = { limit = 600, per = "1m" }
    ///     [tool.default_tenant]
    ///     ceiling = 60
    ///
    ///     [[tool]]
    ///     name = "chat.tokens"
    ///     group = "chat"
    ///     unit = "tokens"
    ///     rate = { limit = 100000, per = "1m" }
    ///     [tool.default_tenant]
    ///     ceiling = 4000
    ///     burst = 4000
    /// "#).unwrap();
    /// let limiter = Limiter::new(policy);
    /// let acme = Caller::new("acme");
    /// let call = [("chat.requests", Cost(1.0)), ("chat.tokens", Cost(3000.0))];
    /// let tickets = limiter.admit_all(&acme, &call).await.unwrap();
    /// assert_eq!(tickets.len(), 2);
    /// // 1,000 tokens left this minute: a second 3,000-token estimate is refused by the tokens
    /// // tool, and the requests tool is charged nothing for it.
    /// let refusal = limiter.admit_all(&acme, &call).await.unwrap_err();
    /// assert_eq!(refusal.tool(), "chat.tokens");
    /// // The call used 800 tokens: settled, the rest comes back (3,200 left).
    /// limiter.settle(&tickets[1], Cost(800.0)).await;
    /// assert!(limiter.admit_all(&acme, &call).await.is_ok());
    /// # });
    /// ```
    pub async fn admit_all(
        &self,
        caller: &Caller,
        charges: &[(&str, Cost)],
    ) -> Result<Vec<Ticket>, Refusal> {
        if let [(tool, cost)] = charges {
            return self.admit(caller, tool, *cost).await.map(|t| vec![t]);
        }
        // As `admit`: a unit of the task's cooperative budget first, for calls that wait for
        // nothing.
        #[cfg(feature = "tokio")]
        tokio::task::coop::consume_budget().await;
        if let Some(tickets) = self.spend_all(caller, charges) {
            return Ok(tickets);
        }
        let policy = self.inner.policy.load_full();
        let now = self.inner.clock.now();
        let mut parts = self.parts(&policy, caller, charges, now)?;
        loop {
            match self.round(&policy, caller, &mut parts, now).await {
                Round::Done => break,
                Round::Again => continue,
                Round::Refused(r) => {
                    self.put_back(&mut parts, now);
                    return Err(r);
                }
            }
        }
        Ok(self.tickets(&policy, caller, parts))
    }

    /// The call spent from the caller's leases on every tool, before the policy is read (as
    /// most calls of a busy caller are): `None` when a part is not covered — then nothing is
    /// spent, and the call goes the whole way. The leases' grants say each tool's group.
    fn spend_all(&self, caller: &Caller, charges: &[(&str, Cost)]) -> Option<Vec<Ticket>> {
        let inner = &*self.inner;
        let version = inner.version.load(Acquire);
        let now = || inner.clock.now();
        let mut spent: Vec<Spent> = Vec::new();
        for &(tool, cost) in charges.iter().take(MAX_TOOLS_PER_CALL) {
            match inner
                .leases
                .spend(version, tool, caller, cost.0, now, can_fetch)
            {
                Some(s) => spent.push(s),
                None => break,
            }
        }
        if spent.is_empty() {
            return None;
        }
        let covered = spent.len() == charges.len()
            && spent.iter().enumerate().all(|(i, s)| {
                let k = &s.grant.keys;
                k.slot() == spent[0].grant.keys.slot()
                    && spent[..i].iter().all(|p| p.grant.keys.tool != k.tool)
            });
        if !covered {
            let mut returns = Vec::new();
            for s in spent {
                inner.leases.unspend(s, &mut returns);
            }
            self.give_back(returns, inner.clock.now());
            return None;
        }
        let tickets = spent.into_iter().zip(charges).map(|(s, &(tool, cost))| {
            self.spent(caller, tool, cost, s, None)
                .expect("spent from a lease")
        });
        Some(tickets.collect())
    }

    /// The call's parts: each tool's plan, spent from the caller's lease where it can be;
    /// or the refusal its identity, its tools or their groups earn (recorded).
    fn parts<'p>(
        &self,
        policy: &'p Arc<Policy>,
        caller: &'p Caller,
        charges: &[(&str, Cost)],
        now: Timestamp,
    ) -> Result<Vec<ToolCharge<'p>>, Refusal> {
        let mut parts: Vec<ToolCharge<'p>> = Vec::with_capacity(charges.len());
        let mut returns = Vec::new();
        for (i, &(tool, cost)) in charges.iter().enumerate() {
            let refused = |r| {
                Err(self
                    .finish(policy, caller, tool, cost, Err(r), now)
                    .unwrap_err())
            };
            let plan = match caller.charged_as(policy, tool, cost, now) {
                Ok(plan) => plan,
                Err(r) => return refused(r),
            };
            if let Some((detail, why)) = apart(&parts, &plan, i) {
                tracing::error!(tool, first = charges[0].0, "{why}");
                let mut r = caller.denial(Reason::PermissionDenied, tool, detail);
                r.retryable = false;
                return refused(r);
            }
            parts.push(ToolCharge {
                plan,
                ask: plan.cost,
                now: Standing::Open,
            });
        }
        for part in parts.iter_mut() {
            if !lease::eligible(&part.plan) {
                continue;
            }
            match self.inner.leases.take(&part.plan, can_fetch, &mut returns) {
                FromLease::Hit(spent) => part.now = Standing::Spent(spent),
                FromLease::Miss { grant } => part.ask = grant,
            }
        }
        self.give_back(returns, now);
        Ok(parts)
    }

    /// One decision of the open parts at the store.
    async fn round(
        &self,
        policy: &Arc<Policy>,
        caller: &Caller,
        parts: &mut [ToolCharge<'_>],
        now: Timestamp,
    ) -> Round {
        let mut at = [0; MAX_TOOLS_PER_CALL];
        let mut n = 0;
        for (i, part) in parts.iter().enumerate() {
            if matches!(part.now, Standing::Open) {
                at[n] = i;
                n += 1;
            }
        }
        let open = &at[..n];
        if open.is_empty() {
            return Round::Done;
        }
        // The open parts' plans, each asking for its part's `ask`.
        let mut asked = [parts[open[0]].plan; MAX_TOOLS_PER_CALL];
        for (plan, &i) in asked.iter_mut().zip(open) {
            *plan = Plan {
                cost: parts[i].ask,
                ..parts[i].plan
            };
        }
        let started = crate::telemetry::Started::now();
        let decided = self.inner.store.decide(&asked[..open.len()]).await;
        started.record(self.inner.store.kind());
        let granting = open.iter().any(|&i| parts[i].ask > parts[i].plan.cost);
        match decided {
            Ok(Decision::Admitted(a)) => self.admitted(caller, parts, open, a, now),
            Ok(Decision::Refused(_)) if granting => self.asked_too_much(parts, open),
            Ok(Decision::Refused(r)) => {
                let at = open
                    .iter()
                    .copied()
                    .find(|&i| parts[i].plan.tool.name() == r.tool())
                    .unwrap_or(open[0]);
                let plan = parts[at].plan;
                match self.conclude(policy, caller, &plan, Decided::Refused(r)) {
                    Ok(shadow) => {
                        let r = shadow.shadow_refusal.expect("a refusal let through");
                        parts[at].now = Standing::Shadowed(r);
                        Round::Again
                    }
                    Err(r) => Round::Refused(r),
                }
            }
            Err(e) => self.failed(policy, caller, parts, open, e),
        }
    }

    /// The store admitted the open parts `open`: each keeps its admission (a grant goes to
    /// the caller's lease), unless a grant had to borrow — then all go back and the parts are
    /// asked again for their own costs.
    fn admitted(
        &self,
        caller: &Caller,
        parts: &mut [ToolCharge<'_>],
        open: &[usize],
        admissions: Admissions,
        now: Timestamp,
    ) -> Round {
        let borrowed = open
            .iter()
            .zip(admissions.iter())
            .any(|(&i, a)| parts[i].ask > parts[i].plan.cost && lease::borrowed(a));
        if borrowed {
            for a in admissions {
                self.give_back_grant(Some(a), now);
            }
            return self.asked_too_much(parts, open);
        }
        let mut returns = Vec::new();
        for (&i, a) in open.iter().zip(admissions) {
            let part = &mut parts[i];
            let charged = self.keep(caller, &part.plan, a, part.ask, &mut returns);
            part.now = Standing::Charged(charged);
        }
        self.give_back(returns, now);
        Round::Done
    }

    /// A grant above a part's cost was refused or borrowed: the callers' next grants are one
    /// call's cost, and every part is asked again for its own.
    fn asked_too_much(&self, parts: &mut [ToolCharge<'_>], open: &[usize]) -> Round {
        for &i in open {
            let part = &mut parts[i];
            if part.ask > part.plan.cost {
                self.inner.leases.cool(&part.plan);
                part.ask = part.plan.cost;
            }
        }
        Round::Again
    }

    /// The store could not decide: each open part as its tool's `on_store_error` says; the
    /// call is refused if any of them refuses.
    fn failed(
        &self,
        policy: &Arc<Policy>,
        caller: &Caller,
        parts: &mut [ToolCharge<'_>],
        open: &[usize],
        e: StoreError,
    ) -> Round {
        for &i in open {
            let plan = parts[i].plan;
            match self.conclude(policy, caller, &plan, Decided::Failed(e.clone())) {
                Ok(_) => parts[i].now = Standing::Shadowed(unmetered(&plan)),
                Err(r) => return Round::Refused(r),
            }
        }
        Round::Done
    }

    /// The call was refused: what its parts spent from leases goes back to them, and what
    /// the store admitted of it (none: it decides all parts at once) stays untouched.
    fn put_back(&self, parts: &mut [ToolCharge<'_>], now: Timestamp) {
        let mut returns = Vec::new();
        for part in parts.iter_mut() {
            if let Standing::Spent(spent) = std::mem::replace(&mut part.now, Standing::Open) {
                self.inner.leases.unspend(spent, &mut returns);
            }
        }
        self.give_back(returns, now);
    }

    /// The admitted call's tickets, in the order of its charges, each recorded.
    fn tickets(
        &self,
        policy: &Arc<Policy>,
        caller: &Caller,
        parts: Vec<ToolCharge<'_>>,
    ) -> Vec<Ticket> {
        parts
            .into_iter()
            .map(|part| {
                let plan = part.plan;
                let (tool, cost) = (plan.tool.name(), Cost(plan.cost));
                let outcome = match part.now {
                    Standing::Spent(spent) => self.spent(caller, tool, cost, spent, Some(policy)),
                    Standing::Charged(c) => self.conclude(policy, caller, &plan, Decided::Own(c)),
                    // Recorded when it was decided.
                    Standing::Shadowed(r) => Ok(Ticket::uncharged(
                        Some(r).filter(|r| r.detail != Some(UNMETERED)),
                        plan.tool.period().as_secs_ceil(),
                        plan.tool.unit(),
                    )),
                    Standing::Open => unreachable!("every part of an admitted call is decided"),
                };
                outcome.expect("an admitted part")
            })
            .collect()
    }
}

/// The mark of a part let through unmetered because the store failed (not a shadow refusal).
const UNMETERED: &str = "unmetered";

fn unmetered(plan: &Plan<'_>) -> Refusal {
    let mut r = Refusal::new(Reason::StoreUnavailable, plan.tool.name());
    r.detail = Some(UNMETERED);
    r
}

/// Why tool `i` of a call cannot be charged with the ones before it: the refusal's detail, and
/// what to change, logged.
fn apart(
    before: &[ToolCharge<'_>],
    plan: &Plan<'_>,
    i: usize,
) -> Option<(&'static str, &'static str)> {
    if i >= MAX_TOOLS_PER_CALL {
        return Some(("too_many_tools", "a call may be charged to at most 8 tools"));
    }
    let name = plan.tool.name();
    if before.iter().any(|p| p.plan.tool.name() == name) {
        let why = "a call names one tool twice: charge it once, with the sum";
        return Some(("tool_charged_twice", why));
    }
    let first = &before.first()?.plan;
    let why = "tools charged together by one call must share a group: give them the same `group` in the policy";
    (first.tool.group() != plan.tool.group()).then_some(("tools_not_grouped", why))
}

#[cfg(test)]
mod tests {
    use crate::clock::{ManualClock, Timestamp};
    use crate::{Caller, Cost, Limiter, MemoryStore, Policy, Reason, Store};

    const EPOCH: Timestamp = Timestamp(1_767_225_600_000_000);

    fn limiter(toml: &str) -> Limiter<MemoryStore, ManualClock> {
        let policy = Policy::from_toml_str(toml).unwrap();
        Limiter::with_store(policy, MemoryStore::new(), ManualClock::new(EPOCH))
    }

    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(f)
    }

    const TWO: &str = r#"
        [[tool]]
        name = "a"
        group = "g"
        unit = "calls"
        rate = { limit = 600, per = "1m" }
        [tool.default_tenant]
        ceiling = 60
        burst = 60
        [[tool]]
        name = "b"
        group = "g"
        unit = "tokens"
        rate = { limit = 6000, per = "1m" }
        [tool.default_tenant]
        ceiling = 600
        burst = 600
        [[tool]]
        name = "apart"
        unit = "calls"
        rate = { limit = 600, per = "1m" }
        [tool.default_tenant]
    "#;

    #[test]
    fn tools_apart_or_named_twice_are_refused_and_charge_nothing() {
        let l = limiter(TWO);
        let acme = Caller::new("acme");
        block_on(async {
            let r = l
                .admit_all(&acme, &[("a", Cost(1.0)), ("apart", Cost(1.0))])
                .await
                .unwrap_err();
            assert_eq!(
                (r.reason, r.detail),
                (Reason::PermissionDenied, Some("tools_not_grouped"))
            );
            assert!(!r.retryable);
            let r = l
                .admit_all(&acme, &[("a", Cost(1.0)), ("a", Cost(1.0))])
                .await
                .unwrap_err();
            assert_eq!(r.detail, Some("tool_charged_twice"));
            let keys = l.call_keys(&acme, "a").unwrap();
            assert_eq!(
                l.store().inspect(&keys).await.unwrap()[1],
                None,
                "nothing charged"
            );
        });
    }

    /// With leases (the default), most calls of a busy caller are spent from its leases on
    /// both tools; when one tool refuses, what the other part spent goes back to its lease,
    /// and the store counts exactly the calls admitted once the leases are given back.
    #[test]
    fn parts_spent_from_leases_go_back_when_another_tool_refuses() {
        let l = limiter(TWO);
        let acme = Caller::new("acme");
        block_on(async {
            let mut admitted = 0.0;
            for i in 0..200u64 {
                l.clock()
                    .set(EPOCH.saturating_add(std::time::Duration::from_millis(i)));
                if l.admit_all(&acme, &[("a", Cost(1.0)), ("b", Cost(20.0))])
                    .await
                    .is_ok()
                {
                    admitted += 1.0;
                }
            }
            // b's burst, 600 tokens, is 30 calls; a would have taken 60.
            assert!((30.0..=32.0).contains(&admitted), "{admitted}");
            assert!(l.leased_units() > 0.0, "a's calls are spent from a lease");
            l.return_leases().await;
            let a = l
                .store()
                .inspect(&l.call_keys(&acme, "a").unwrap())
                .await
                .unwrap();
            let b = l
                .store()
                .inspect(&l.call_keys(&acme, "b").unwrap())
                .await
                .unwrap();
            assert_eq!(a[1].unwrap().total, admitted, "a counts the calls admitted");
            assert_eq!(
                b[1].unwrap().total,
                admitted * 20.0,
                "b counts their tokens"
            );
        });
    }

    /// A tool in shadow mode never refuses a call: its refusal is logged and its part let
    /// through uncharged, and the enforcing tool still decides.
    #[test]
    fn a_shadow_tool_lets_its_part_through_and_the_other_still_decides() {
        let l = limiter(&TWO.replacen("name = \"b\"", "name = \"b\"\nenforce = false", 1));
        let acme = Caller::new("acme");
        block_on(async {
            let t = l
                .admit_all(&acme, &[("a", Cost(1.0)), ("b", Cost(5000.0))])
                .await
                .unwrap();
            assert!(t[1].shadow_refusal().is_some() && t[1].cost().is_none());
            assert_eq!(t[0].cost(), Some(1.0));
            let r = l
                .admit_all(&acme, &[("a", Cost(100.0)), ("b", Cost(1.0))])
                .await
                .unwrap_err();
            assert_eq!(r.tool(), "a");
        });
    }
}
