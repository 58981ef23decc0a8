//! Refusals as HTTP and gRPC responses.

use std::fmt::{self, Write};

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue, CONTENT_TYPE, RETRY_AFTER, WWW_AUTHENTICATE};
use http::{HeaderMap, Response, StatusCode};

use crate::admission::{Reason, Refusal, Scope};
use crate::limiter::Ticket;
use crate::policy::Unit;

/// `RateLimit-Policy` (draft-ietf-httpapi-ratelimit-headers-10).
pub const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
/// `RateLimit` (draft-ietf-httpapi-ratelimit-headers-10).
pub const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
const GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
const GRPC_MESSAGE: HeaderName = HeaderName::from_static("grpc-message");
/// The retry hint gRPC clients' retry policies read (milliseconds).
const GRPC_RETRY_PUSHBACK_MS: HeaderName = HeaderName::from_static("grpc-retry-pushback-ms");
/// A `google.rpc.Status` with its details, base64 (gRPC's rich error model).
const GRPC_STATUS_DETAILS: HeaderName = HeaderName::from_static("grpc-status-details-bin");
const APPLICATION_JSON: HeaderValue = HeaderValue::from_static("application/json");
const APPLICATION_GRPC: HeaderValue = HeaderValue::from_static("application/grpc");
/// The challenge a 401 carries unless the layer is given another
/// ([`FairShareLayer::challenge`](crate::FairShareLayer::challenge)): HTTP requires one.
pub(crate) const DEFAULT_CHALLENGE: HeaderValue = HeaderValue::from_static("Bearer");

/// The HTTP status of a refusal: 429, 403, 401 or 503.
pub fn http_status(reason: Reason) -> StatusCode {
    match reason {
        Reason::RateLimited | Reason::CapExceeded | Reason::ConcurrencyExceeded => {
            StatusCode::TOO_MANY_REQUESTS
        }
        Reason::PermissionDenied => StatusCode::FORBIDDEN,
        Reason::UnidentifiedCaller => StatusCode::UNAUTHORIZED,
        Reason::StoreUnavailable => StatusCode::SERVICE_UNAVAILABLE,
    }
}

/// The gRPC status code of a refusal: RESOURCE_EXHAUSTED (8), PERMISSION_DENIED (7),
/// UNAUTHENTICATED (16) or UNAVAILABLE (14).
pub fn grpc_code(reason: Reason) -> u8 {
    match reason {
        Reason::RateLimited | Reason::CapExceeded | Reason::ConcurrencyExceeded => 8,
        Reason::PermissionDenied => 7,
        Reason::UnidentifiedCaller => 16,
        Reason::StoreUnavailable => 14,
    }
}

/// Numbers 0..=999 as text, back to back: `Retry-After` and `grpc-status` values taken from
/// here are static header values, with no allocation.
static SMALL_NUMBERS: [u8; 2890] = small_numbers();

const fn small_numbers() -> [u8; 2890] {
    let mut out = [0u8; 2890];
    let (mut n, mut i) = (0, 0);
    while n < 1000 {
        if n >= 100 {
            out[i] = b'0' + (n / 100) as u8;
            i += 1;
        }
        if n >= 10 {
            out[i] = b'0' + (n / 10 % 10) as u8;
            i += 1;
        }
        out[i] = b'0' + (n % 10) as u8;
        i += 1;
        n += 1;
    }
    out
}

/// `n` as a header value; static (no allocation) below 1000.
fn integer(n: u64) -> HeaderValue {
    let (start, len) = match n {
        0..=9 => (n, 1),
        10..=99 => (10 + (n - 10) * 2, 2),
        100..=999 => (190 + (n - 100) * 3, 3),
        _ => return HeaderValue::from(n),
    };
    match std::str::from_utf8(&SMALL_NUMBERS[start as usize..(start + len) as usize]) {
        Ok(s) => HeaderValue::from_static(s),
        Err(_) => HeaderValue::from(n),
    }
}

/// A whole number as itself, anything else rounded (`{:.0}`).
fn number(o: &mut impl Write, n: f64) -> fmt::Result {
    if n.fract() == 0.0 && n.abs() < 9.0e15 {
        o.write_str(itoa::Buffer::new().format(n as i64))
    } else {
        write!(o, "{n:.0}")
    }
}

/// A header value rendered on the stack and copied once.
fn value(render: impl FnOnce(&mut StackBuf<64>) -> fmt::Result) -> HeaderValue {
    let mut buf = StackBuf::new();
    match render(&mut buf) {
        Ok(()) => HeaderValue::from_bytes(buf.as_bytes()),
        Err(_) => HeaderValue::from_str("invalid"),
    }
    .unwrap_or_else(|_| HeaderValue::from_static("invalid"))
}

/// `"{scope}";q={quota};w={window}`, and `;qu="tokens"` (or `"seconds"`) for a tool whose
/// unit is not a call (the quota unit; a call, the default, is the draft's `"requests"`). The
/// header's quota is a whole number of units: a fractional one is stated over as many windows
/// as make it whole (0.25 a second is `q=1;w=4`, 2.5 a minute `q=5;w=120`, up to 60 windows),
/// else rounded down (and at least 1 unit over the time it takes to accrue, when below one).
fn policy_value(scope: Scope, quota: f64, window_secs: u64, unit: Option<Unit>) -> HeaderValue {
    let (q, w) = whole_quota(quota, window_secs);
    value(|o| {
        o.write_str(match scope {
            Scope::Tool => "\"tool\";q=",
            Scope::Tenant => "\"tenant\";q=",
            Scope::Instance => "\"instance\";q=",
        })?;
        number(o, q)?;
        o.write_str(";w=")?;
        o.write_str(itoa::Buffer::new().format(w))?;
        match unit {
            Some(Unit::Tokens) => o.write_str(";qu=\"tokens\""),
            Some(Unit::Seconds) => o.write_str(";qu=\"seconds\""),
            _ => Ok(()),
        }
    })
}

/// A quota per window as a whole number of units per (possibly longer) window.
fn whole_quota(quota: f64, window_secs: u64) -> (f64, u64) {
    if !(quota.is_finite() && quota > 0.0) || quota.fract() == 0.0 {
        return (quota.max(0.0).floor(), window_secs);
    }
    for k in 2..=60u64 {
        let q = quota * k as f64;
        if (q - q.round()).abs() <= 1e-9 * q.max(1.0) {
            return (q.round(), window_secs.saturating_mul(k));
        }
    }
    if quota >= 1.0 {
        (quota.floor(), window_secs)
    } else {
        (1.0, (window_secs as f64 / quota).ceil() as u64)
    }
}

/// `"{scope}";r={remaining};t={reset}`
fn remaining_value(scope: Scope, remaining: f64, reset_secs: u64) -> HeaderValue {
    value(|o| {
        o.write_str(match scope {
            Scope::Tool => "\"tool\";r=",
            Scope::Tenant => "\"tenant\";r=",
            Scope::Instance => "\"instance\";r=",
        })?;
        number(o, remaining)?;
        o.write_str(";t=")?;
        o.write_str(itoa::Buffer::new().format(reset_secs))
    })
}

/// `RateLimit-Policy` and `RateLimit` for a refusal of a rate or a budget.
fn refusal_rate_headers(r: &Refusal, headers: &mut HeaderMap) {
    if !matches!(r.reason, Reason::RateLimited | Reason::CapExceeded) {
        return;
    }
    let (Some(limit), Some(w)) = (r.limit, r.window_secs) else {
        return;
    };
    let scope = r.scope.unwrap_or(Scope::Tool);
    headers.insert(RATELIMIT_POLICY, policy_value(scope, limit, w, r.unit));
    headers.insert(RATELIMIT, remaining_value(scope, 0.0, r.retry_after_secs()));
}

/// The refusal as a response: JSON and headers for HTTP, a trailers-only response for gRPC.
#[cfg(feature = "axum")]
pub(crate) fn response<B>(r: &Refusal, grpc: bool) -> Response<super::body::ResponseBody<B>> {
    render(r, grpc).map(super::body::ResponseBody::refusal)
}

/// The response [`FairShareLayer`](crate::FairShareLayer) sends for a refusal: for HTTP the
/// status of [`http_status`], the JSON of [`Refusal::to_json`], `Retry-After`, the RateLimit
/// headers, `WWW-Authenticate: Bearer` on a 401; for gRPC (`grpc`) a trailers-only response
/// (empty body) with the status, the JSON as `grpc-message` and the retry hints. A
/// [`refusal_response`](crate::FairShareLayer::refusal_response) handler can start from it.
pub fn default_refusal_response(r: &Refusal, grpc: bool) -> Response<Bytes> {
    render(r, grpc).map(Option::unwrap_or_default)
}

/// The refusal's status, headers and body (`None`: empty, for gRPC).
pub(crate) fn render(r: &Refusal, grpc: bool) -> Response<Option<Bytes>> {
    let retryable = r.retryable || matches!(r.reason, Reason::StoreUnavailable);
    if grpc {
        // The JSON once, for `grpc-message` and the status details alike.
        let mut stack = StackBuf::<512>::new();
        let long;
        let json = if r.write_json(&mut stack).is_ok() {
            stack.as_bytes()
        } else {
            long = r.to_json();
            long.as_bytes()
        };
        let mut res = Response::new(None);
        let h = res.headers_mut();
        h.insert(CONTENT_TYPE, APPLICATION_GRPC);
        h.insert(GRPC_STATUS, integer(grpc_code(r.reason).into()));
        h.insert(GRPC_MESSAGE, grpc_message(json));
        if retryable {
            let delay = retry_delay(r);
            h.insert(RETRY_AFTER, integer(r.retry_after_secs()));
            h.insert(
                GRPC_RETRY_PUSHBACK_MS,
                HeaderValue::from(delay.as_millis() as u64),
            );
            let details = status_details(grpc_code(r.reason), json, delay);
            if let Ok(v) = HeaderValue::from_maybe_shared(Bytes::from(base64(&details))) {
                h.insert(GRPC_STATUS_DETAILS, v);
            }
        }
        return res;
    }
    render_http(r, retryable)
}

/// An HTTP refusal rendered afresh.
fn render_http(r: &Refusal, retryable: bool) -> Response<Option<Bytes>> {
    let mut res = Response::new(Some(json_bytes(r)));
    *res.status_mut() = http_status(r.reason);
    let h = res.headers_mut();
    h.insert(CONTENT_TYPE, APPLICATION_JSON);
    if r.reason == Reason::UnidentifiedCaller {
        h.insert(WWW_AUTHENTICATE, DEFAULT_CHALLENGE);
    }
    if retryable {
        h.insert(RETRY_AFTER, integer(r.retry_after_secs()));
    }
    refusal_rate_headers(r, h);
    res
}

/// The JSON body, rendered on the stack and copied once into an exactly sized buffer.
fn json_bytes(r: &Refusal) -> Bytes {
    let mut buf = StackBuf::<512>::new();
    match r.write_json(&mut buf) {
        Ok(()) => Bytes::copy_from_slice(buf.as_bytes()),
        Err(_) => Bytes::from(r.to_json()),
    }
}

/// A fixed-size text buffer on the stack; writing past its end fails instead of allocating.
pub(crate) struct StackBuf<const N: usize> {
    buf: [u8; N],
    len: usize,
}

impl<const N: usize> StackBuf<N> {
    pub(crate) fn new() -> Self {
        StackBuf {
            buf: [0; N],
            len: 0,
        }
    }

    pub(crate) fn as_bytes(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

impl<const N: usize> fmt::Write for StackBuf<N> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let end = self.len + s.len();
        let dst = self.buf.get_mut(self.len..end).ok_or(fmt::Error)?;
        dst.copy_from_slice(s.as_bytes());
        self.len = end;
        Ok(())
    }
}

/// `RateLimit-Policy` and `RateLimit` on an admitted response.
pub(crate) fn admitted_headers(t: &Ticket, headers: &mut HeaderMap) {
    let (Some(quota), Some(remaining), Some(reset_in)) = (t.quota(), t.remaining(), t.reset_in())
    else {
        return;
    };
    let scope = t.scope();
    let reset = reset_in.as_micros().div_ceil(1_000_000) as u64;
    headers.insert(
        RATELIMIT_POLICY,
        policy_value(scope, quota, t.window_secs(), Some(t.unit())),
    );
    headers.insert(
        RATELIMIT,
        remaining_value(scope, remaining.max(0.0).floor(), reset),
    );
}

/// How long a retryable refusal asks the caller to wait.
pub(crate) fn retry_delay(r: &Refusal) -> std::time::Duration {
    r.retry_after
        .unwrap_or_else(|| std::time::Duration::from_secs(r.retry_after_secs()))
}

/// `google.rpc.Status { code, message, details: [Any(google.rpc.RetryInfo { retry_delay })] }`,
/// protobuf-encoded: what gRPC clients read from `grpc-status-details-bin` (tonic's
/// `Status::details`, `tonic-types`' `ErrorDetails::retry_info`).
pub(crate) fn status_details(code: u8, message: &[u8], delay: std::time::Duration) -> Vec<u8> {
    fn varint(out: &mut Vec<u8>, mut v: u64) {
        while v >= 0x80 {
            out.push((v as u8) | 0x80);
            v >>= 7;
        }
        out.push(v as u8);
    }
    fn number(out: &mut Vec<u8>, field: u64, v: u64) {
        if v != 0 {
            varint(out, field << 3);
            varint(out, v);
        }
    }
    fn bytes(out: &mut Vec<u8>, field: u64, b: &[u8]) {
        varint(out, field << 3 | 2);
        varint(out, b.len() as u64);
        out.extend_from_slice(b);
    }
    let mut duration = Vec::new();
    number(&mut duration, 1, delay.as_secs());
    number(&mut duration, 2, u64::from(delay.subsec_nanos()));
    let mut retry_info = Vec::new();
    bytes(&mut retry_info, 1, &duration);
    let mut any = Vec::new();
    bytes(&mut any, 1, b"type.googleapis.com/google.rpc.RetryInfo");
    bytes(&mut any, 2, &retry_info);
    let mut status = Vec::with_capacity(message.len() + any.len() + 16);
    number(&mut status, 1, u64::from(code));
    bytes(&mut status, 2, message);
    bytes(&mut status, 3, &any);
    status
}

/// Standard base64 without padding, as gRPC sends binary headers.
fn base64(b: &[u8]) -> Vec<u8> {
    const ABC: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = Vec::with_capacity(b.len().div_ceil(3) * 4);
    for chunk in b.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, &x)| n | u32::from(x) << (16 - 8 * i));
        for i in 0..=chunk.len() {
            out.push(ABC[(n >> (18 - 6 * i) & 63) as usize]);
        }
    }
    out
}

/// A refusal's JSON in gRPC's percent-encoding (`grpc-message`).
fn grpc_message(json: &[u8]) -> HeaderValue {
    let mut out = StackBuf::<1024>::new();
    let encoded = match percent_encode(&mut out, json) {
        Ok(()) => out.as_bytes().to_owned(),
        Err(_) => {
            let mut out = String::new();
            // Writing to a `String` cannot fail.
            let _ = percent_encode(&mut out, json);
            out.into_bytes()
        }
    };
    HeaderValue::from_maybe_shared(Bytes::from(encoded))
        .unwrap_or_else(|_| HeaderValue::from_static("invalid"))
}

/// gRPC's percent-encoding of `grpc-message`: bytes outside printable ASCII, and `%`.
fn percent_encode(o: &mut impl Write, s: &[u8]) -> fmt::Result {
    for &b in s {
        if (0x20..=0x7e).contains(&b) && b != b'%' {
            o.write_char(char::from(b))?;
        } else {
            write!(o, "%{b:02X}")?;
        }
    }
    Ok(())
}

pub(crate) fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/grpc"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn static_integers_match_http() {
        for n in (0..1100).chain([9_999, u64::MAX]) {
            assert_eq!(integer(n), HeaderValue::from(n), "{n}");
        }
    }

    #[test]
    fn bodies_too_long_for_the_stack_are_rendered_whole() {
        for len in [1, 400, 600, 5000] {
            let mut r = Refusal::new(Reason::RateLimited, "t\u{1}".repeat(len));
            r.set_caller(Some("x".repeat(len).into()), None);
            r.limit = Some(10.5);
            r.window_secs = Some(60);
            let json = json_bytes(&r);
            assert_eq!(json, r.to_json().as_bytes());
            let message = grpc_message(r.to_json().as_bytes());
            let mut expected = String::new();
            percent_encode(&mut expected, r.to_json().as_bytes()).unwrap();
            assert_eq!(message, expected.as_str());
            // And through the whole gRPC response, whose JSON may not fit on the stack.
            assert_eq!(render(&r, true).headers()[GRPC_MESSAGE], expected.as_str());
        }
    }

    proptest::proptest! {
        /// A `RateLimit-Policy` value shared with the last response on the thread says what a
        /// fresh one would, whatever came before it: the same quota in a row (shared), and any
        /// change of scope, quota (whole, fractional, close to another) or window between.
        #[test]
        fn a_shared_policy_value_is_the_fresh_one(
            calls in proptest::collection::vec(
                (0..3usize, proptest::sample::select(vec![0.0, 1.0, 2.5, 60.0, 1e12, 0.25, 59.9]),
                 proptest::sample::select(vec![1u64, 60, 3600])),
                1..40,
            ),
        ) {
            for (scope, quota, window) in calls {
                let scope = [Scope::Tool, Scope::Tenant, Scope::Instance][scope];
                proptest::prop_assert_eq!(
                    policy_value(scope, quota, window, None),
                    policy_value(scope, quota, window, None),
                    "{:?} {} {}", scope, quota, window
                );
            }
        }

        /// A refusal rendered on a thread that rendered others before (the last one shared
        /// when it shows the same) is the response rendered afresh: every field a response
        /// shows tells refusals apart. Fields are drawn from few values, so that refusals
        /// repeat, and differ in one field only, often.
        #[test]
        fn a_refusal_renders_alike_whatever_was_rendered_before(
            calls in proptest::collection::vec(
                (0usize..3, 0usize..2, 0usize..3, 0usize..3, 0u64..3, 0u64..2, 0usize..2, 0usize..3),
                1..40,
            ),
        ) {
            let names: [std::sync::Arc<str>; 2] = ["acme".into(), "globex".into()];
            for (reason, tenant, scope, limit, wait, reset, retryable, instance) in calls {
                let reason = [Reason::RateLimited, Reason::CapExceeded, Reason::PermissionDenied][reason];
                let mut r = Refusal::new(reason, "search");
                r.set_caller(Some(names[tenant].clone()), None);
                if instance > 0 {
                    r.set_instance(Some(names[instance - 1].clone()));
                }
                r.scope = [None, Some(Scope::Tenant), Some(Scope::Instance)][scope];
                r.limit = [None, Some(10.0), Some(10.5)][limit];
                r.used = r.limit;
                r.window_secs = Some(60);
                // Waits a microsecond apart render alike, a millisecond apart do not.
                r.retry_after = Some(std::time::Duration::from_micros(999_000 + [1, 2, 1_500][wait as usize]));
                r.reset_at = Some(crate::clock::Timestamp(1_779_462_000_000_000 + reset));
                r.retryable = retryable == 1;
                let fresh = render_http(&r, r.retryable);
                let rendered = render(&r, false);
                proptest::prop_assert_eq!(rendered.status(), fresh.status());
                proptest::prop_assert_eq!(rendered.headers(), fresh.headers());
                proptest::prop_assert_eq!(rendered.body(), fresh.body());
            }
        }
    }

    #[test]
    fn header_values_are_whole_numbers() {
        assert_eq!(
            policy_value(Scope::Tenant, 136.0, 60, None),
            "\"tenant\";q=136;w=60"
        );
        // Fractional quotas: whole units over as many windows as it takes (was `q=0`).
        assert_eq!(policy_value(Scope::Tool, 0.25, 1, None), "\"tool\";q=1;w=4");
        assert_eq!(
            policy_value(Scope::Tenant, 4000.0, 60, Some(Unit::Tokens)),
            "\"tenant\";q=4000;w=60;qu=\"tokens\""
        );
        assert_eq!(
            policy_value(Scope::Tenant, 60.0, 60, Some(Unit::Calls)),
            "\"tenant\";q=60;w=60"
        );
        assert_eq!(
            policy_value(Scope::Tool, 2.5, 60, None),
            "\"tool\";q=5;w=120"
        );
        assert_eq!(
            policy_value(Scope::Tool, 0.001, 60, None),
            "\"tool\";q=1;w=60000"
        );
        assert_eq!(
            policy_value(Scope::Tool, 100.007, 60, None),
            "\"tool\";q=100;w=60"
        );
        assert_eq!(
            policy_value(Scope::Tool, 1.5e16, 1, None),
            "\"tool\";q=15000000000000000;w=1"
        );
        assert_eq!(
            remaining_value(Scope::Instance, 0.0, 12),
            "\"instance\";r=0;t=12"
        );
    }
}
