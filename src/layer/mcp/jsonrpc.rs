//! The few JSON-RPC fields the MCP mode reads from a request body, and the answers it writes
//! in the protocol's own terms: a tool-execution error a model can read, or a JSON-RPC error.

use std::borrow::Cow;

use bytes::Bytes;
use serde::Deserialize;
use serde_json::value::RawValue;

use crate::Refusal;

/// JSON-RPC's "Parse error": the body is not JSON.
pub(crate) const PARSE_ERROR: i64 = -32700;
/// JSON-RPC's "Invalid Request": JSON, but not a JSON-RPC request this server takes.
pub(crate) const INVALID_REQUEST: i64 = -32600;
/// JSON-RPC's "Invalid params": a `tools/call` without a tool name.
pub(crate) const INVALID_PARAMS: i64 = -32602;
/// The code of a refusal answered as a JSON-RPC error
/// ([`McpRefusals::Error`](crate::McpRefusals::Error)), in the range JSON-RPC leaves to
/// servers.
pub const REFUSED: i64 = -32029;

/// What a request body is, as far as admission cares.
#[derive(Debug)]
pub(crate) enum Message<'a> {
    /// A `tools/call` request: its id (raw JSON), the tool's name and its arguments.
    ToolCall {
        id: &'a RawValue,
        name: Cow<'a, str>,
        /// Its arguments (raw JSON), when there are any.
        arguments: Option<&'a RawValue>,
    },
    /// Any other method, a notification or a response: passes unmetered.
    Other,
    /// Not one this server takes: the JSON-RPC error to answer with (and the id, when there is
    /// one to echo).
    Invalid {
        id: Option<&'a RawValue>,
        code: i64,
        message: &'static str,
    },
}

#[derive(Deserialize)]
struct Envelope<'a> {
    #[serde(borrow, default)]
    jsonrpc: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    id: Option<&'a RawValue>,
    #[serde(borrow, default)]
    method: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    params: Option<Params<'a>>,
}

#[derive(Deserialize)]
struct Params<'a> {
    #[serde(borrow, default)]
    name: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    arguments: Option<&'a RawValue>,
}

/// Reads `body` as one JSON-RPC message. A batch (an array, which the current protocol
/// revision no longer has) is taken only when none of its members is a `tools/call`.
pub(crate) fn read(body: &[u8]) -> Message<'_> {
    let text = match std::str::from_utf8(body) {
        Ok(t) => t.trim_start(),
        Err(_) => return invalid(None, PARSE_ERROR, "the body is not UTF-8 JSON"),
    };
    if text.starts_with('[') {
        return batch(text);
    }
    match serde_json::from_str::<Envelope<'_>>(text) {
        Ok(e) => envelope(e),
        Err(e) if e.is_syntax() || e.is_eof() => {
            invalid(None, PARSE_ERROR, "the body is not valid JSON")
        }
        Err(_) => invalid(
            None,
            INVALID_REQUEST,
            "the body is not a JSON-RPC 2.0 message",
        ),
    }
}

fn envelope(e: Envelope<'_>) -> Message<'_> {
    if e.jsonrpc.as_deref() != Some("2.0") {
        return invalid(
            e.id,
            INVALID_REQUEST,
            "the message is not JSON-RPC 2.0 (\"jsonrpc\": \"2.0\")",
        );
    }
    match (e.method, e.id) {
        (Some(m), Some(id)) if m == "tools/call" => {
            let (name, arguments) = e.params.map_or((None, None), |p| (p.name, p.arguments));
            match name.filter(|n| !n.is_empty()) {
                Some(name) => Message::ToolCall {
                    id,
                    name,
                    arguments,
                },
                None => invalid(
                    Some(id),
                    INVALID_PARAMS,
                    "tools/call needs params.name, the tool to call",
                ),
            }
        }
        (Some(m), None) if m == "tools/call" => invalid(
            None,
            INVALID_REQUEST,
            "tools/call is a request: it needs an id",
        ),
        _ => Message::Other,
    }
}

fn batch(text: &str) -> Message<'_> {
    let Ok(items) = serde_json::from_str::<Vec<Envelope<'_>>>(text) else {
        return match serde_json::from_str::<serde::de::IgnoredAny>(text) {
            Ok(_) => invalid(
                None,
                INVALID_REQUEST,
                "a batch member is not a JSON-RPC message",
            ),
            Err(_) => invalid(None, PARSE_ERROR, "the body is not valid JSON"),
        };
    };
    if items
        .iter()
        .any(|e| e.method.as_deref() == Some("tools/call"))
    {
        return invalid(
            None,
            INVALID_REQUEST,
            "tools/call is not taken in a batch: send each call as a message of its own",
        );
    }
    Message::Other
}

fn invalid<'a>(id: Option<&'a RawValue>, code: i64, message: &'static str) -> Message<'a> {
    Message::Invalid { id, code, message }
}

/// A JSON-RPC error response: `id` echoed (`null` when there is none), `data` when given.
pub(crate) fn error(id: Option<&RawValue>, code: i64, message: &str, data: Option<&str>) -> Bytes {
    let mut o = String::with_capacity(128 + data.map_or(0, str::len));
    o.push_str("{\"jsonrpc\":\"2.0\",\"id\":");
    o.push_str(id.map_or("null", RawValue::get));
    o.push_str(",\"error\":{\"code\":");
    o.push_str(itoa::Buffer::new().format(code));
    o.push_str(",\"message\":");
    o.push_str(&serde_json::to_string(message).expect("a string serializes"));
    if let Some(d) = data {
        o.push_str(",\"data\":");
        o.push_str(d);
    }
    o.push_str("}}");
    Bytes::from(o)
}

/// The answer to a refused `tools/call` that the model sees: a tool result with `isError`,
/// a text saying what was limited and when to retry, and the refusal as `structuredContent`.
pub(crate) fn tool_error(id: &RawValue, refusal: &Refusal) -> Bytes {
    let json = refusal.to_json();
    let text = serde_json::to_string(&advice(refusal)).expect("a string serializes");
    let mut o = String::with_capacity(128 + text.len() + json.len());
    o.push_str("{\"jsonrpc\":\"2.0\",\"id\":");
    o.push_str(id.get());
    o.push_str(",\"result\":{\"content\":[{\"type\":\"text\",\"text\":");
    o.push_str(&text);
    o.push_str("}],\"structuredContent\":");
    o.push_str(&json);
    o.push_str(",\"isError\":true}}");
    Bytes::from(o)
}

/// A refused `tools/call` as a JSON-RPC error: [`REFUSED`], the advice as the message and the
/// refusal as `data`.
pub(crate) fn refusal_error(id: &RawValue, refusal: &Refusal) -> Bytes {
    error(
        Some(id),
        REFUSED,
        &advice(refusal),
        Some(&refusal.to_json()),
    )
}

/// What a model can act on: the tool was not run, what was limited for whom, and when it may
/// try again (or that it cannot).
pub(crate) fn advice(r: &Refusal) -> String {
    let who = match (r.tenant(), r.instance()) {
        (Some(t), Some(i)) => format!(" for tenant {t}, instance {i}"),
        (Some(t), None) => format!(" for tenant {t}"),
        _ => String::new(),
    };
    let what = match r.reason {
        crate::Reason::RateLimited => "its rate limit is reached",
        crate::Reason::CapExceeded => "its budget is spent",
        crate::Reason::ConcurrencyExceeded => "too many calls are in flight",
        crate::Reason::PermissionDenied => "this caller may not call it",
        crate::Reason::UnidentifiedCaller => "the caller is not identified",
        crate::Reason::StoreUnavailable => "the rate limiter cannot decide now",
    };
    let when = match r.retry_after {
        Some(d) if r.retryable => {
            let ms = d.as_millis().max(1);
            if ms < 10_000 {
                format!("retry in {:.1} s", ms as f64 / 1000.0)
            } else {
                format!("retry in {} s", ms.div_ceil(1000))
            }
        }
        _ => "retrying will not help".to_owned(),
    };
    format!("The tool {} was not run: {what}{who}; {when}.", r.tool())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(m: &Message<'_>) -> Option<String> {
        match m {
            Message::ToolCall { name, .. } => Some(name.to_string()),
            _ => None,
        }
    }

    #[test]
    fn a_tool_call_gives_its_id_and_name() {
        let body = br#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"generate_report","arguments":{"q":[1,{"x":"y"}]}}}"#;
        let m = read(body);
        assert_eq!(name(&m).as_deref(), Some("generate_report"));
        let Message::ToolCall { id, arguments, .. } = m else {
            unreachable!()
        };
        assert_eq!(id.get(), "7");
        assert_eq!(arguments.map(RawValue::get), Some(r#"{"q":[1,{"x":"y"}]}"#));
        // Escapes in the name are read as JSON reads them; a string id is kept as written.
        let body = br#" {"method":"tools/call","id":"a\"b","jsonrpc":"2.0","params":{"name":"gen\u0065rate"}}"#;
        let m = read(body);
        assert_eq!(name(&m).as_deref(), Some("generate"));
        let Message::ToolCall { id, .. } = m else {
            unreachable!()
        };
        assert_eq!(id.get(), r#""a\"b""#);
    }

    #[test]
    fn other_methods_and_notifications_pass() {
        for body in [
            r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18"}}"#,
            r#"{"jsonrpc":"2.0","id":2,"method":"tools/list"}"#,
            r#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#,
            r#"{"jsonrpc":"2.0","id":3,"result":{}}"#,
            r#"[{"jsonrpc":"2.0","id":2,"method":"tools/list"},{"jsonrpc":"2.0","method":"notifications/initialized"}]"#,
        ] {
            assert!(matches!(read(body.as_bytes()), Message::Other), "{body}");
        }
    }

    #[test]
    fn what_is_not_a_tool_call_this_server_takes_gets_the_error_a_client_expects() {
        let cases: [(&[u8], i64); 8] = [
            (b"{not json", PARSE_ERROR),
            (b"", PARSE_ERROR),
            (b"\xff\xfe", PARSE_ERROR),
            (b"42", INVALID_REQUEST),
            (
                br#"{"id":1,"method":"tools/call","params":{"name":"t"}}"#,
                INVALID_REQUEST,
            ),
            (
                br#"{"jsonrpc":"2.0","method":"tools/call","params":{"name":"t"}}"#,
                INVALID_REQUEST,
            ),
            (
                br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{}}"#,
                INVALID_PARAMS,
            ),
            (
                br#"[{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"t"}}]"#,
                INVALID_REQUEST,
            ),
        ];
        for (body, want) in cases {
            match read(body) {
                Message::Invalid { code, .. } => {
                    assert_eq!(code, want, "{}", String::from_utf8_lossy(body))
                }
                m => panic!("{}: {m:?}", String::from_utf8_lossy(body)),
            }
        }
    }

    #[test]
    fn answers_are_json_rpc_with_the_id_echoed() {
        let id = RawValue::from_string("\"req-1\"".to_owned()).unwrap();
        let e: serde_json::Value =
            serde_json::from_slice(&error(Some(&id), INVALID_PARAMS, "no \"name\"", None)).unwrap();
        assert_eq!(e["id"], "req-1");
        assert_eq!(e["error"]["code"], INVALID_PARAMS);
        assert_eq!(e["error"]["message"], "no \"name\"");
        let e: serde_json::Value =
            serde_json::from_slice(&error(None, PARSE_ERROR, "x", None)).unwrap();
        assert!(e["id"].is_null());
    }
}
