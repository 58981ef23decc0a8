//! Refusals as HTTP and gRPC responses (SPEC §4).

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderMap, Response, StatusCode};

use super::body::ResponseBody;
use crate::admission::{Reason, Refusal, Scope};
use crate::limiter::Ticket;

/// `RateLimit-Policy` (draft-ietf-httpapi-ratelimit-headers-10).
pub const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
/// `RateLimit` (draft-ietf-httpapi-ratelimit-headers-10).
pub const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
const GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
const GRPC_MESSAGE: HeaderName = HeaderName::from_static("grpc-message");
const APPLICATION_JSON: HeaderValue = HeaderValue::from_static("application/json");
const APPLICATION_GRPC: HeaderValue = HeaderValue::from_static("application/grpc");

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

fn number(n: f64) -> String {
    if n.fract() == 0.0 && n.abs() < 9.0e15 {
        itoa::Buffer::new().format(n as i64).to_owned()
    } else {
        format!("{n:.0}")
    }
}

fn value(s: String) -> HeaderValue {
    HeaderValue::from_str(&s).unwrap_or_else(|_| HeaderValue::from_static("invalid"))
}

/// `RateLimit-Policy` and `RateLimit` for a refusal of a rate or a budget.
fn refusal_rate_headers(r: &Refusal, headers: &mut HeaderMap) {
    if !matches!(r.reason, Reason::RateLimited | Reason::CapExceeded) {
        return;
    }
    let (Some(limit), Some(w)) = (r.limit, r.window_secs) else {
        return;
    };
    let scope = r.scope.unwrap_or(Scope::Tool).as_str();
    headers.insert(
        RATELIMIT_POLICY,
        value(format!("\"{scope}\";q={};w={w}", number(limit.floor()))),
    );
    headers.insert(
        RATELIMIT,
        value(format!("\"{scope}\";r=0;t={}", r.retry_after_secs())),
    );
}

/// The refusal as a response: JSON and headers for HTTP, a trailers-only response for gRPC.
pub(crate) fn response<B>(r: &Refusal, grpc: bool) -> Response<ResponseBody<B>> {
    let json = r.to_json();
    let retryable = r.retryable || matches!(r.reason, Reason::StoreUnavailable);
    if grpc {
        let mut res = Response::new(ResponseBody::empty());
        let h = res.headers_mut();
        h.insert(CONTENT_TYPE, APPLICATION_GRPC);
        h.insert(GRPC_STATUS, HeaderValue::from(grpc_code(r.reason) as u16));
        h.insert(GRPC_MESSAGE, value(percent_encode(&json)));
        if retryable {
            h.insert(RETRY_AFTER, HeaderValue::from(r.retry_after_secs()));
        }
        return res;
    }
    let mut res = Response::new(ResponseBody::full(Bytes::from(json)));
    *res.status_mut() = http_status(r.reason);
    let h = res.headers_mut();
    h.insert(CONTENT_TYPE, APPLICATION_JSON);
    if retryable {
        h.insert(RETRY_AFTER, HeaderValue::from(r.retry_after_secs()));
    }
    refusal_rate_headers(r, h);
    res
}

/// `RateLimit-Policy` and `RateLimit` on an admitted response.
pub(crate) fn admitted_headers(t: &Ticket, headers: &mut HeaderMap) {
    let Some(a) = &t.admission else { return };
    let scope = t.scope().as_str();
    headers.insert(
        RATELIMIT_POLICY,
        value(format!(
            "\"{scope}\";q={};w={}",
            number(a.quota.floor()),
            t.window_secs
        )),
    );
    let reset = (a.reset_in / 1e6).ceil().max(0.0) as u64;
    headers.insert(
        RATELIMIT,
        value(format!(
            "\"{scope}\";r={};t={reset}",
            number(a.remaining.max(0.0).floor())
        )),
    );
}

/// gRPC's percent-encoding of `grpc-message`: bytes outside printable ASCII, and `%`.
fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if (0x20..=0x7e).contains(&b) && b != b'%' {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

pub(crate) fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/grpc"))
}
