//! The HTTP port of a master standing by, so that an operator's probes and scrapes see every
//! master of the cluster: `/health` answers (the process lives) and names the leader,
//! `/metrics` says `master_leading 0`, and `/get_all_segments` refuses (a standby holds no
//! segments: ask the leader). The port is given back before this process's term starts (the
//! term's master binds it), and taken again when the term ends.

use std::time::Duration;

use axum::{extract::State, http::StatusCode, routing::get, Router};
use tokio::{net::TcpListener, sync::watch, task::JoinHandle};

/// The leader a standby last saw (None: none yet, or unknown).
pub(super) type Leader = watch::Receiver<Option<String>>;

pub(super) struct StandbyHttp {
    stop: watch::Sender<bool>,
    /// Taken by `stop`; aborted on a drop without it.
    task: Option<JoinHandle<()>>,
}

impl StandbyHttp {
    /// Serves the standby's answers on `host:port` (tried again every second while it cannot
    /// be bound: a term's server still going, say); None when the port is chosen at random
    /// (`0`: a term would get another one).
    pub async fn start(host: &str, port: u16, leader: Leader) -> Option<StandbyHttp> {
        if port == 0 {
            return None;
        }
        let router = Router::new()
            .route("/health", get(health))
            .route("/metrics", get(metrics))
            .route("/get_all_segments", get(segments))
            .with_state(leader);
        let (stop, mut stopped) = watch::channel(false);
        let host = host.to_string();
        let task = tokio::spawn(async move {
            let mut warned = false;
            let listener = loop {
                match TcpListener::bind((host.as_str(), port)).await {
                    Ok(l) => break l,
                    Err(e) => {
                        if !warned {
                            tracing::warn!(error = %e, %host, port, "the standby cannot serve its HTTP port yet; trying again every second");
                            warned = true;
                        }
                    }
                }
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                    _ = stopped.wait_for(|s| *s) => return,
                }
            };
            let shutdown = async move {
                let _ = stopped.wait_for(|s| *s).await;
            };
            if let Err(e) = axum::serve(listener, router)
                .with_graceful_shutdown(shutdown)
                .await
            {
                tracing::warn!(error = %e, "the standby's HTTP server failed");
            }
        });
        Some(StandbyHttp {
            stop,
            task: Some(task),
        })
    }

    /// Stops serving and frees the port (a scrape still under way after a second is cut).
    pub async fn stop(mut self) {
        let _ = self.stop.send(true);
        let Some(mut task) = self.task.take() else {
            return;
        };
        if tokio::time::timeout(Duration::from_secs(1), &mut task)
            .await
            .is_err()
        {
            task.abort();
            let _ = task.await;
        }
    }
}

impl Drop for StandbyHttp {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// Passes a campaign's news on, and tells the standby's HTTP answers who leads.
pub(super) struct Announcing<'a> {
    pub events: &'a dyn super::Events,
    pub leader: watch::Sender<Option<String>>,
}

impl super::Events for Announcing<'_> {
    fn leading(&self, master: &crate::server::RunningMaster, term: i64) {
        self.events.leading(master, term);
    }

    fn standing_by(&self, leader: Option<&str>) {
        self.leader.send_replace(leader.map(str::to_string));
        self.events.standing_by(leader);
    }
}

fn leader_name(leader: &Leader) -> String {
    leader
        .borrow()
        .clone()
        .unwrap_or_else(|| "unknown".to_string())
}

async fn health(State(leader): State<Leader>) -> String {
    format!("OK standby leader={}\n", leader_name(&leader))
}

async fn metrics() -> ([(axum::http::HeaderName, &'static str); 1], &'static str) {
    (
        [(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        "# HELP master_leading 1 while this master serves (it leads, or runs without HA), else 0.\n\
         # TYPE master_leading gauge\nmaster_leading 0\n",
    )
}

async fn segments(State(leader): State<Leader>) -> (StatusCode, String) {
    (
        StatusCode::SERVICE_UNAVAILABLE,
        format!(
            "this master stands by and holds no segments; ask the leader ({})\n",
            leader_name(&leader)
        ),
    )
}
