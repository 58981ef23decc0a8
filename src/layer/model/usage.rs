//! What a model call really used: the [`Usage`] handle a handler reports through, and the
//! reader that finds an OpenAI-compatible response's `usage` as the body passes.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use super::json::reply_tokens;

/// The tokens a model call used, as far as is known: a handle in the request's extensions
/// (put there by [`ModelCallLayer`](crate::ModelCallLayer)) that the handler — or the
/// service behind the layer — sets while it streams. When the response body ends (or is
/// dropped), the call's token charge is settled to what was reported last.
///
/// ```
/// use tower_fairshare::Usage;
///
/// let usage = Usage::default();
/// assert_eq!(usage.reported(), None);
/// usage.add(120.0); // the prompt
/// usage.add(35.0);  // a chunk of the answer
/// assert_eq!(usage.reported(), Some(155.0));
/// usage.report(160.0); // the model's own count at the end: it replaces the running sum
/// assert_eq!(usage.reported(), Some(160.0));
/// ```
#[derive(Clone, Debug)]
pub struct Usage(Arc<AtomicU64>);

/// Nothing reported yet (no `f64` a report stores has these bits: reports are finite).
const NONE: u64 = u64::MAX;

impl Default for Usage {
    /// A handle with nothing reported.
    fn default() -> Self {
        Usage(Arc::new(AtomicU64::new(NONE)))
    }
}

impl Usage {
    /// Reports the call's total so far (it replaces what was reported before). A value that
    /// is not a finite number ≥ 0 is ignored.
    pub fn report(&self, total: f64) {
        if total.is_finite() && total >= 0.0 {
            self.0.store(total.to_bits(), Relaxed);
        }
    }

    /// Adds `more` to what was reported (from nothing: zero). A value that is not a finite
    /// number ≥ 0 is ignored.
    pub fn add(&self, more: f64) {
        if !(more.is_finite() && more >= 0.0) {
            return;
        }
        let _ = self.0.fetch_update(Relaxed, Relaxed, |bits| {
            let now = if bits == NONE {
                0.0
            } else {
                f64::from_bits(bits)
            };
            Some((now + more).to_bits())
        });
    }

    /// What was reported, if anything.
    pub fn reported(&self) -> Option<f64> {
        let bits = self.0.load(Relaxed);
        (bits != NONE).then(|| f64::from_bits(bits))
    }
}

/// The longest line of a server-sent event stream, or JSON body, that is looked into: past
/// it the reader stops (a response that large carries its usage where it cannot be found
/// cheaply; the handle or a trailer can still report it).
const MAX_HELD: usize = 1 << 20;

/// Finds the `usage` of an OpenAI-compatible response as its body passes: in the last
/// server-sent event that carries one (`data: {..., "usage": {...}}`, or the Responses API's
/// `response.usage`), or in a JSON body's `usage`. Reports `total_tokens`, or the sum of the
/// prompt (input) and completion (output) tokens.
#[derive(Debug)]
pub(super) struct UsageReader {
    stream: bool,
    held: Vec<u8>,
    gave_up: bool,
}

impl UsageReader {
    /// A reader for a response of `content_type`: `None` for one that is neither an event
    /// stream nor JSON.
    pub(super) fn of(content_type: Option<&http::HeaderValue>) -> Option<UsageReader> {
        let ct = content_type?.to_str().ok()?.to_ascii_lowercase();
        let stream = ct.starts_with("text/event-stream");
        (stream || ct.starts_with("application/json")).then(|| UsageReader {
            stream,
            held: Vec::new(),
            gave_up: false,
        })
    }

    /// Reads `data`; reports a `usage` found in it to `usage`.
    pub(super) fn read(&mut self, data: &[u8], usage: &Usage) {
        if self.gave_up {
            return;
        }
        self.held.extend_from_slice(data);
        if self.stream {
            // Every whole line read where it lies, then dropped at once.
            let mut start = 0;
            while let Some(len) = self.held[start..].iter().position(|b| *b == b'\n') {
                if let Some(n) = event_usage(&self.held[start..=start + len]) {
                    usage.report(n);
                }
                start += len + 1;
            }
            self.held.drain(..start);
        }
        if self.held.len() > MAX_HELD {
            self.gave_up = true;
            self.held = Vec::new();
        }
    }

    /// The body ended: a JSON body's `usage` (or an event stream's last line without its
    /// newline) is reported.
    pub(super) fn end(&mut self, usage: &Usage) {
        if self.gave_up {
            return;
        }
        let found = match self.stream {
            true => event_usage(&self.held),
            false => reply_tokens(&self.held),
        };
        if let Some(n) = found {
            usage.report(n);
        }
    }
}

/// The usage in one line of an event stream, if it is a `data:` line that carries one.
fn event_usage(line: &[u8]) -> Option<f64> {
    let data = line.strip_prefix(b"data:")?;
    if !contains(data, b"\"usage\"") {
        return None;
    }
    reply_tokens(data.trim_ascii())
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(content_type: &'static str, chunks: &[&str]) -> Option<f64> {
        let usage = Usage::default();
        let ct = http::HeaderValue::from_static(content_type);
        let mut r = UsageReader::of(Some(&ct)).expect("a type it reads");
        for c in chunks {
            r.read(c.as_bytes(), &usage);
        }
        r.end(&usage);
        usage.reported()
    }

    #[test]
    fn the_last_event_with_usage_is_the_calls_usage_whatever_the_chunking() {
        let stream = "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}],\"usage\":null}\n\n\
                      data: {\"choices\":[],\"usage\":{\"prompt_tokens\":12,\"completion_tokens\":30,\"total_tokens\":42}}\n\n\
                      data: [DONE]\n\n";
        for cut in 1..stream.len() {
            let (a, b) = stream.split_at(cut);
            assert_eq!(
                read("text/event-stream", &[a, b]),
                Some(42.0),
                "cut at {cut}"
            );
        }
    }

    #[test]
    fn json_bodies_and_the_responses_api_report_their_usage() {
        let json = "{\"id\":\"x\",\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":7}}";
        assert_eq!(read("application/json; charset=utf-8", &[json]), Some(12.0));
        let done = "event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"usage\":{\"input_tokens\":9,\"output_tokens\":4,\"total_tokens\":13}}}\n\n";
        assert_eq!(read("text/event-stream", &[done]), Some(13.0));
        assert_eq!(
            read("text/event-stream", &["data: {\"choices\":[]}\n\n"]),
            None
        );
        assert!(UsageReader::of(Some(&http::HeaderValue::from_static("text/plain"))).is_none());
    }

    #[test]
    fn a_handle_ignores_what_is_not_a_count() {
        let u = Usage::default();
        u.report(f64::NAN);
        u.add(-1.0);
        assert_eq!(u.reported(), None);
        u.add(2.5);
        u.report(f64::INFINITY);
        assert_eq!(u.reported(), Some(2.5));
    }
}
