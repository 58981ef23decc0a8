//! The response body: the inner service's body, or a refusal. An admitted call's concurrency
//! permits live here, so a streaming response counts as in flight until its body ends or is
//! dropped.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use super::Held;

pin_project! {
    /// The body of a response that went through [`FairShare`](crate::FairShare).
    pub struct ResponseBody<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B> {
        Inner {
            #[pin]
            body: B,
            held: Option<Box<Held>>,
        },
        Full {
            data: Option<Bytes>,
        },
    }
}

impl<B> ResponseBody<B> {
    pub(crate) fn inner(body: B, held: Option<Box<Held>>) -> Self {
        ResponseBody {
            kind: Kind::Inner { body, held },
        }
    }

    /// A refusal's body: its JSON, or nothing (gRPC).
    pub(crate) fn refusal(json: Option<Bytes>) -> Self {
        ResponseBody {
            kind: Kind::Full { data: json },
        }
    }
}

impl<B> std::fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.kind {
            Kind::Inner { held, .. } => f
                .debug_struct("ResponseBody::Inner")
                .field("holds_permits", &held.is_some())
                .finish(),
            Kind::Full { data } => f
                .debug_struct("ResponseBody::Full")
                .field("len", &data.as_ref().map_or(0, |d| d.len()))
                .finish(),
        }
    }
}

impl<B> Body for ResponseBody<B>
where
    B: Body,
    B::Data: From<Bytes>,
{
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        match self.project().kind.project() {
            KindProj::Inner { body, held } => {
                let polled = body.poll_frame(cx);
                if let Poll::Ready(None) = polled {
                    // The stream is done: the call is no longer in flight.
                    held.take();
                }
                polled
            }
            KindProj::Full { data } => {
                Poll::Ready(data.take().map(|d| Ok(Frame::data(B::Data::from(d)))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Inner { body, .. } => body.is_end_stream(),
            Kind::Full { data } => data.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Inner { body, .. } => body.size_hint(),
            Kind::Full { data } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
        }
    }
}
