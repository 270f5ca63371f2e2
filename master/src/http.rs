//! The master's HTTP port: Prometheus metrics, a health probe, and the segment list SGLang polls.

use std::sync::Arc;

use axum::{extract::State, http::header, response::IntoResponse, routing::get, Router};

use crate::service::Shared;

pub fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/health", get(health))
        .route("/get_all_segments", get(all_segments))
        .with_state(shared)
}

async fn metrics(State(shared): State<Arc<Shared>>) -> impl IntoResponse {
    // Render under the lock into a string, then release it before the response is written.
    let body = {
        let now = shared.clock.now();
        let leading = shared.leadership.holds(now);
        let state = shared.state.lock();
        shared.metrics.render(&state, now, leading)
    };
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], body)
}

async fn health() -> &'static str {
    "OK\n"
}

async fn all_segments(State(shared): State<Arc<Shared>>) -> String {
    let names: Vec<String> = shared
        .state
        .lock()
        .segment_stats()
        .into_iter()
        .map(|s| s.name.to_string())
        .collect();
    let mut out = names.join("\n");
    if !out.is_empty() {
        out.push('\n');
    }
    out
}
