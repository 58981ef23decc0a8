//! Small conversions for apps that call the limiter themselves (features `axum`, `tonic`).
