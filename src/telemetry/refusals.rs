//! Refusal lines an operator can keep on: one `info` line per caller (tool, tenant, instance)
//! per window of the tool's period, saying how many of its refusals the window before held
//! back; the others at `debug`. At most [`PER_SECOND`] `info` lines per tool and second of the
//! limiter's clock, whatever the number of callers, so a flood of new identities cannot turn
//! them back into one line per call. The metrics count every refusal.
//!
//! Callers are kept in [`SHARDS`] maps by the hash of their name, each behind its own lock, so
//! refusals of different callers on different threads do not wait for each other; the
//! per-tool count of lines a second is consulted only when a caller's line is due.

use std::collections::HashMap;
use std::sync::Mutex;

/// `info` refusal lines per tool and second at most.
pub(crate) const PER_SECOND: u32 = 5;
/// Callers remembered at most per shard (more forget that shard's and start over).
const MAX_CALLERS: usize = 1024;
/// Maps of callers, each behind its own lock.
const SHARDS: usize = 16;

#[derive(Default, Debug)]
pub(crate) struct RefusalLines {
    /// Per caller (a hash of tool, tenant and instance): the window its last `info` line was
    /// in, refusals since, and its refusals in the current window.
    callers: [Mutex<HashMap<u64, Caller>>; SHARDS],
    /// Per tool (a hash of its name): the second its last `info` lines were in, and how many.
    tools: Mutex<HashMap<u64, (u64, u32)>>,
}

#[derive(Debug, Default)]
struct Caller {
    line_window: u64,
    held: u64,
    window: u64,
    in_window: u64,
}

/// What a refusal is, for its caller's lines: `info` (with how many the caller's earlier
/// refusals held back) or not, and the caller's refusals in this window so far (this one
/// included).
pub(crate) struct Seen {
    pub(crate) info: Option<u64>,
    pub(crate) in_window: u64,
}

fn hash(parts: &[&str]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    parts.hash(&mut h);
    h.finish()
}

/// One refusal's decision event at `$level`, with `$held` fields after the refusal's own.
macro_rules! refusal_event {
    ($level:ident, $r:expr, [$tool:expr, $tenant:expr, $instance:expr], $cost:expr, $outcome:expr, $($held:tt)*) => {
        tracing::$level!(
            target: "tower_fairshare::decision",
            tool = $tool, tenant = $tenant, instance = $instance, cost = $cost, outcome = $outcome,
            reason = $r.reason.as_str(),
            scope = $r.scope.map_or("none", |s| s.as_str()),
            window = $r.window().unwrap_or(""),
            limit = $r.limit,
            used = $r.used,
            retry_after_ms = $r.retry_after.map(|d| d.as_millis() as u64),
            retryable = $r.retryable,
            $($held)*
        )
    };
}

impl RefusalLines {
    /// The decision event of refusal `r` of `[tool, tenant, instance]`, in window and second
    /// `at` of the limiter's clock: `info` for the caller's first in the window (with how many
    /// the window before held back), `debug` for the rest.
    /// Returns the caller's refusals in this window so far.
    pub(crate) fn event(
        &self,
        r: &crate::Refusal,
        [tool, tenant, instance]: [&str; 3],
        cost: f64,
        outcome: &'static str,
        [window, second]: [u64; 2],
    ) -> u64 {
        let seen = self.see(tool, tenant, instance, window, second);
        match seen.info {
            Some(held_back) => {
                refusal_event!(info, r, [tool, tenant, instance], cost, outcome, held_back)
            }
            None => refusal_event!(debug, r, [tool, tenant, instance], cost, outcome,),
        }
        seen.in_window
    }

    /// This refusal of `tenant`/`instance` at `tool`, in window `window` and second
    /// `second`: whether it gets an `info` line (see [`Seen`]).
    pub(crate) fn see(
        &self,
        tool: &str,
        tenant: &str,
        instance: &str,
        window: u64,
        second: u64,
    ) -> Seen {
        let key = hash(&[tool, tenant, instance]);
        let mut callers = self.callers[key as usize % SHARDS]
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if callers.len() >= MAX_CALLERS {
            callers.clear();
        }
        let c = callers.entry(key).or_insert(Caller {
            line_window: u64::MAX,
            window,
            ..Caller::default()
        });
        if c.window != window {
            c.window = window;
            c.in_window = 0;
        }
        c.in_window += 1;
        let in_window = c.in_window;
        if c.line_window == window || !self.line_due(tool, second) {
            c.held += 1;
            return Seen {
                info: None,
                in_window,
            };
        }
        c.line_window = window;
        Seen {
            info: Some(std::mem::take(&mut c.held)),
            in_window,
        }
    }

    /// Whether `tool` may write one more `info` refusal line in `second` (and counts it).
    fn line_due(&self, tool: &str, second: u64) -> bool {
        let mut tools = self.tools.lock().unwrap_or_else(|e| e.into_inner());
        if tools.len() >= MAX_CALLERS {
            tools.clear();
        }
        let t = tools.entry(hash(&[tool])).or_insert((second, 0));
        if t.0 != second {
            *t = (second, 0);
        }
        t.1 += 1;
        t.1 <= PER_SECOND
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A runaway refused a thousand times in a window gets one line in it, and the next
    /// window's line says how many were held back; a thousand new identities in one second
    /// get at most `PER_SECOND` lines.
    #[test]
    fn one_line_per_caller_per_window_and_a_few_per_second() {
        let lines = RefusalLines::default();
        let through = (0..1000)
            .filter(|k| lines.see("t", "runaway", "", 7, k / 100).info.is_some())
            .count();
        assert_eq!(through, 1);
        let next = lines.see("t", "runaway", "", 8, 60);
        assert_eq!((next.info, next.in_window), (Some(999), 1));
        let new = (0..1000)
            .filter(|k| lines.see("t", &format!("id-{k}"), "", 8, 61).info.is_some())
            .count();
        assert_eq!(new, PER_SECOND as usize);
        // Another tool has its own count.
        assert_eq!(lines.see("u", "runaway", "", 8, 61).info, Some(0));
    }
}
