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
use super::refusal::{admitted_headers, is_grpc, render};
use super::select::{Identity, RequestHead};
use super::{BoxFuture, Held};
use crate::identity::{Caller, Cost};
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

/// What `call` does once it has looked at the request.
// Lives for one `match`; boxing the decision would cost an allocation a call.
#[allow(clippy::large_enum_variant)]
enum Step {
    /// No tool: through, unmetered.
    Pass,
    /// The store decided at once.
    Decided(Result<Ticket, Refusal>),
    /// The store has to be waited for.
    Wait(Caller, Arc<str>, Cost),
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
        let shared = &*self.shared;
        // Everything borrowed from the request ends with this block, before it moves on.
        let step = {
            let head = RequestHead::of(&req);
            match shared.tool.select(&head) {
                None => Step::Pass,
                Some(tool) => {
                    let identified;
                    let caller = match &shared.identify {
                        Identity::Extension => req.extensions().get::<Caller>(),
                        Identity::With(identify) => {
                            identified = identify.identify(&head);
                            identified.as_ref()
                        }
                    };
                    let anonymous;
                    let caller = match caller {
                        Some(c) => c,
                        None => {
                            anonymous = Caller::default();
                            &anonymous
                        }
                    };
                    let cost = req.extensions().get::<Cost>().copied().unwrap_or_default();
                    match shared.limiter.try_admit(caller, tool.as_str(), cost) {
                        Some(outcome) => Step::Decided(outcome),
                        None => Step::Wait(caller.clone(), tool.into_arc(), cost),
                    }
                }
            }
        };
        let state = match step {
            Step::Pass => State::Passthrough {
                fut: self.inner.call(req),
            },
            // The service was driven ready and the call goes on at once: no clone needed.
            Step::Decided(outcome) => after_admission(outcome, &mut self.inner, req, &self.shared),
            Step::Wait(caller, tool, cost) => {
                let admission = shared.limiter.admit(caller, tool, cost);
                // The service was driven ready; a clone takes its place for the next call.
                let clone = self.inner.clone();
                State::Admitting {
                    admission,
                    inner: Some(std::mem::replace(&mut self.inner, clone)),
                    req: Some(req),
                    shared: self.shared.clone(),
                }
            }
        };
        ResponseFuture { state }
    }
}

#[inline]
fn after_admission<S, ReqB, ResB>(
    outcome: Result<Ticket, Refusal>,
    inner: &mut S,
    req: Request<ReqB>,
    shared: &Arc<Shared>,
) -> State<S, ReqB>
where
    S: Service<Request<ReqB>, Response = Response<ResB>>,
{
    match outcome {
        Ok(ticket) => State::Calling {
            held: Some(Held::new(ticket, &shared.limiter)),
            fut: inner.call(req),
            shared: shared.clone(),
        },
        Err(refusal) if !shared.enforce => {
            tracing::info!(reason = refusal.reason.as_str(), tool = %refusal.tool, "shadow mode: would refuse");
            State::Passthrough {
                fut: inner.call(req),
            }
        }
        Err(refusal) => State::Refused {
            res: Some(render(&refusal, is_grpc(req.headers()))),
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
        },
        Calling {
            #[pin]
            fut: S::Future,
            // Dropped with the future (inner error, cancellation): permits come back.
            held: Option<Held>,
            shared: Arc<Shared>,
        },
        Passthrough {
            #[pin]
            fut: S::Future,
        },
        Refused {
            res: Option<Response<Option<Bytes>>>,
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
                } => {
                    let outcome = ready!(admission.as_mut().poll(cx));
                    let (Some(mut inner), Some(req)) = (inner.take(), req.take()) else {
                        panic!("ResponseFuture polled after completion");
                    };
                    after_admission(outcome, &mut inner, req, shared)
                }
                StateProj::Calling { fut, held, shared } => {
                    // An inner error drops `held` with the future: the permits come back.
                    let mut res = ready!(fut.poll(cx))?;
                    let Some(h) = held.as_ref() else {
                        panic!("ResponseFuture polled after completion");
                    };
                    let ticket = h.ticket();
                    if let Some(actual) = res.extensions().get::<Cost>().copied() {
                        shared.limiter.settle(ticket.clone(), actual);
                    }
                    if shared.headers {
                        admitted_headers(ticket, res.headers_mut());
                    }
                    // Only permits outlive the call, in the body; boxed, so the body stays small.
                    // Otherwise the ticket is dropped in place (it is large: no move).
                    let held = if h.holds_permits() {
                        held.take().map(Box::new)
                    } else {
                        *held = None;
                        None
                    };
                    return Poll::Ready(Ok(res.map(|b| ResponseBody::inner(b, held))));
                }
                StateProj::Passthrough { fut } => {
                    let res = ready!(fut.poll(cx))?;
                    return Poll::Ready(Ok(res.map(|b| ResponseBody::inner(b, None))));
                }
                StateProj::Refused { res } => {
                    let res = res.take().expect("polled after completion");
                    return Poll::Ready(Ok(res.map(ResponseBody::refusal)));
                }
            };
            self.as_mut().project().state.set(next);
        }
    }
}
