//! [`FairShare`]: the service, and its [`ResponseFuture`].

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use pin_project_lite::pin_project;
use tower_service::Service;

use super::body::ResponseBody;
use super::layer::Shared;
use super::refusal::{admitted_headers, is_grpc, response};
use super::select::RequestHead;
use super::{BoxFuture, Held};
use crate::identity::Cost;
use crate::limiter::Ticket;
use crate::Refusal;

/// A service behind a [`FairShareLayer`](crate::FairShareLayer).
#[derive(Clone)]
pub struct FairShare<S> {
    pub(crate) inner: S,
    pub(crate) shared: Arc<Shared>,
}

impl<S: fmt::Debug> fmt::Debug for FairShare<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FairShare")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S> FairShare<S> {
    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }
    /// The inner service, unwrapped.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, ReqB, ResB> Service<Request<ReqB>> for FairShare<S>
where
    S: Service<Request<ReqB>, Response = Response<ResB>> + Clone,
    ResB: http_body::Body,
    ResB::Data: From<Bytes>,
{
    type Response = Response<ResponseBody<ResB>>;
    type Error = S::Error;
    type Future = ResponseFuture<S, ReqB>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqB>) -> Self::Future {
        let head = RequestHead::of(&req);
        let Some(tool) = self.shared.tool.select(&head) else {
            return ResponseFuture {
                state: State::Passthrough {
                    fut: self.inner.call(req),
                },
            };
        };
        let caller = self.shared.identify.identify(&head).unwrap_or_default();
        let cost = req.extensions().get::<Cost>().copied().unwrap_or_default();
        let grpc = is_grpc(req.headers());
        let mut admission = self.shared.limiter.admit(caller, tool, cost);
        // The service was driven ready; a clone takes its place for the next call.
        let clone = self.inner.clone();
        let ready = std::mem::replace(&mut self.inner, clone);
        // Stores that answer at once (the memory store) skip a round of polling.
        let state = match admission
            .as_mut()
            .poll(&mut Context::from_waker(std::task::Waker::noop()))
        {
            Poll::Ready(outcome) => after_admission(outcome, ready, req, &self.shared, grpc),
            Poll::Pending => State::Admitting {
                admission,
                inner: Some(ready),
                req: Some(req),
                shared: self.shared.clone(),
                grpc,
            },
        };
        ResponseFuture { state }
    }
}

fn after_admission<S, ReqB, ResB>(
    outcome: Result<Ticket, Refusal>,
    mut inner: S,
    req: Request<ReqB>,
    shared: &Arc<Shared>,
    grpc: bool,
) -> State<S, ReqB>
where
    S: Service<Request<ReqB>, Response = Response<ResB>>,
{
    match outcome {
        Ok(ticket) => State::Calling {
            held: Held::new(&ticket, &shared.limiter),
            fut: inner.call(req),
            ticket: Some(ticket),
            shared: shared.clone(),
        },
        Err(refusal) if !shared.enforce => {
            tracing::info!(reason = refusal.reason.as_str(), tool = %refusal.tool, "shadow mode: would refuse");
            State::Passthrough {
                fut: inner.call(req),
            }
        }
        Err(refusal) => State::Refused {
            refusal: Some(Box::new(refusal)),
            grpc,
        },
    }
}

pin_project! {
    /// The future of [`FairShare`]'s response.
    pub struct ResponseFuture<S, ReqB>
    where
        S: Service<Request<ReqB>>,
    {
        #[pin]
        state: State<S, ReqB>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, ReqB>
    where
        S: Service<Request<ReqB>>,
    {
        Admitting {
            admission: BoxFuture<Result<Ticket, Refusal>>,
            inner: Option<S>,
            req: Option<Request<ReqB>>,
            shared: Arc<Shared>,
            grpc: bool,
        },
        Calling {
            #[pin]
            fut: S::Future,
            ticket: Option<Ticket>,
            held: Option<Held>,
            shared: Arc<Shared>,
        },
        Passthrough {
            #[pin]
            fut: S::Future,
        },
        Refused {
            refusal: Option<Box<Refusal>>,
            grpc: bool,
        },
    }
}

impl<S, ReqB> fmt::Debug for ResponseFuture<S, ReqB>
where
    S: Service<Request<ReqB>>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

impl<S, ReqB, ResB> Future for ResponseFuture<S, ReqB>
where
    S: Service<Request<ReqB>, Response = Response<ResB>>,
    ResB: http_body::Body,
    ResB::Data: From<Bytes>,
{
    type Output = Result<Response<ResponseBody<ResB>>, S::Error>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        loop {
            let next = match self.as_mut().project().state.project() {
                StateProj::Admitting {
                    admission,
                    inner,
                    req,
                    shared,
                    grpc,
                } => {
                    let outcome = ready!(admission.as_mut().poll(cx));
                    let (Some(inner), Some(req)) = (inner.take(), req.take()) else {
                        panic!("ResponseFuture polled after completion");
                    };
                    after_admission(outcome, inner, req, shared, *grpc)
                }
                StateProj::Calling {
                    fut,
                    ticket,
                    held,
                    shared,
                } => {
                    // An inner error drops `held` with the future: the permits come back.
                    let mut res = ready!(fut.poll(cx))?;
                    let ticket = ticket.take().expect("polled after completion");
                    if let Some(actual) = res.extensions().get::<Cost>().copied() {
                        shared.limiter.settle(ticket.clone(), actual);
                    }
                    if shared.headers {
                        admitted_headers(&ticket, res.headers_mut());
                    }
                    let held = held.take();
                    return Poll::Ready(Ok(res.map(|b| ResponseBody::inner(b, held))));
                }
                StateProj::Passthrough { fut } => {
                    let res = ready!(fut.poll(cx))?;
                    return Poll::Ready(Ok(res.map(|b| ResponseBody::inner(b, None))));
                }
                StateProj::Refused { refusal, grpc } => {
                    let r = refusal.take().expect("polled after completion");
                    return Poll::Ready(Ok(response(&r, *grpc)));
                }
            };
            self.as_mut().project().state.set(next);
        }
    }
}
