//! Why a call was refused, in a form a program (or an agent) can act on.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::clock::Timestamp;

/// The kind of refusal; its [`as_str`](Reason::as_str) is the `error` field of the JSON body.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Reason {
    /// A rate (floor, share, ceiling, tool capacity) has no room now.
    RateLimited,
    /// A calendar budget, or the number of template callers counted, is used up.
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
#[non_exhaustive]
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
///
/// Its fields are [`RefusalDetails`]', read through it (`refusal.reason`,
/// `refusal.retry_after`; the names through `refusal.tool()`, `refusal.tenant()`,
/// `refusal.instance()`, `refusal.window()`). They are boxed: a refusal is one pointer wide, so the
/// `Result<Ticket, Refusal>` every decision answers stays as small as its ticket, and an
/// admitted call never moves the room a refusal needs.
///
/// [`Ticket`]: crate::Ticket
#[derive(Clone, PartialEq)]
pub struct Refusal(Box<RefusalDetails>);

impl std::ops::Deref for Refusal {
    type Target = RefusalDetails;

    fn deref(&self) -> &RefusalDetails {
        &self.0
    }
}

impl std::ops::DerefMut for Refusal {
    fn deref_mut(&mut self) -> &mut RefusalDetails {
        &mut self.0
    }
}

impl fmt::Debug for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

/// What a [`Refusal`] says: what refused the call, the numbers behind it, and when a retry
/// can succeed.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct RefusalDetails {
    /// The kind of refusal.
    pub reason: Reason,
    /// The tool, the caller and the window, read through [`tool`](Self::tool),
    /// [`tenant`](Self::tenant), [`instance`](Self::instance) and [`window`](Self::window).
    names: Arc<Names>,
    /// The caller's instance when the names have none (the tool does not limit instances
    /// separately): named for each call, so a refusal given again from memory to another
    /// instance of the same tenant still shares all its other names.
    caller_instance: Option<Arc<str>>,
    /// The level that refused.
    pub scope: Option<Scope>,
    /// The limit of that window.
    pub limit: Option<f64>,
    /// How much of it is used.
    pub used: Option<f64>,
    /// Length of that window in seconds (the `w` of `RateLimit-Policy`), when it is a window
    /// of time.
    pub window_secs: Option<u64>,
    /// What `limit` and `used` count: the refusing tool's unit (calls, tokens, seconds), when
    /// the refusal is about them.
    pub unit: Option<crate::policy::Unit>,
    /// When the call could next succeed (absent when it never can).
    pub reset_at: Option<Timestamp>,
    /// How long to wait before retrying (absent when it never can).
    pub retry_after: Option<Duration>,
    /// False only when retrying can never succeed (a cost above capacity, a tier denial,
    /// no identity).
    pub retryable: bool,
    /// For refusals that are not about a window, what was wrong: `missing_tenant`, `tier`,
    /// `unknown_tool`, `unlisted_tenant`, `unknown_plan`, `unlisted_instance`, `invalid_cost`,
    /// `store`.
    pub detail: Option<&'static str>,
    /// A wait the same call surely cannot pass before (`retry_after` is the engine's estimate
    /// and may be later): what a store may remember the refusal for. Absent when any moment
    /// may change the answer (concurrency, template callers counted).
    pub(crate) not_before: Option<Duration>,
}

/// The names a refusal carries, behind one pointer: a refusal given again from memory shares
/// them (one reference count, not four), and each name is shared with the policy or the
/// caller it came from.
#[derive(Clone, Debug, PartialEq)]
struct Names {
    tool: Arc<str>,
    tenant: Option<Arc<str>>,
    instance: Option<Arc<str>>,
    window: Option<Arc<str>>,
}

impl RefusalDetails {
    /// The tool called.
    pub fn tool(&self) -> &str {
        &self.names.tool
    }

    /// The caller's tenant.
    pub fn tenant(&self) -> Option<&str> {
        self.names.tenant.as_deref()
    }

    /// The caller's instance.
    pub fn instance(&self) -> Option<&str> {
        self.names
            .instance
            .as_deref()
            .or(self.caller_instance.as_deref())
    }

    /// The window that is full: a budget period (`hour`), the rate period (`1m`),
    /// `in_flight`, or `callers` for too many template callers.
    pub fn window(&self) -> Option<&str> {
        self.names.window.as_deref()
    }

    /// The window, shared.
    pub(crate) fn window_shared(&self) -> Option<Arc<str>> {
        self.names.window.clone()
    }

    /// Names the caller.
    pub(crate) fn set_caller(&mut self, tenant: Option<Arc<str>>, instance: Option<Arc<str>>) {
        let n = Arc::make_mut(&mut self.names);
        n.tenant = tenant;
        n.instance = instance;
        self.caller_instance = None;
    }

    /// Names the caller's instance, where the refusal's own names have none (the names it
    /// shares are left as they are).
    pub(crate) fn set_instance(&mut self, instance: Option<Arc<str>>) {
        self.caller_instance = instance;
    }
}

impl Refusal {
    /// A refusal of a call of `tool` (a name the policy or the caller gave, or a copy).
    pub(crate) fn new(reason: Reason, tool: impl Into<Arc<str>>) -> Self {
        Self::named(reason, tool.into(), None, None, None)
    }

    /// A refusal of a call of `tool` by `tenant` and `instance`, `window` full.
    pub(crate) fn named(
        reason: Reason,
        tool: Arc<str>,
        tenant: Option<Arc<str>>,
        instance: Option<Arc<str>>,
        window: Option<Arc<str>>,
    ) -> Self {
        Refusal(Box::new(RefusalDetails {
            reason,
            names: Arc::new(Names {
                tool,
                tenant,
                instance,
                window,
            }),
            caller_instance: None,
            scope: None,
            limit: None,
            used: None,
            window_secs: None,
            unit: None,
            reset_at: None,
            retry_after: None,
            retryable: false,
            detail: None,
            not_before: None,
        }))
    }

    /// How long a store may answer the same call (same caller, tool, policy and cost) with
    /// this refusal without deciding it again: its sure wait, for refusals whose wait the
    /// engine bounds (a rate, a calendar budget; not a count of template callers, one of which
    /// can stop counting at any moment) on paths without a concurrency cap (a permit can be
    /// released at any moment). `None` for the rest, and for waits under a millisecond.
    fn remember_for(&self, plan: &super::plan::Plan<'_>) -> Option<Duration> {
        let bounded = match self.reason {
            Reason::RateLimited => true,
            Reason::CapExceeded => self.window() != Some("callers"),
            _ => false,
        };
        let capped = plan.capped();
        let wait = self.not_before?;
        (bounded && !capped && self.retryable && wait >= Duration::from_millis(1)).then_some(wait)
    }

    /// Whole seconds to wait, rounded up, at least 1: the `Retry-After` header.
    pub fn retry_after_secs(&self) -> u64 {
        match self.retry_after {
            Some(d) => d.as_micros().div_ceil(1_000_000).max(1) as u64,
            None => 1,
        }
    }

    /// The JSON body of an HTTP or gRPC refusal (its fields are listed in the README).
    pub fn to_json(&self) -> String {
        let mut o = String::with_capacity(256);
        // Writing to a `String` cannot fail.
        let _ = self.write_json(&mut o);
        o
    }

    /// Writes the JSON body to `o`; fails only when `o` is full.
    pub(crate) fn write_json(&self, o: &mut impl fmt::Write) -> fmt::Result {
        o.write_str("{\"error\":\"")?;
        o.write_str(self.reason.as_str())?;
        o.write_str("\",\"tool\":")?;
        json_str(o, self.tool())?;
        o.write_str(",\"tenant\":")?;
        json_opt(o, self.tenant())?;
        o.write_str(",\"instance\":")?;
        json_opt(o, self.instance())?;
        o.write_str(",\"scope\":")?;
        json_opt(o, self.scope.map(Scope::as_str))?;
        o.write_str(",\"window\":")?;
        json_opt(o, self.window())?;
        o.write_str(",\"limit\":")?;
        json_num(o, self.limit)?;
        o.write_str(",\"used\":")?;
        json_num(o, self.used)?;
        o.write_str(",\"unit\":")?;
        json_opt(o, self.unit.map(crate::policy::Unit::as_str))?;
        o.write_str(",\"reset_at\":")?;
        match self.reset_at {
            Some(t) => write!(o, "\"{t}\"")?,
            None => o.write_str("null")?,
        }
        o.write_str(",\"retry_after_ms\":")?;
        match self.retry_after {
            Some(d) => {
                o.write_str(itoa::Buffer::new().format(d.as_micros().div_ceil(1000) as u64))?
            }
            None => o.write_str("null")?,
        }
        o.write_str(",\"retryable\":")?;
        o.write_str(if self.retryable { "true" } else { "false" })?;
        if let Some(d) = self.detail {
            o.write_str(",\"detail\":")?;
            json_str(o, d)?;
        }
        o.write_char('}')
    }
}

/// A refusal kept for as long as the same call surely cannot pass (see
/// `Refusal::remember_for`): what the in-process store's memory and the Redis store's cache
/// hold, each beside what it finds the call by.
#[derive(Debug)]
pub(crate) struct Kept {
    refusal: Refusal,
    /// The policy it was decided under: a reload decides afresh.
    policy: Arc<crate::policy::ToolPolicy>,
    cost: f64,
    /// Valid from `from` until `until`, µs of the plan's clock.
    from: u64,
    until: u64,
}

impl Kept {
    /// `refusal` of the call `plan` made, kept for its sure wait; `None` when it has none to
    /// keep it for.
    pub(crate) fn new(refusal: &Refusal, plan: &super::plan::Plan<'_>) -> Option<Kept> {
        let wait = refusal.remember_for(plan)?;
        let from = plan.now.as_micros();
        Some(Kept {
            refusal: refusal.clone(),
            policy: plan.tool.clone(),
            cost: plan.cost,
            from,
            until: from.saturating_add(wait.as_micros() as u64),
        })
    }

    /// How long it is kept for.
    #[cfg(feature = "redis")]
    pub(crate) fn wait(&self) -> Duration {
        Duration::from_micros(self.until - self.from)
    }

    /// When it stops standing, µs of the plan's clock.
    pub(crate) fn until(&self) -> u64 {
        self.until
    }

    /// Whether it stands for the call `plan` makes (its keys being the same): another cost
    /// may pass, or never pass, and another policy may let it pass.
    pub(crate) fn stands_for(&self, plan: &super::plan::Plan<'_>) -> bool {
        (plan.cost - self.cost).abs() <= super::bucket::EPS && Arc::ptr_eq(&self.policy, plan.tool)
    }

    /// The time left at `now` on the plan's clock, if it stands then.
    pub(crate) fn left_at(&self, now: Timestamp) -> Option<Duration> {
        let now = now.as_micros();
        (now >= self.from && now < self.until).then(|| Duration::from_micros(self.until - now))
    }

    /// The refusal given again, `left` before its sure wait is over: the time left is the
    /// wait it names.
    pub(crate) fn again(&self, left: Duration) -> Refusal {
        let mut r = self.refusal.clone();
        r.retry_after = Some(left);
        r
    }
}

/// The longest name a refusal echoes of what the caller made up (an unknown tool's).
const ECHOED: usize = 128;

/// `name`, cut to its first [`ECHOED`] bytes (at a character boundary) and marked `…` when
/// longer: a refusal of a made-up 16 KB name does not carry it back whole.
pub(crate) fn echoed(name: &str) -> Arc<str> {
    if name.len() <= ECHOED {
        return Arc::from(name);
    }
    let cut = (0..=ECHOED)
        .rev()
        .find(|&i| name.is_char_boundary(i))
        .unwrap_or(0);
    Arc::from(format!("{}…", &name[..cut]))
}

fn json_opt(o: &mut impl fmt::Write, s: Option<&str>) -> fmt::Result {
    match s {
        Some(s) => json_str(o, s),
        None => o.write_str("null"),
    }
}

fn json_num(o: &mut impl fmt::Write, n: Option<f64>) -> fmt::Result {
    match n {
        Some(n) if n.is_finite() => {
            if n.fract() == 0.0 && n.abs() < 9.0e15 {
                o.write_str(itoa::Buffer::new().format(n as i64))
            } else {
                write!(o, "{n:.3}")
            }
        }
        _ => o.write_str("null"),
    }
}

/// `s` as a JSON string: quotes, backslashes and control characters escaped.
fn json_str(o: &mut impl fmt::Write, s: &str) -> fmt::Result {
    o.write_char('"')?;
    // Copy runs of characters that need no escaping in one write.
    let mut run = 0;
    for (i, b) in s.bytes().enumerate() {
        let escape = match b {
            b'"' => "\\\"",
            b'\\' => "\\\\",
            b'\n' => "\\n",
            b'\r' => "\\r",
            b'\t' => "\\t",
            b if b < 0x20 => "",
            _ => continue,
        };
        o.write_str(&s[run..i])?;
        run = i + 1;
        if escape.is_empty() {
            write!(o, "\\u{b:04x}")?;
        } else {
            o.write_str(escape)?;
        }
    }
    o.write_str(&s[run..])?;
    o.write_char('"')
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} calling `{}`", self.reason.as_str(), self.tool())?;
        if let Some(s) = self.scope {
            write!(f, " at {} scope", s.as_str())?;
        }
        if let Some(d) = self.detail {
            write!(f, " ({d})")?;
        }
        if let (Some(w), Some(l), Some(u)) = (self.window(), self.limit, self.used) {
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
    fn a_long_made_up_name_is_echoed_cut_short() {
        assert_eq!(&*echoed("web_search"), "web_search");
        let long = "é".repeat(8 * 1024);
        let cut = echoed(&long);
        assert!(cut.len() <= ECHOED + '…'.len_utf8(), "{} bytes", cut.len());
        assert!(cut.ends_with('…') && long.starts_with(cut.trim_end_matches('…')));
    }

    #[test]
    fn json_has_every_field_and_parses() {
        let mut r = Refusal::named(
            Reason::CapExceeded,
            "web_search".into(),
            Some("team-\"support".into()),
            Some("agent-7".into()),
            Some("hour".into()),
        );
        r.scope = Some(Scope::Tenant);
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

    #[test]
    fn control_characters_and_unicode_are_escaped_like_json() {
        let s = "a\u{1}b\"c\\d\ne\rf\tg\u{1f}ü{}";
        let mut o = String::new();
        json_str(&mut o, s).unwrap();
        assert_eq!(o, serde_json::to_string(s).unwrap());
    }
}
