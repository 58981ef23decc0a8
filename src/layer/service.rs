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
use crate::limiter::{Begun, Ticket};
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
        let shared = &*self.shared;
        let head = RequestHead::of(&req);
        let Some(tool) = shared.tool.select(&head) else {
            crate::telemetry::unmapped(req.uri().path());
            return ResponseFuture {
                state: State::Passthrough {
                    fut: self.inner.call(req),
                },
            };
        };
        let identified;
        let caller = match &shared.identify {
            Identity::Extension => req.extensions().get::<Caller>(),
            Identity::With(identify) => match identify.identify_or_reject(&head) {
                Ok(c) => {
                    identified = c;
                    identified.as_ref()
                }
                // The app's own rejection: nothing decided, nothing charged.
                Err(res) => {
                    return ResponseFuture {
                        state: State::Refused {
                            res: Some((*res).map(Some)),
                        },
                    }
                }
            },
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
        let outcome = match shared.limiter.begin(caller, tool.as_str(), cost) {
            Begun::Done(outcome) => outcome,
            // The store has to be waited for.
            Begun::Waiting(admission) => {
                // The service was driven ready; a clone takes its place for the next call.
                let clone = self.inner.clone();
                return ResponseFuture {
                    state: State::Admitting {
                        waiting: Box::new(Waiting {
                            admission,
                            inner: Some(std::mem::replace(&mut self.inner, clone)),
                            req: Some(req),
                            shared: self.shared.clone(),
                        }),
                    },
                };
            }
        };
        // What was borrowed from the request ends here, before the request moves on.
        drop(tool);
        // The service was driven ready and the call goes on at once: no clone needed.
        ResponseFuture {
            state: after_admission(outcome, &mut self.inner, req, &self.shared),
        }
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
            tracing::info!(reason = refusal.reason.as_str(), tool = %refusal.tool(), "shadow mode: would refuse");
            State::Passthrough {
                fut: inner.call(req),
            }
        }
        Err(refusal) => {
            let grpc = is_grpc(req.headers());
            let mut res = match &shared.on_refusal {
                Some(f) => f(&refusal, grpc).map(Some),
                None => render(&refusal, grpc),
            };
            if res.status() == http::StatusCode::UNAUTHORIZED
                && (shared.on_refusal.is_none()
                    || !res.headers().contains_key(http::header::WWW_AUTHENTICATE))
            {
                res.headers_mut()
                    .insert(http::header::WWW_AUTHENTICATE, shared.challenge.clone());
            }
            State::Refused { res: Some(res) }
        }
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
        // Out of line: only a store that must be waited for (Redis) takes this way, and the
        // future every other request moves stays the size of the inner one and a ticket.
        Admitting {
            waiting: Box<Waiting<S, ReqB>>,
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

/// A call whose store must be waited for: the decision, and what the call needs after it.
struct Waiting<S, ReqB> {
    admission: BoxFuture<Result<Ticket, Refusal>>,
    inner: Option<S>,
    req: Option<Request<ReqB>>,
    shared: Arc<Shared>,
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
                StateProj::Admitting { waiting } => {
                    let outcome = ready!(waiting.admission.as_mut().poll(cx));
                    let (Some(mut inner), Some(req)) = (waiting.inner.take(), waiting.req.take())
                    else {
                        panic!("ResponseFuture polled after completion");
                    };
                    after_admission(outcome, &mut inner, req, &waiting.shared)
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

#[cfg(test)]
mod tests {
    //! The path for stores that cannot decide at once (Redis): the memory store always can, so
    //! the integration tests never take it.

    use std::convert::Infallible;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::Waker;

    use http::StatusCode;
    use http_body_util::{BodyExt, Full};
    use tower::{service_fn, Layer, ServiceExt};

    use super::*;
    use crate::clock::{ManualClock, Timestamp};
    use crate::layer::select::ToolSelector;
    use crate::layer::{FairShareLayer, Limits};
    use crate::{Limiter, MemoryStore, Policy, Store};

    /// A limiter whose every decision waits one poll.
    struct Waits(Limiter<MemoryStore, ManualClock>);

    impl Limits for Waits {
        fn begin(&self, caller: &Caller, tool: &str, cost: Cost) -> Begun {
            let (limiter, caller, tool) = (self.0.clone(), caller.clone(), tool.to_owned());
            Begun::Waiting(Box::pin(async move {
                let mut yielded = false;
                std::future::poll_fn(|cx| {
                    if yielded {
                        return Poll::Ready(());
                    }
                    yielded = true;
                    cx.waker().wake_by_ref();
                    Poll::Pending
                })
                .await;
                limiter.admit(&caller, &tool, cost).await
            }))
        }
        fn admit_all(
            &self,
            caller: Caller,
            charges: Vec<(Arc<str>, Cost)>,
        ) -> crate::layer::BoxFuture<crate::layer::AllOutcome> {
            Limits::admit_all(&self.0, caller, charges)
        }
        fn release(&self, ticket: Ticket) {
            Limits::release(&self.0, ticket)
        }
        fn settle(&self, ticket: Ticket, actual: Cost) {
            Limits::settle(&self.0, ticket, actual)
        }
    }

    const POLICY: &str = r#"
        [[tool]]
        name = "report"
        unit = "calls"
        rate = { limit = 600, per = "1m" }
        [tool.default_tenant]
        ceiling = 2
        burst = 2
        max_concurrency = 1
    "#;

    fn layer(limiter: &Limiter<MemoryStore, ManualClock>) -> FairShareLayer {
        FairShareLayer {
            shared: Arc::new(Shared {
                limiter: Arc::new(Waits(limiter.clone())),
                identify: Identity::Extension,
                tool: ToolSelector::Path(Arc::from("/tools/")),
                headers: true,
                enforce: true,
                challenge: crate::layer::refusal::DEFAULT_CHALLENGE,
                on_refusal: None,
            }),
        }
    }

    fn request(path: &str) -> Request<Full<Bytes>> {
        let mut req = Request::get(path).body(Full::new(Bytes::new())).unwrap();
        req.extensions_mut().insert(Caller::new("acme"));
        req
    }

    #[tokio::test]
    async fn a_store_that_waits_admits_refuses_and_gets_permits_back() {
        let limiter = Limiter::with_store(
            Policy::from_toml_str(POLICY).unwrap(),
            MemoryStore::new(),
            ManualClock::new(Timestamp(1_767_225_600_000_000)),
        );
        let keys = limiter.call_keys(&Caller::new("acme"), "report").unwrap();
        let in_flight = || async {
            let s = limiter.store().inspect(&keys).await.unwrap();
            s[1].as_ref().map_or(0.0, |s| s.in_flight)
        };
        let calls = Arc::new(AtomicUsize::new(0));
        let c = calls.clone();
        let inner = service_fn(move |_req: Request<Full<Bytes>>| {
            c.fetch_add(1, Ordering::SeqCst);
            async { Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok")))) }
        });
        let mut svc = layer(&limiter).layer(inner);

        // Admitted after one pending poll; the permit lives in the body.
        let mut fut = Box::pin(svc.ready().await.unwrap().call(request("/tools/report")));
        let mut cx = Context::from_waker(Waker::noop());
        assert!(fut.as_mut().poll(&mut cx).is_pending());
        assert_eq!(
            calls.load(Ordering::SeqCst),
            0,
            "not called before admission"
        );
        let res = fut.await.unwrap();
        assert_eq!(res.status(), StatusCode::OK);
        assert!(res.headers().contains_key(super::super::RATELIMIT_POLICY));
        assert_eq!(in_flight().await, 1.0);

        // Concurrency refusal through the waiting path: JSON, the inner service untouched.
        let refused = svc
            .ready()
            .await
            .unwrap()
            .call(request("/tools/report"))
            .await
            .unwrap();
        assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
        let body = refused.into_body().collect().await.unwrap().to_bytes();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["error"], "concurrency_exceeded");
        assert_eq!(calls.load(Ordering::SeqCst), 1);

        // The body ends: the permit comes back.
        let body = res.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(&body[..], b"ok");
        assert_eq!(in_flight().await, 0.0);

        // Dropped while the store is deciding: nothing charged, nothing held.
        let mut fut = Box::pin(svc.ready().await.unwrap().call(request("/tools/report")));
        assert!(fut.as_mut().poll(&mut cx).is_pending());
        drop(fut);
        assert_eq!(in_flight().await, 0.0);
        assert_eq!(calls.load(Ordering::SeqCst), 1);

        // Unknown tool: refused on the waiting path as well.
        let res = svc
            .ready()
            .await
            .unwrap()
            .call(request("/tools/nope"))
            .await
            .unwrap();
        assert_eq!(res.status(), StatusCode::FORBIDDEN);
    }
}
