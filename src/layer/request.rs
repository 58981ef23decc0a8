//! What the MCP and model-call layers do with a request before deciding it: its body read
//! whole (bounded), and its caller identified.

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, Bytes};
use http_body::{Body, Frame, SizeHint};

use super::body::ResponseBody;
use super::layer::Shared;
use super::select::{Identity, RequestHead};
use crate::identity::Caller;

/// A body-reading layer (MCP mode, model calls) and the service it wraps around an inner
/// service: the layer (with its `Layer` impl and `with`, which changes one of its `Options`),
/// the service (with its `Debug` and tower `Service`, which hands each request, the inner
/// service driven ready, to the mode's `serve`, an `async fn(inner, shared, options, req)`),
/// and the service's future, whose response body is `$body` over the inner service's.
macro_rules! buffered_layer {
    (
        $(#[$ldoc:meta])* layer $layer:ident;
        $(#[$sdoc:meta])* service $name:ident;
        $(#[$fdoc:meta])* future $future:ident of $body:ident;
        serve $serve:path;
    ) => {
        $(#[$ldoc])*
        #[derive(Clone)]
        pub struct $layer {
            shared: Arc<Shared>,
            options: Arc<Options>,
        }

        impl $layer {
            fn with(self, f: impl FnOnce(&mut Options)) -> Self {
                let mut options = Options::clone(&self.options);
                f(&mut options);
                $layer {
                    shared: self.shared,
                    options: Arc::new(options),
                }
            }
        }

        impl<S> Layer<S> for $layer {
            type Service = $name<S>;

            fn layer(&self, inner: S) -> $name<S> {
                $name {
                    inner,
                    shared: self.shared.clone(),
                    options: self.options.clone(),
                }
            }
        }

        $(#[$sdoc])*
        #[derive(Clone)]
        pub struct $name<S> {
            inner: S,
            shared: Arc<Shared>,
            options: Arc<Options>,
        }

        impl<S: fmt::Debug> fmt::Debug for $name<S> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.debug_struct(stringify!($name))
                    .field("inner", &self.inner)
                    .finish_non_exhaustive()
            }
        }

        $(#[$fdoc])*
        pub type $future<ResB, E> =
            Pin<Box<dyn Future<Output = Result<Response<$body<ResB>>, E>> + Send>>;

        impl<S, B, ResB> Service<Request<B>> for $name<S>
        where
            S: Service<Request<BufferedBody>, Response = Response<ResB>> + Clone + Send + 'static,
            S::Future: Send,
            S::Error: Send + 'static,
            B: http_body::Body + Send + 'static,
            B::Data: Send,
            B::Error: Into<Box<dyn StdError + Send + Sync>>,
            ResB: http_body::Body + Send + 'static,
            ResB::Data: From<Bytes>,
        {
            type Response = Response<$body<ResB>>;
            type Error = S::Error;
            type Future = $future<ResB, S::Error>;

            fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
                self.inner.poll_ready(cx)
            }

            fn call(&mut self, req: Request<B>) -> Self::Future {
                // The service was driven ready; a clone takes its place for the next call.
                let clone = self.inner.clone();
                let inner = std::mem::replace(&mut self.inner, clone);
                let (shared, options) = (self.shared.clone(), self.options.clone());
                Box::pin($serve(inner, shared, options, req))
            }
        }
    };
}

/// A response of a layer's own, or of the app's identification, sent instead.
pub(super) type Answer<ResB> = http::Response<ResponseBody<ResB>>;

/// The caller, as the layer identifies callers (none: anonymous), or the app's own rejection
/// (then nothing is decided or charged).
pub(super) fn identify(
    shared: &Shared,
    parts: &http::request::Parts,
) -> Result<Caller, Box<http::Response<Bytes>>> {
    let caller = match &shared.identify {
        Identity::Extension => parts.extensions.get::<Caller>().cloned(),
        Identity::With(identify) => {
            let head = RequestHead {
                method: &parts.method,
                uri: &parts.uri,
                headers: &parts.headers,
                extensions: &parts.extensions,
            };
            identify.identify_or_reject(&head)?
        }
    };
    Ok(caller.unwrap_or_default())
}

/// Why a request body was not read.
pub(super) enum Unread {
    TooLarge,
    Failed,
}

/// `body`, whole, if it is at most `max` bytes (one frame is kept as it came, without a copy).
pub(super) async fn read_body<B: Body>(body: B, max: usize) -> Result<Bytes, Unread> {
    let mut body = std::pin::pin!(body);
    let mut chunks: Vec<Bytes> = Vec::new();
    let mut len = 0;
    while let Some(frame) = std::future::poll_fn(|cx| body.as_mut().poll_frame(cx)).await {
        let Ok(mut data) = frame.map_err(|_| Unread::Failed)?.into_data() else {
            continue; // trailers
        };
        len += data.remaining();
        if len > max {
            return Err(Unread::TooLarge);
        }
        chunks.push(data.copy_to_bytes(data.remaining()));
    }
    Ok(match chunks.len() {
        0 => Bytes::new(),
        1 => chunks.pop().expect("one chunk"),
        _ => Bytes::from(chunks.concat()),
    })
}

/// A request body [`McpLayer`](crate::McpLayer) or [`ModelCallLayer`](crate::ModelCallLayer) read whole: what the service behind it gets, byte for byte as
/// the client sent it.
#[derive(Clone, Debug, Default)]
pub struct BufferedBody(pub(super) Option<Bytes>);

impl BufferedBody {
    /// The body's bytes.
    pub fn bytes(&self) -> &[u8] {
        self.0.as_deref().unwrap_or_default()
    }
}

impl Body for BufferedBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let data = self.get_mut().0.take().filter(|b| !b.is_empty());
        Poll::Ready(data.map(|b| Ok(Frame::data(b))))
    }

    fn is_end_stream(&self) -> bool {
        self.bytes().is_empty()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.bytes().len() as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A body of these frames, one at a time.
    struct Frames(Vec<Bytes>);

    impl Body for Frames {
        type Data = Bytes;
        type Error = Infallible;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
            let next = (!self.0.is_empty()).then(|| self.0.remove(0));
            Poll::Ready(next.map(|b| Ok(Frame::data(b))))
        }
    }

    fn frames(parts: &[&'static str]) -> Frames {
        Frames(
            parts
                .iter()
                .map(|p| Bytes::from_static(p.as_bytes()))
                .collect(),
        )
    }

    #[tokio::test]
    async fn a_body_is_read_whole_up_to_its_limit() {
        let read = read_body(frames(&["{\"a\":", "1", "}"]), 7).await;
        assert_eq!(read.ok().as_deref(), Some(&b"{\"a\":1}"[..]));
        assert!(matches!(
            read_body(frames(&["{\"a\":", "12", "}"]), 7).await,
            Err(Unread::TooLarge)
        ));
        let body = BufferedBody(Some(Bytes::from_static(b"xy")));
        assert_eq!(body.size_hint().exact(), Some(2));
        assert_eq!(read_body(body, 2).await.ok().as_deref(), Some(&b"xy"[..]));
    }
}
