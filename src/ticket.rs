//! [`Ticket`]: what an admitted call holds.

use std::sync::Arc;

use crate::admission::{Refusal, Scope};
use crate::lease::GrantShare;
use crate::policy::Unit;
use crate::store::Admission;

/// An admitted call: what to correct, refund or release later, and the figures of its
/// `RateLimit` headers.
///
/// ```
/// use tower_fairshare::{Caller, Cost, Limiter, Policy};
///
/// let policy = Policy::from_toml_str(r#"
///     [[tool]]
///     name = "search"
///     unit = "calls"
///     rate = { limit = 600, per = "1m" }
///     lease = "off"
///     [tool.tenants.acme]
///     ceiling = 60
/// "#).unwrap();
/// let limiter = Limiter::new(policy);
/// let ticket = limiter
///     .try_admit(&Caller::new("acme"), "search", Cost(1.0))
///     .expect("the in-process store answers at once")
///     .expect("admitted");
/// assert_eq!(ticket.cost(), Some(1.0));
/// assert_eq!(ticket.quota(), Some(60.0));
/// assert_eq!(ticket.remaining(), Some(59.0));
/// assert_eq!(ticket.part(), 1.0, "decided on its own, not spent from a lease");
/// ```
#[derive(Clone, Debug)]
pub struct Ticket {
    pub(crate) admission: Option<Charged>,
    pub(crate) shadow_refusal: Option<Refusal>,
    pub(crate) window_secs: u64,
    pub(crate) unit: Unit,
}

/// What the store charged for an admitted call.
#[derive(Clone, Debug)]
pub(crate) enum Charged {
    /// The call's own admission.
    Own(Arc<Admission>),
    /// Spent from a lease: the lease's grant and the call's part of it.
    Leased(Arc<Admission>, GrantShare),
}

impl Ticket {
    /// A ticket of a call the store admitted on its own, or spent from a lease's grant.
    pub(crate) fn of(charged: Charged, window_secs: u64, unit: Unit) -> Ticket {
        Ticket {
            admission: Some(charged),
            shadow_refusal: None,
            window_secs,
            unit,
        }
    }

    /// A ticket of a call let through without a charge: unmetered (the store failed and the
    /// tool fails open) or, in shadow mode, refused by `shadow`.
    pub(crate) fn uncharged(shadow: Option<Refusal>, window_secs: u64, unit: Unit) -> Ticket {
        Ticket {
            admission: None,
            shadow_refusal: shadow,
            window_secs,
            unit,
        }
    }

    /// What the store charged for this call: the call's own admission, or, for a call spent
    /// from a lease, the lease's grant, of which the call took [`part`](Self::part). `None`
    /// when the call went through unmetered (the store was unreachable and the tool fails
    /// open) or, in shadow mode, when it would have been refused.
    pub fn admission(&self) -> Option<&Admission> {
        self.admission_arc().map(|a| &**a)
    }

    /// The admission, shared.
    pub(crate) fn admission_arc(&self) -> Option<&Arc<Admission>> {
        match self.admission.as_ref()? {
            Charged::Own(a) | Charged::Leased(a, _) => Some(a),
        }
    }

    /// The call's part of a lease's grant, if it was spent from one.
    pub(crate) fn leased_part(&self) -> Option<GrantShare> {
        match &self.admission {
            Some(Charged::Leased(_, p)) => Some(*p),
            _ => None,
        }
    }

    /// The call's share of [`admission`](Self::admission)'s charge at every level: 1 for a
    /// call decided on its own, its cost over the grant's for a call spent from a lease.
    pub fn part(&self) -> f64 {
        self.leased_part().map_or(1.0, |p| p.of)
    }

    /// What the call was charged, in the tool's units (its cost); `None` when unmetered.
    pub fn cost(&self) -> Option<f64> {
        let a = self.admission()?;
        Some(self.leased_part().map_or(a.charge.cost, |p| p.cost))
    }

    /// Units of the caller's quota left in the current aligned window as of this call (the
    /// `r` of the `RateLimit` header; units a lease holds for the caller count as its own).
    pub fn remaining(&self) -> Option<f64> {
        let a = self.admission()?;
        Some(self.leased_part().map_or(a.remaining, |p| p.remaining))
    }

    /// The caller's ceiling per period (the `q` of `RateLimit-Policy`).
    pub fn quota(&self) -> Option<f64> {
        self.admission().map(|a| a.quota)
    }

    /// How long until the aligned window resets, as of this call.
    pub fn reset_in(&self) -> Option<std::time::Duration> {
        let a = self.admission()?;
        let us = self.leased_part().map_or(a.reset_in, |p| p.reset_in);
        Some(std::time::Duration::from_micros(us.max(0.0).ceil() as u64))
    }

    /// In shadow mode (`enforce = false`), the refusal that would have been returned.
    pub fn shadow_refusal(&self) -> Option<&Refusal> {
        self.shadow_refusal.as_ref()
    }

    /// What a unit of the tool is (calls, tokens, seconds): what [`cost`](Self::cost),
    /// [`quota`](Self::quota) and [`remaining`](Self::remaining) count.
    pub fn unit(&self) -> Unit {
        self.unit
    }

    /// The tool's period in whole seconds (the `w` of `RateLimit-Policy`).
    pub fn window_secs(&self) -> u64 {
        self.window_secs
    }

    /// Whether the call holds concurrency permits to give back (a call spent from a lease
    /// never does: no level on a leased path caps calls in flight).
    pub fn holds_permits(&self) -> bool {
        matches!(&self.admission, Some(Charged::Own(a)) if a.charge.holds_permits())
    }

    /// The level whose allowance the caller draws on: `instance` when instances are limited
    /// separately, `tenant` otherwise.
    pub fn scope(&self) -> Scope {
        match self.admission() {
            Some(a) if a.keys.instance.is_some() => Scope::Instance,
            _ => Scope::Tenant,
        }
    }

    /// The ticket's permits, taken out of it (what is left reads as unmetered).
    pub(crate) fn take_permits(&mut self) -> Ticket {
        Ticket {
            admission: self.admission.take(),
            shadow_refusal: None,
            window_secs: self.window_secs,
            unit: self.unit,
        }
    }
}
