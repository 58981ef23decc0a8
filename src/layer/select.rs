//! How the layer learns who is calling which tool at what cost, from a request.

use std::sync::Arc;

use http::{Extensions, HeaderMap, Method, Uri};

use crate::identity::Caller;

/// A borrowed view of an HTTP request without its body: what identification and tool
/// selection may look at.
#[derive(Copy, Clone, Debug)]
pub struct RequestHead<'a> {
    /// The method.
    pub method: &'a Method,
    /// The URI.
    pub uri: &'a Uri,
    /// The headers.
    pub headers: &'a HeaderMap,
    /// The extensions (where the app's auth layer puts the [`Caller`]).
    pub extensions: &'a Extensions,
}

impl<'a> RequestHead<'a> {
    pub(crate) fn of<B>(req: &'a http::Request<B>) -> Self {
        RequestHead {
            method: req.method(),
            uri: req.uri(),
            headers: req.headers(),
            extensions: req.extensions(),
        }
    }
}

/// The tool a request calls, put in the request extensions by the app (for
/// [`FairShareLayer::tool_from_extension`](crate::FairShareLayer::tool_from_extension)).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ToolName(pub Arc<str>);

/// Finds the caller of a request. Implemented for closures; the layer's default reads the
/// [`Caller`] extension put there by the app's auth layer.
pub trait Identify: Send + Sync + 'static {
    /// The caller, or `None` when the request carries no identity.
    fn identify(&self, req: &RequestHead<'_>) -> Option<Caller>;

    /// The caller (`None`: no identity, the layer's 401), or a response of the app's own to
    /// send instead (an expired token, a revoked key): then nothing is decided or charged and
    /// the inner service is not called. The default is [`identify`](Self::identify).
    fn identify_or_reject(
        &self,
        req: &RequestHead<'_>,
    ) -> Result<Option<Caller>, Box<http::Response<bytes::Bytes>>> {
        Ok(self.identify(req))
    }
}

/// An [`Identify`] from a closure that may reject the request with a response of its own.
pub(crate) struct Rejecting<F>(pub(crate) F);

impl<F> Identify for Rejecting<F>
where
    F: Fn(&RequestHead<'_>) -> Result<Caller, Box<http::Response<bytes::Bytes>>>
        + Send
        + Sync
        + 'static,
{
    fn identify(&self, req: &RequestHead<'_>) -> Option<Caller> {
        (self.0)(req).ok()
    }

    fn identify_or_reject(
        &self,
        req: &RequestHead<'_>,
    ) -> Result<Option<Caller>, Box<http::Response<bytes::Bytes>>> {
        (self.0)(req).map(Some)
    }
}

impl<F> Identify for F
where
    F: Fn(&RequestHead<'_>) -> Option<Caller> + Send + Sync + 'static,
{
    fn identify(&self, req: &RequestHead<'_>) -> Option<Caller> {
        self(req)
    }
}

/// The default [`Identify`]: the [`Caller`] in the request extensions.
#[derive(Copy, Clone, Debug, Default)]
pub struct CallerFromExtensions;

impl Identify for CallerFromExtensions {
    fn identify(&self, req: &RequestHead<'_>) -> Option<Caller> {
        req.extensions.get::<Caller>().cloned()
    }
}

/// How the layer finds the caller.
#[derive(Clone)]
pub(crate) enum Identity {
    /// The [`Caller`] extension, borrowed: no clone on the way to the limiter.
    Extension,
    /// An [`Identify`] of the app's.
    With(Arc<dyn Identify>),
}

/// A function from a request to the tool it calls.
pub(crate) type SelectFn = dyn Fn(&RequestHead<'_>) -> Option<Arc<str>> + Send + Sync;

/// Which tool a request calls.
#[derive(Clone)]
pub(crate) enum ToolSelector {
    /// Every request calls this tool.
    Fixed(Arc<str>),
    /// `<prefix><name>[/...]`: the path segment after the prefix.
    Path(Arc<str>),
    /// The [`ToolName`] extension.
    Extension,
    /// A function of the request.
    With(Arc<SelectFn>),
}

impl std::fmt::Debug for ToolSelector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ToolSelector::Fixed(t) => write!(f, "Fixed({t:?})"),
            ToolSelector::Path(p) => write!(f, "Path({p:?})"),
            ToolSelector::Extension => f.write_str("Extension"),
            ToolSelector::With(_) => f.write_str("With(..)"),
        }
    }
}

/// The tool a request calls, borrowed from the request or the layer when it can be: a
/// decision the store makes at once needs no owned copy.
pub(crate) enum Tool<'a> {
    Borrowed(&'a str),
    Shared(&'a Arc<str>),
    Owned(Arc<str>),
}

impl Tool<'_> {
    pub(crate) fn as_str(&self) -> &str {
        match self {
            Tool::Borrowed(s) => s,
            Tool::Shared(s) => s,
            Tool::Owned(s) => s,
        }
    }
}

impl ToolSelector {
    pub(crate) fn select<'a>(&'a self, req: &RequestHead<'a>) -> Option<Tool<'a>> {
        match self {
            ToolSelector::Fixed(t) => Some(Tool::Shared(t)),
            ToolSelector::Path(prefix) => {
                let rest = req.uri.path().strip_prefix(&**prefix)?;
                // Tool names are short: a plain scan beats a searcher's setup.
                let end = rest.bytes().position(|b| b == b'/').unwrap_or(rest.len());
                let name = &rest[..end];
                (!name.is_empty()).then_some(Tool::Borrowed(name))
            }
            ToolSelector::Extension => req.extensions.get::<ToolName>().map(|t| Tool::Shared(&t.0)),
            ToolSelector::With(f) => f(req).map(Tool::Owned),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn selected(selector: &ToolSelector, req: &http::Request<()>) -> Option<String> {
        let tool = selector.select(&RequestHead::of(req))?;
        Some(tool.as_str().to_owned())
    }

    #[test]
    fn every_selector_finds_the_tool() {
        let path = ToolSelector::Path(Arc::from("/tools/"));
        let get = |uri: &str| http::Request::get(uri).body(()).unwrap();
        assert_eq!(
            selected(&path, &get("/tools/search")).as_deref(),
            Some("search")
        );
        assert_eq!(
            selected(&path, &get("/tools/search/v1?q=1")).as_deref(),
            Some("search")
        );
        assert_eq!(selected(&path, &get("/tools/")), None);
        assert_eq!(selected(&path, &get("/tools//x")), None);
        assert_eq!(selected(&path, &get("/health")), None);

        let fixed = ToolSelector::Fixed(Arc::from("llm"));
        assert_eq!(selected(&fixed, &get("/anything")).as_deref(), Some("llm"));

        let mut req = get("/x");
        assert_eq!(selected(&ToolSelector::Extension, &req), None);
        req.extensions_mut().insert(ToolName(Arc::from("ext")));
        assert_eq!(
            selected(&ToolSelector::Extension, &req).as_deref(),
            Some("ext")
        );

        let with = ToolSelector::With(Arc::new(|r: &RequestHead<'_>| {
            r.headers
                .get("x-tool")
                .and_then(|v| v.to_str().ok())
                .map(Arc::from)
        }));
        assert_eq!(selected(&with, &req), None);
        req.headers_mut()
            .insert("x-tool", "header".parse().unwrap());
        assert_eq!(selected(&with, &req).as_deref(), Some("header"));
    }
}
