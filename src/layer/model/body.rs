//! The response body of a model call: it reads the call's usage as it passes and, when it
//! ends or is dropped, settles the call's token charge to it and gives back its permits.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Buf;
use http::{HeaderMap, HeaderName};
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use super::usage::{Usage, UsageReader};
use crate::identity::Cost;
use crate::layer::{Held, Limits};
use crate::limiter::Ticket;

pin_project! {
    /// The body of a response that went through [`ModelCallLayer`](crate::ModelCallLayer):
    /// the inner service's body, unchanged, or a refusal's JSON.
    pub struct MeteredBody<B> {
        #[pin]
        inner: Option<B>,
        refusal: Option<bytes::Bytes>,
        meter: Option<Meter>,
    }
}

impl<B> MeteredBody<B> {
    pub(super) fn metered(inner: B, meter: Option<Meter>) -> Self {
        MeteredBody {
            inner: Some(inner),
            refusal: None,
            meter,
        }
    }

    pub(super) fn refusal(json: Option<bytes::Bytes>) -> Self {
        MeteredBody {
            inner: None,
            refusal: json,
            meter: None,
        }
    }
}

impl<B> std::fmt::Debug for MeteredBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MeteredBody")
            .field("metered", &self.meter.is_some())
            .finish_non_exhaustive()
    }
}

impl<B> Body for MeteredBody<B>
where
    B: Body,
    B::Data: From<bytes::Bytes>,
{
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.project();
        let Some(mut inner) = this.inner.as_pin_mut() else {
            return Poll::Ready(this.refusal.take().map(|d| Ok(Frame::data(d.into()))));
        };
        let polled = inner.as_mut().poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(m) = this.meter.as_mut() {
                    m.saw(frame);
                }
                // A server that sees the end here polls no more.
                if inner.is_end_stream() {
                    if let Some(mut m) = this.meter.take() {
                        m.end(false);
                    }
                }
            }
            Poll::Ready(None) => {
                if let Some(mut m) = this.meter.take() {
                    m.end(false);
                }
            }
            Poll::Ready(Some(Err(_))) => {
                if let Some(mut m) = this.meter.take() {
                    m.end(true);
                }
            }
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        match &self.inner {
            Some(b) => b.is_end_stream(),
            None => self.refusal.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.inner {
            Some(b) => b.size_hint(),
            None => SizeHint::with_exact(self.refusal.as_ref().map_or(0, |d| d.len() as u64)),
        }
    }
}

/// What an admitted model call keeps until its body ends: the tickets to settle, the permits
/// to give back, and where its usage is found.
pub(super) struct Meter {
    pub(super) limiter: Arc<dyn Limits>,
    /// The token tools' tickets: settled to the usage.
    pub(super) settled: Vec<Ticket>,
    /// The estimate they were charged.
    pub(super) estimate: f64,
    pub(super) usage: Usage,
    pub(super) reader: Option<UsageReader>,
    pub(super) trailer: Option<HeaderName>,
    /// Every ticket that holds permits, given back at the end.
    pub(super) permits: Vec<Held>,
}

impl Meter {
    fn saw<D: Buf>(&mut self, frame: &Frame<D>) {
        if let (Some(data), Some(r)) = (frame.data_ref(), self.reader.as_mut()) {
            r.read(data.chunk(), &self.usage);
        }
        if let (Some(trailers), Some(name)) = (frame.trailers_ref(), &self.trailer) {
            if let Some(n) = trailer_tokens(trailers, name) {
                self.usage.report(n);
            }
        }
    }

    /// The body ended (or, `cut_off`, failed or was dropped before its end): the token charge
    /// settled to the usage reported — the estimate stands when none was — and the permits
    /// given back.
    fn end(&mut self, cut_off: bool) {
        if let (false, Some(r)) = (cut_off, self.reader.as_mut()) {
            r.end(&self.usage);
        }
        let reported = self.usage.reported();
        for ticket in std::mem::take(&mut self.settled) {
            let tool = ticket.admission().map(|a| a.keys.tool.clone());
            let tenant = ticket.admission().map(|a| a.keys.tenant.clone());
            tracing::info!(
                target: "tower_fairshare::decision",
                tool = tool.as_deref().unwrap_or(""),
                tenant = tenant.as_deref().unwrap_or(""),
                estimate = self.estimate,
                reported,
                cut_off,
                "{}",
                match (reported.is_some(), cut_off) {
                    (true, false) => "model call settled to its usage",
                    (true, true) => "model call cut off: settled to the usage reported before",
                    (false, false) => "model call ended without reporting its usage: the estimate stands",
                    (false, true) => "model call cut off before reporting usage: the estimate stands",
                }
            );
            if let Some(n) = reported {
                self.limiter.settle(ticket, Cost(n));
            }
        }
        self.permits.clear();
    }
}

impl Drop for Meter {
    /// Dropped before its body ended: the client went away, or the server stopped reading.
    fn drop(&mut self) {
        if !self.settled.is_empty() {
            self.end(true);
        }
    }
}

/// The tokens a trailer reports (a number), if it has one.
fn trailer_tokens(trailers: &HeaderMap, name: &HeaderName) -> Option<f64> {
    let n: f64 = trailers.get(name)?.to_str().ok()?.trim().parse().ok()?;
    (n.is_finite() && n >= 0.0).then_some(n)
}
