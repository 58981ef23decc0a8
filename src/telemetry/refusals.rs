//! Refusal lines an operator can keep on: one `info` line per caller (tool, tenant, instance)
//! per window of the tool's period, saying how many of its refusals the window before held
//! back; the others at `debug`. At most [`PER_SECOND`] `info` lines per tool and second of the
//! limiter's clock, whatever the number of callers, so a flood of new identities cannot turn
//! them back into one line per call. The metrics count every refusal.

use std::collections::HashMap;
use std::sync::Mutex;

/// `info` refusal lines per tool and second at most.
pub(crate) const PER_SECOND: u32 = 5;
/// Callers remembered at most (more forget them all and start over).
const MAX_CALLERS: usize = 4096;

#[derive(Default, Debug)]
pub(crate) struct RefusalLines {
    inner: Mutex<Lines>,
}

#[derive(Default, Debug)]
struct Lines {
    /// Per caller: the window its last `info` line was in, and refusals since.
    callers: HashMap<(String, String, String), (u64, u64)>,
    /// Per tool: the second its last `info` lines were in, and how many.
    tools: HashMap<String, (u64, u32)>,
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
    pub(crate) fn event(
        &self,
        r: &crate::Refusal,
        [tool, tenant, instance]: [&str; 3],
        cost: f64,
        outcome: &'static str,
        [window, second]: [u64; 2],
    ) {
        match self.info(tool, tenant, instance, window, second) {
            Some(held_back) => {
                refusal_event!(info, r, [tool, tenant, instance], cost, outcome, held_back)
            }
            None => refusal_event!(debug, r, [tool, tenant, instance], cost, outcome,),
        }
    }

    /// Whether this refusal of `tenant`/`instance` at `tool`, in window `window` and second
    /// `second`, gets an `info` line: `Some(n)` with the caller's refusals held back since its
    /// last one, or `None` for a `debug` line.
    pub(crate) fn info(
        &self,
        tool: &str,
        tenant: &str,
        instance: &str,
        window: u64,
        second: u64,
    ) -> Option<u64> {
        let mut lines = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let Lines { callers, tools } = &mut *lines;
        let key = (tool.to_owned(), tenant.to_owned(), instance.to_owned());
        if let Some((w, held)) = callers.get_mut(&key) {
            if *w == window {
                *held += 1;
                return None;
            }
        }
        if callers.len() >= MAX_CALLERS {
            callers.clear();
        }
        if tools.len() >= MAX_CALLERS {
            tools.clear();
        }
        let t = tools.entry(tool.to_owned()).or_insert((second, 0));
        if t.0 != second {
            *t = (second, 0);
        }
        let entry = callers.entry(key).or_insert((u64::MAX, 0));
        if t.1 >= PER_SECOND {
            entry.1 += 1;
            return None;
        }
        t.1 += 1;
        let held = entry.1;
        *entry = (window, 0);
        Some(held)
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
            .filter(|k| lines.info("t", "runaway", "", 7, k / 100).is_some())
            .count();
        assert_eq!(through, 1);
        assert_eq!(lines.info("t", "runaway", "", 8, 60), Some(999));
        let new = (0..1000)
            .filter(|k| lines.info("t", &format!("id-{k}"), "", 8, 61).is_some())
            .count();
        assert_eq!(new, PER_SECOND as usize);
        // Another tool has its own count.
        assert_eq!(lines.info("u", "runaway", "", 8, 61), Some(0));
    }
}
