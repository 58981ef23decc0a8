//! Why a call was refused, in a form a program (or an agent) can act on.

use std::fmt;
use std::time::Duration;

use crate::clock::Timestamp;

/// The kind of refusal; its [`as_str`](Reason::as_str) is the `error` field of the JSON body.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Reason {
    /// A rate (floor, share, ceiling, tool capacity) has no room now.
    RateLimited,
    /// A calendar budget, or the number of tracked callers, is used up.
    CapExceeded,
    /// Too many calls in flight.
    ConcurrencyExceeded,
    /// The caller's tier may not call the tool, or the tool is unknown.
    PermissionDenied,
    /// No caller identity (or no tenant where the tool requires one).
    UnidentifiedCaller,
    /// The store could not be reached and the tool fails closed.
    StoreUnavailable,
}

impl Reason {
    /// The wire name: `rate_limited`, `cap_exceeded`, ...
    pub const fn as_str(self) -> &'static str {
        match self {
            Reason::RateLimited => "rate_limited",
            Reason::CapExceeded => "cap_exceeded",
            Reason::ConcurrencyExceeded => "concurrency_exceeded",
            Reason::PermissionDenied => "permission_denied",
            Reason::UnidentifiedCaller => "unidentified_caller",
            Reason::StoreUnavailable => "store_unavailable",
        }
    }
}

/// The level that refused.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Scope {
    /// The whole tool.
    Tool,
    /// The caller's tenant.
    Tenant,
    /// The caller's instance within its tenant.
    Instance,
}

impl Scope {
    /// `tool`, `tenant` or `instance`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Scope::Tool => "tool",
            Scope::Tenant => "tenant",
            Scope::Instance => "instance",
        }
    }
}

/// A refused call: what refused it, the numbers behind it, and when a retry can succeed.
#[derive(Clone, Debug, PartialEq)]
pub struct Refusal {
    /// The kind of refusal.
    pub reason: Reason,
    /// The tool called.
    pub tool: String,
    /// The caller's tenant.
    pub tenant: Option<String>,
    /// The caller's instance.
    pub instance: Option<String>,
    /// The level that refused.
    pub scope: Option<Scope>,
    /// The window that is full: a budget period (`hour`), the rate period (`1m`),
    /// `in_flight`, or `callers` for too many tracked callers.
    pub window: Option<String>,
    /// The limit of that window.
    pub limit: Option<f64>,
    /// How much of it is used.
    pub used: Option<f64>,
    /// Length of that window in seconds (the `w` of `RateLimit-Policy`), when it is a window
    /// of time.
    pub window_secs: Option<u64>,
    /// When the call could next succeed (absent when it never can).
    pub reset_at: Option<Timestamp>,
    /// How long to wait before retrying (absent when it never can).
    pub retry_after: Option<Duration>,
    /// False only when retrying can never succeed (a cost above capacity, a tier denial,
    /// no identity).
    pub retryable: bool,
    /// For refusals that are not about a window, what was wrong: `missing_tenant`, `tier`,
    /// `unknown_tool`, `unlisted_tenant`, `unlisted_instance`, `invalid_cost`, `store`.
    pub detail: Option<&'static str>,
}

impl Refusal {
    pub(crate) fn new(reason: Reason, tool: &str) -> Self {
        Refusal {
            reason,
            tool: tool.to_owned(),
            tenant: None,
            instance: None,
            scope: None,
            window: None,
            limit: None,
            used: None,
            window_secs: None,
            reset_at: None,
            retry_after: None,
            retryable: false,
            detail: None,
        }
    }

    /// Whole seconds to wait, rounded up, at least 1: the `Retry-After` header.
    pub fn retry_after_secs(&self) -> u64 {
        match self.retry_after {
            Some(d) => d.as_micros().div_ceil(1_000_000).max(1) as u64,
            None => 1,
        }
    }

    /// The JSON body of an HTTP or gRPC refusal (SPEC §4).
    pub fn to_json(&self) -> String {
        let mut o = String::with_capacity(256);
        o.push_str("{\"error\":\"");
        o.push_str(self.reason.as_str());
        o.push_str("\",\"tool\":");
        json_str(&mut o, &self.tool);
        o.push_str(",\"tenant\":");
        json_opt(&mut o, self.tenant.as_deref());
        o.push_str(",\"instance\":");
        json_opt(&mut o, self.instance.as_deref());
        o.push_str(",\"scope\":");
        json_opt(&mut o, self.scope.map(Scope::as_str));
        o.push_str(",\"window\":");
        json_opt(&mut o, self.window.as_deref());
        o.push_str(",\"limit\":");
        json_num(&mut o, self.limit);
        o.push_str(",\"used\":");
        json_num(&mut o, self.used);
        o.push_str(",\"reset_at\":");
        match self.reset_at {
            Some(t) => {
                o.push('"');
                o.push_str(&t.to_rfc3339());
                o.push('"');
            }
            None => o.push_str("null"),
        }
        o.push_str(",\"retry_after_ms\":");
        match self.retry_after {
            Some(d) => o.push_str(itoa::Buffer::new().format(d.as_micros().div_ceil(1000) as u64)),
            None => o.push_str("null"),
        }
        o.push_str(",\"retryable\":");
        o.push_str(if self.retryable { "true" } else { "false" });
        if let Some(d) = self.detail {
            o.push_str(",\"detail\":");
            json_str(&mut o, d);
        }
        o.push('}');
        o
    }
}

fn json_opt(o: &mut String, s: Option<&str>) {
    match s {
        Some(s) => json_str(o, s),
        None => o.push_str("null"),
    }
}

fn json_num(o: &mut String, n: Option<f64>) {
    match n {
        Some(n) if n.is_finite() => {
            if n.fract() == 0.0 && n.abs() < 9.0e15 {
                o.push_str(itoa::Buffer::new().format(n as i64));
            } else {
                o.push_str(&format!("{:.3}", n));
            }
        }
        _ => o.push_str("null"),
    }
}

pub(crate) fn json_str(o: &mut String, s: &str) {
    o.push('"');
    for c in s.chars() {
        match c {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            '\n' => o.push_str("\\n"),
            '\r' => o.push_str("\\r"),
            '\t' => o.push_str("\\t"),
            c if (c as u32) < 0x20 => o.push_str(&format!("\\u{:04x}", c as u32)),
            c => o.push(c),
        }
    }
    o.push('"');
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} calling `{}`", self.reason.as_str(), self.tool)?;
        if let Some(s) = self.scope {
            write!(f, " at {} scope", s.as_str())?;
        }
        if let (Some(w), Some(l), Some(u)) = (&self.window, self.limit, self.used) {
            write!(f, " ({w}: {u} of {l} used)")?;
        }
        match self.retry_after {
            Some(d) if self.retryable => write!(f, "; retry in {} ms", d.as_millis()),
            _ => write!(f, "; retrying will not help"),
        }
    }
}

impl std::error::Error for Refusal {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_has_every_field_and_parses() {
        let mut r = Refusal::new(Reason::CapExceeded, "web_search");
        r.tenant = Some("team-\"support".into());
        r.instance = Some("agent-7".into());
        r.scope = Some(Scope::Tenant);
        r.window = Some("hour".into());
        r.limit = Some(250.0);
        r.used = Some(250.0);
        r.reset_at = Some(Timestamp(1_779_462_000_000_000));
        r.retry_after = Some(Duration::from_millis(1200));
        r.retryable = true;
        let v: serde_json::Value = serde_json::from_str(&r.to_json()).unwrap();
        assert_eq!(v["error"], "cap_exceeded");
        assert_eq!(v["tenant"], "team-\"support");
        assert_eq!(v["limit"], 250);
        assert_eq!(v["retry_after_ms"], 1200);
        assert_eq!(v["reset_at"], "2026-05-22T15:00:00Z");
        assert_eq!(v["retryable"], true);
        assert_eq!(r.retry_after_secs(), 2);
    }
}
