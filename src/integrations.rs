//! Small conversions for apps that call the limiter themselves (features `axum`, `tonic`).
//!
//! [`FairShareLayer`](crate::FairShareLayer) answers refusals on its own. A handler that calls
//! [`Limiter::admit`](crate::Limiter::admit) directly — to meter one step inside a request, or
//! to charge a cost it only knows after parsing the body — can return the [`Refusal`] with `?`
//! and get the same answer the layer would give:
//!
//! * feature `tonic`: `From<Refusal> for tonic::Status` — RESOURCE_EXHAUSTED /
//!   PERMISSION_DENIED / UNAUTHENTICATED / UNAVAILABLE, the JSON refusal as the message and
//!   `retry-after` metadata when a retry can succeed;
//! * feature `axum`: `IntoResponse for Refusal` — the layer's HTTP refusal: 429 / 403 / 401 /
//!   503, the JSON body, `Retry-After`, and `RateLimit-Policy` / `RateLimit` for a refused rate
//!   or budget.

#[cfg(feature = "tonic")]
mod tonic_status {
    use crate::admission::{Reason, Refusal};
    use crate::layer::grpc_code;

    /// A refusal as a gRPC status, for tonic handlers that call the limiter themselves.
    ///
    /// The code is [`grpc_code`] of the reason (RESOURCE_EXHAUSTED,
    /// PERMISSION_DENIED, UNAUTHENTICATED or UNAVAILABLE), the message is
    /// [`Refusal::to_json`], and a retryable refusal carries the retry hints gRPC clients
    /// read — `google.rpc.RetryInfo` in the status details (`grpc-status-details-bin`),
    /// `grpc-retry-pushback-ms` — and `retry-after` metadata in whole seconds: the same
    /// status a client sees when [`FairShareLayer`](crate::FairShareLayer) refuses the call.
    ///
    /// ```
    /// use tower_fairshare::{Caller, Cost, Limiter, Policy};
    ///
    /// async fn generate_report(limiter: &Limiter, caller: &Caller) -> Result<String, tonic::Status> {
    ///     let _ticket = limiter.admit(caller, "generate_report", Cost::default()).await?;
    ///     Ok("report".to_owned())
    /// }
    ///
    /// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
    /// let policy = Policy::from_toml_str(r#"
    ///     [[tool]]
    ///     name = "generate_report"
    ///     unit = "calls"
    ///     rate = { limit = 600, per = "1m" }
    ///     [tool.default_tenant]
    ///     ceiling = 1
    ///     burst = 1
    /// "#).unwrap();
    /// let limiter = Limiter::new(policy);
    /// let acme = Caller::new("acme");
    /// assert!(generate_report(&limiter, &acme).await.is_ok());
    /// let status = generate_report(&limiter, &acme).await.unwrap_err();
    /// assert_eq!(status.code(), tonic::Code::ResourceExhausted);
    /// assert!(status.message().starts_with(r#"{"error":"rate_limited""#));
    /// assert!(status.metadata().get("retry-after").is_some());
    /// assert!(status.metadata().get("grpc-retry-pushback-ms").is_some());
    /// assert!(!status.details().is_empty()); // google.rpc.Status with a RetryInfo
    /// # });
    /// ```
    impl From<Refusal> for tonic::Status {
        fn from(refusal: Refusal) -> tonic::Status {
            let code = grpc_code(refusal.reason);
            let json = refusal.to_json();
            // As the layer does: a store outage is always worth retrying.
            if !(refusal.retryable || refusal.reason == Reason::StoreUnavailable) {
                return tonic::Status::new(tonic::Code::from(i32::from(code)), json);
            }
            // The retry hints gRPC clients read: `google.rpc.RetryInfo` in the status details,
            // `grpc-retry-pushback-ms`, and `retry-after` (whole seconds) as over HTTP.
            let delay = crate::layer::retry_delay(&refusal);
            let details = crate::layer::status_details(code, json.as_bytes(), delay);
            let mut status = tonic::Status::with_details(
                tonic::Code::from(i32::from(code)),
                json,
                details.into(),
            );
            let md = status.metadata_mut();
            md.insert("retry-after", refusal.retry_after_secs().into());
            md.insert("grpc-retry-pushback-ms", (delay.as_millis() as u64).into());
            status
        }
    }
}

#[cfg(feature = "axum")]
mod axum_response {
    use axum::body::Body;
    use axum::response::{IntoResponse, Response};

    use crate::admission::Refusal;

    /// A refusal as an HTTP response, for axum handlers that call the limiter themselves.
    ///
    /// The same response [`FairShareLayer`](crate::FairShareLayer) sends: the status of
    /// [`http_status`](crate::http_status) (429, 403, 401 or 503), the JSON of
    /// [`Refusal::to_json`] as an `application/json` body, `Retry-After` in whole seconds when
    /// a retry can succeed, and `RateLimit-Policy` / `RateLimit` when a rate or a budget
    /// refused.
    ///
    /// ```
    /// use axum::extract::{Extension, State};
    /// use axum::response::IntoResponse;
    /// use axum::routing::post;
    /// use axum::Router;
    /// use tower_fairshare::{Caller, Cost, Limiter, Policy, Refusal};
    ///
    /// // `Caller` was put in the extensions by the app's auth layer.
    /// async fn generate_report(
    ///     State(limiter): State<Limiter>,
    ///     Extension(caller): Extension<Caller>,
    /// ) -> Result<&'static str, Refusal> {
    ///     let _ticket = limiter.admit(&caller, "generate_report", Cost::default()).await?;
    ///     Ok("report")
    /// }
    ///
    /// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
    /// let policy = Policy::from_toml_str(r#"
    ///     [[tool]]
    ///     name = "generate_report"
    ///     unit = "calls"
    ///     rate = { limit = 600, per = "1m" }
    ///     [tool.default_tenant]
    ///     ceiling = 1
    ///     burst = 1
    /// "#).unwrap();
    /// let limiter = Limiter::new(policy);
    /// let app: Router = Router::new()
    ///     .route("/report", post(generate_report))
    ///     .with_state(limiter.clone());
    /// # let _ = app;
    ///
    /// let acme = Caller::new("acme");
    /// limiter.admit(&acme, "generate_report", Default::default()).await.unwrap();
    /// let refusal = limiter.admit(&acme, "generate_report", Cost::default()).await.unwrap_err();
    /// let response = refusal.into_response();
    /// assert_eq!(response.status(), 429);
    /// assert!(response.headers().contains_key("retry-after"));
    /// # });
    /// ```
    impl IntoResponse for Refusal {
        fn into_response(self) -> Response {
            // Exactly the layer's response: one builder serves both.
            crate::layer::refusal_response::<Body>(&self, false).map(Body::new)
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::admission::{Reason, Refusal, Scope};

    fn refusal(reason: Reason) -> Refusal {
        let mut r = Refusal::named(
            reason,
            "web_search".into(),
            Some("team-support".into()),
            Some("agent-7".into()),
            Some("hour".into()),
        );
        r.scope = Some(Scope::Tenant);
        r.limit = Some(250.0);
        r.used = Some(250.0);
        r.window_secs = Some(3600);
        r.retry_after = Some(Duration::from_millis(1200));
        r.retryable = true;
        r
    }

    #[cfg(feature = "tonic")]
    mod tonic_status {
        use super::*;
        use tonic::Code;

        #[test]
        fn codes_follow_spec() {
            for (reason, code) in [
                (Reason::RateLimited, Code::ResourceExhausted),
                (Reason::CapExceeded, Code::ResourceExhausted),
                (Reason::ConcurrencyExceeded, Code::ResourceExhausted),
                (Reason::PermissionDenied, Code::PermissionDenied),
                (Reason::UnidentifiedCaller, Code::Unauthenticated),
                (Reason::StoreUnavailable, Code::Unavailable),
            ] {
                assert_eq!(
                    tonic::Status::from(refusal(reason)).code(),
                    code,
                    "{reason:?}"
                );
            }
        }

        #[test]
        fn message_is_the_json_refusal_and_retry_after_is_whole_seconds() {
            let r = refusal(Reason::CapExceeded);
            let status = tonic::Status::from(r.clone());
            assert_eq!(status.message(), r.to_json());
            let v: serde_json::Value = serde_json::from_str(status.message()).unwrap();
            assert_eq!(v["error"], "cap_exceeded");
            assert_eq!(v["tenant"], "team-support");
            assert_eq!(v["retry_after_ms"], 1200);
            assert_eq!(status.metadata().get("retry-after").unwrap(), "2");
        }

        #[test]
        fn no_retry_after_when_retrying_cannot_help() {
            let mut r = refusal(Reason::PermissionDenied);
            r.retryable = false;
            r.retry_after = None;
            let status = tonic::Status::from(r);
            assert!(status.metadata().get("retry-after").is_none());
            // Store outages are worth retrying even when not flagged so.
            let mut r = refusal(Reason::StoreUnavailable);
            r.retryable = false;
            let status = tonic::Status::from(r);
            assert_eq!(status.metadata().get("retry-after").unwrap(), "2");
        }

        #[test]
        fn survives_the_wire_encoding() {
            // A tenant name with a quote and non-ASCII text: tonic percent-encodes the message
            // into `grpc-message` and decodes it back unchanged.
            let mut r = refusal(Reason::RateLimited);
            let instance = r.instance().map(Into::into);
            r.set_caller(Some("équipe \"support\"".into()), instance);
            let status = tonic::Status::from(r.clone());
            let mut headers = http::HeaderMap::new();
            status.add_header(&mut headers).unwrap();
            let back = tonic::Status::from_header_map(&headers).unwrap();
            assert_eq!(back.code(), Code::ResourceExhausted);
            assert_eq!(back.message(), r.to_json());
        }
    }

    #[cfg(feature = "axum")]
    mod axum_response {
        use std::convert::Infallible;

        use axum::response::IntoResponse;
        use http_body_util::BodyExt;
        use tower::ServiceExt;

        use super::*;
        use crate::{
            Caller, Cost, FairShareLayer, Limiter, ManualClock, MemoryStore, Policy, Timestamp,
        };

        async fn body_of<B: http_body::Body>(body: B) -> bytes::Bytes
        where
            B::Error: std::fmt::Debug,
        {
            body.collect().await.unwrap().to_bytes()
        }

        #[tokio::test]
        async fn status_headers_and_body() {
            let r = refusal(Reason::CapExceeded);
            let res = r.clone().into_response();
            assert_eq!(res.status(), 429);
            let h = res.headers();
            assert_eq!(h["content-type"], "application/json");
            assert_eq!(h["retry-after"], "2");
            assert_eq!(h["ratelimit-policy"], "\"tenant\";q=250;w=3600");
            assert_eq!(h["ratelimit"], "\"tenant\";r=0;t=2");
            assert_eq!(body_of(res.into_body()).await, r.to_json());

            let mut r = refusal(Reason::UnidentifiedCaller);
            r.retryable = false;
            let res = r.into_response();
            assert_eq!(res.status(), 401);
            assert!(!res.headers().contains_key("retry-after"));
            assert!(!res.headers().contains_key("ratelimit-policy"));
        }

        /// `IntoResponse` answers exactly what the layer answers for the same refusal.
        #[tokio::test]
        async fn same_response_as_the_layer() {
            let policy = Policy::from_toml_str(
                r#"
                [[tool]]
                name = "web_search"
                unit = "calls"
                rate = { limit = 600, per = "1m" }
                [tool.default_tenant]
                ceiling = 1
                burst = 1
                "#,
            )
            .unwrap();
            // A clock that stands still: both answers carry the same retry times.
            let clock = ManualClock::new(Timestamp(1_779_462_000_000_000));
            let limiter = Limiter::with_store(policy, MemoryStore::new(), clock);
            let acme = Caller::new("acme");
            limiter
                .admit(&acme, "web_search", Cost::default())
                .await
                .unwrap();
            let inner = tower::service_fn(|_req: http::Request<String>| async {
                Ok::<_, Infallible>(http::Response::new(String::from("ok")))
            });
            for (tool, caller, status) in [
                ("web_search", Some(acme), 429),
                ("unknown", Some(Caller::new("acme")), 403),
                ("web_search", None, 401),
            ] {
                let layer = FairShareLayer::new(limiter.clone()).tool(tool);
                let svc = tower_layer::Layer::layer(&layer, inner);
                let mut req = http::Request::new(String::new());
                if let Some(c) = &caller {
                    req.extensions_mut().insert(c.clone());
                }
                let from_layer = svc.oneshot(req).await.unwrap();
                let refusal = limiter
                    .admit(&caller.unwrap_or_default(), tool, Cost::default())
                    .await
                    .unwrap_err();
                let ours = refusal.into_response();
                assert_eq!(ours.status(), status);
                assert_eq!(ours.status(), from_layer.status());
                assert_eq!(ours.headers(), from_layer.headers());
                assert_eq!(
                    body_of(ours.into_body()).await,
                    body_of(from_layer.into_body()).await
                );
            }
        }
    }
}
