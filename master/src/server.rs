//! Runs a master: binds the gRPC and HTTP listeners, starts the upkeep loop, and stops all of it
//! when asked. Binaries, tests and the bench start masters through here.

use std::{future::Future, net::SocketAddr, sync::Arc};

use mooncake_common::{
    auth::{admit, starts_with_hello, Admission, Keyring, ServerAuth, AUTH_REQUIRED, HELLO_MAGIC},
    tls::TlsAcceptor,
};
use mooncake_proto::master::master_server::MasterServer;
use tokio::{
    net::{TcpListener, TcpStream},
    sync::watch,
    task::JoinHandle,
};

use crate::{
    clock::{Clock, SystemClock},
    config::MasterConfig,
    core::MasterState,
    ha::Leadership,
    service::{Caller, MasterService, Shared},
    wire::{
        admitted::{Admitted, Expiring, Identity, Io, Prefixed, Rpc},
        grpc::GrpcMaster,
        in_process::InProcessMaster,
    },
};

/// Why a master that lost (or never had) its etcd lease refuses a call.
pub use mooncake_common::leader::NOT_LEADING;

/// What one leadership term starts with. The default is a master without HA.
pub struct Term {
    pub leadership: Arc<Leadership>,
    /// Put ids start at or above this (what the previous leader reserved).
    pub grant_floor: u64,
    /// Put ids stay below this until the term reserves more.
    pub grant_ceiling: u64,
    /// Segments the previous leader had mounted: the rebuild waits for their reports.
    pub expected_segments: Vec<mooncake_common::SegmentName>,
}

impl Default for Term {
    fn default() -> Self {
        Term {
            leadership: Arc::new(Leadership::always()),
            grant_floor: 0,
            grant_ceiling: u64::MAX,
            expected_segments: Vec::new(),
        }
    }
}

/// A master running on the current tokio runtime.
pub struct RunningMaster {
    pub rpc_addr: SocketAddr,
    pub http_addr: SocketAddr,
    service: Arc<MasterService>,
    shared: Arc<Shared>,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

impl RunningMaster {
    /// Binds the configured ports (0 picks free ones) and starts serving with the system clock.
    pub async fn start(config: MasterConfig) -> std::io::Result<RunningMaster> {
        Self::start_with_clock(config, Arc::new(SystemClock::new())).await
    }

    pub async fn start_with_clock(
        config: MasterConfig,
        clock: Arc<dyn Clock>,
    ) -> std::io::Result<RunningMaster> {
        Self::start_term(config, clock, Term::default()).await
    }

    /// Checks what a term's start would, without serving: the config, the token and TLS files,
    /// and that the configured ports can be bound. A master that campaigns (HA) checks first,
    /// so a bad file or a busy port ends the process instead of every term it wins.
    pub async fn check_can_serve(config: &MasterConfig) -> std::io::Result<()> {
        let invalid = |e: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, e);
        config.validate().map_err(invalid)?;
        if let Some(path) = &config.auth_token_file {
            server_auth(path, &config.tenants).map_err(invalid)?;
        }
        config.tls().map_err(invalid)?;
        for port in [config.rpc_port, config.metrics_port] {
            if port != 0 {
                drop(bind(&config.bind_address, port).await?);
            }
        }
        Ok(())
    }

    /// Starts serving one leadership term (see `ha`): answers only while `term.leadership`
    /// holds, and issues put ids from `term.grant_floor` up to `term.grant_ceiling`.
    pub async fn start_term(
        config: MasterConfig,
        clock: Arc<dyn Clock>,
        term: Term,
    ) -> std::io::Result<RunningMaster> {
        config
            .validate()
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        let rpc = bind(&config.bind_address, config.rpc_port).await?;
        let http = bind(&config.bind_address, config.metrics_port).await?;
        let (rpc_addr, http_addr) = (rpc.local_addr()?, http.local_addr()?);
        let mut state = MasterState::new(config.policy());
        state.raise_grants(wall_clock_micros().max(term.grant_floor));
        state.reserve_grants(term.grant_ceiling);
        // Owners of an earlier master process remount and report what they hold.
        state.started(clock.now());
        state.expect_segments(term.expected_segments, clock.now());
        let shared = Arc::new(Shared::new(state, clock, term.leadership));
        let (stop, stopped) = watch::channel(false);
        let mut tasks = Vec::new();

        let auth = match &config.auth_token_file {
            Some(path) => Some(
                server_auth(path, &config.tenants)
                    .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?,
            ),
            None => {
                tracing::warn!(
                    "the master runs open: no auth_token_file, so any peer that reaches the RPC \
                     port may use it"
                );
                None
            }
        };
        let tls = config
            .tls()
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        let service = Arc::new(MasterService::new(
            shared.clone(),
            auth.as_ref().map(|a| a.seals.clone()),
        ));
        let grpc = GrpcMaster(service.clone());
        let leader = service.clone();
        let still_leading = service.clone();
        let answering = crate::wire::leading::AnswerWhileLeading::new(
            MasterServer::new(grpc.clone())
                .max_decoding_message_size(crate::wire::grpc::MAX_MESSAGE)
                .max_encoding_message_size(crate::wire::grpc::MAX_MESSAGE),
            Arc::new(move || still_leading.leading()),
        );
        let svc = tonic::service::interceptor::InterceptedService::new(
            answering,
            move |mut req: tonic::Request<()>| {
                if !leader.leading() {
                    return Err(tonic::Status::unavailable(NOT_LEADING));
                }
                let caller = caller_of_grpc(&req)?;
                req.extensions_mut().insert(caller);
                Ok(req)
            },
        );
        // gRPC connections that did not authenticate where the master requires it: every call
        // is answered UNAUTHENTICATED.
        let refusing = tonic::service::interceptor::InterceptedService::new(
            MasterServer::new(grpc.clone()),
            |_: tonic::Request<()>| {
                Err::<tonic::Request<()>, _>(tonic::Status::unauthenticated(AUTH_REQUIRED))
            },
        );
        // One port, two protocols: framed-RPC connections are served here, the rest go to tonic.
        let (grpc_tx, grpc_rx) = tokio::sync::mpsc::channel::<Rpc>(64);
        let (refused_tx, refused_rx) = tokio::sync::mpsc::channel::<Rpc>(64);
        tasks.push(tokio::spawn(split_connections(
            rpc,
            Routes {
                grpc: grpc_tx,
                refused: refused_tx,
                service: grpc,
                keyring: auth.map(|a| Arc::new(a.keyring)),
                tls,
            },
            stopped.clone(),
        )));
        let stop_rpc = wait_stop(stopped.clone());
        tasks.push(tokio::spawn(async move {
            if let Err(e) = grpc_server()
                .add_service(svc)
                .serve_with_incoming_shutdown(incoming(grpc_rx), stop_rpc)
                .await
            {
                tracing::error!(error = %e, "gRPC server failed");
            }
        }));
        let stop_refusing = wait_stop(stopped.clone());
        tasks.push(tokio::spawn(async move {
            if let Err(e) = grpc_server()
                .add_service(refusing)
                .serve_with_incoming_shutdown(incoming(refused_rx), stop_refusing)
                .await
            {
                tracing::error!(error = %e, "gRPC refusal server failed");
            }
        }));

        let router = crate::http::router(shared.clone());
        let stop_http = wait_stop(stopped.clone());
        tasks.push(tokio::spawn(async move {
            if let Err(e) = axum::serve(http, router)
                .with_graceful_shutdown(stop_http)
                .await
            {
                tracing::error!(error = %e, "HTTP server failed");
            }
        }));

        let upkeep_shared = shared.clone();
        let interval = config.upkeep_interval;
        let mut stop_upkeep = stopped;
        tasks.push(tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = tick.tick() => {
                        let now = upkeep_shared.clock.now();
                        let mut state = upkeep_shared.state.lock();
                        state.tick(now);
                        upkeep_shared.wake_owners(&mut state);
                    }
                    _ = stop_upkeep.changed() => break,
                }
            }
        }));

        tracing::info!(%rpc_addr, %http_addr, "master serving");
        Ok(RunningMaster {
            rpc_addr,
            http_addr,
            service,
            shared,
            stop,
            tasks,
        })
    }

    /// Runs one upkeep round now (tests drive a manual clock and then call this).
    pub fn upkeep(&self) {
        let now = self.shared.clock.now();
        let mut state = self.shared.state.lock();
        state.tick(now);
        self.shared.wake_owners(&mut state);
    }

    /// A `MasterApi` that calls this master's service directly (no socket), for clients in
    /// the same process (of the default tenant, with the cluster's rights).
    pub fn in_process(&self) -> InProcessMaster {
        InProcessMaster(self.service.clone(), crate::service::Caller::cluster())
    }

    /// Runs `f` on the state under its lock (the HA loop raises the grant reservation).
    pub fn with_state_mut<R>(&self, f: impl FnOnce(&mut MasterState) -> R) -> R {
        f(&mut self.shared.state.lock())
    }

    /// Read access to the state, for tests and tools in the same process.
    pub fn with_state<R>(&self, f: impl FnOnce(&MasterState) -> R) -> R {
        f(&self.shared.state.lock())
    }

    /// Stops serving and waits for every task to end, at most `SHUTDOWN_GRACE` in all: a peer
    /// that never closes its connection (silent mid-handshake, or paused) would keep a graceful
    /// server waiting forever, so what is left then is stopped.
    pub async fn shutdown(self) {
        self.shared.stop_polls();
        let _ = self.stop.send(true);
        let deadline = tokio::time::Instant::now() + SHUTDOWN_GRACE;
        for t in self.tasks {
            let abort = t.abort_handle();
            if tokio::time::timeout_at(deadline, t).await.is_err() {
                tracing::warn!(grace = ?SHUTDOWN_GRACE, "a server task did not stop in time (a peer kept its connection open); stopping it");
                abort.abort();
            }
        }
    }

    /// Runs until `signal` completes, then shuts down.
    pub async fn run_until(self, signal: impl Future<Output = ()>) {
        signal.await;
        self.shutdown().await;
    }
}

/// A gRPC server that pings its peers: one that stopped answering (paused, or its host gone)
/// loses its connection instead of holding it forever.
fn grpc_server() -> tonic::transport::Server {
    tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(std::time::Duration::from_secs(10)))
        .http2_keepalive_timeout(Some(std::time::Duration::from_secs(20)))
}

/// How long a shutdown waits for connections to close (long polls answer at once; a peer that
/// does not read its answer holds its connection).
const SHUTDOWN_GRACE: std::time::Duration = std::time::Duration::from_secs(6);

/// The cluster's secret, and the tenants whose own token files the master admits.
fn server_auth(
    path: &std::path::Path,
    tenants: &[crate::config::TenantConfig],
) -> Result<ServerAuth, String> {
    let mut auth = ServerAuth::from_file(path)?;
    let secret = auth.secret().to_vec();
    for t in tenants {
        if let Some(file) = &t.token_file {
            auth.keyring.insert_tenant(&secret, &t.name, file)?;
        }
    }
    Ok(auth)
}

/// Where accepted RPC connections go.
struct Routes {
    /// Authenticated (or open) gRPC connections.
    grpc: tokio::sync::mpsc::Sender<Rpc>,
    /// gRPC connections that did not authenticate.
    refused: tokio::sync::mpsc::Sender<Rpc>,
    service: GrpcMaster,
    keyring: Option<Arc<Keyring>>,
    /// With TLS configured, every connection starts with a TLS handshake.
    tls: Option<TlsAcceptor>,
}

/// How long a connection may take to authenticate and to show which protocol it speaks.
const OPENING_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
/// How long a gRPC connection that did not authenticate (where the master requires it) is
/// served its refusals before it is closed.
const REFUSED_FOR: std::time::Duration = std::time::Duration::from_secs(5);

/// Accepts RPC connections, admits each (see `mooncake_common::auth`) and routes it by its
/// first bytes: the framed RPC is served here, anything else (HTTP/2) goes to the gRPC server.
async fn split_connections(listener: TcpListener, routes: Routes, mut stop: watch::Receiver<bool>) {
    let routes = Arc::new(routes);
    loop {
        let (stream, _) = tokio::select! {
            r = listener.accept() => match r {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = stop.changed() => return,
        };
        let _ = stream.set_nodelay(true);
        // A client waits between calls without a deadline: one whose host died keeps its
        // connection (a task, its buffers) only until keepalive ends it.
        if let Err(e) = mooncake_common::data_socket::keepalive(&stream) {
            tracing::debug!(error = %e, "RPC connection without keepalive");
        }
        let (routes, stop) = (routes.clone(), stop.clone());
        tokio::spawn(async move {
            if let Err(e) = route(stream, &routes, stop).await {
                tracing::debug!(error = %e, "RPC connection closed");
            }
        });
    }
}

async fn route(
    stream: TcpStream,
    routes: &Routes,
    stop: watch::Receiver<bool>,
) -> std::io::Result<()> {
    let peer = stream
        .peer_addr()
        .map_or_else(|_| "an unknown peer".to_string(), |a| a.to_string());
    match &routes.tls {
        None => serve_rpc(Box::new(stream), peer, routes, stop).await,
        Some(acceptor) => {
            let tls = tokio::time::timeout(OPENING_TIMEOUT, acceptor.accept(stream))
                .await
                .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))?
                .inspect_err(|e| tracing::warn!(%peer, error = %e, "refused a peer's TLS"))?;
            serve_rpc(Box::new(tls), peer, routes, stop).await
        }
    }
}

/// Admits a connection (see `mooncake_common::auth`) and serves it by its first bytes: the
/// framed RPC here, anything else (HTTP/2) by the gRPC server.
async fn serve_rpc(
    stream: Box<dyn Io>,
    peer: String,
    routes: &Routes,
    stop: watch::Receiver<bool>,
) -> std::io::Result<()> {
    let mut stream = Prefixed::new(stream);
    let opening = async {
        let first = stream
            .look(HELLO_MAGIC.len(), |b| starts_with_hello(b).is_some())
            .await?;
        let hello = starts_with_hello(first) == Some(true);
        let admitted = admit(
            &mut stream,
            hello,
            routes.keyring.as_deref(),
            &peer,
            OPENING_TIMEOUT,
        )
        .await?;
        let magic = &mooncake_proto::framed::MAGIC;
        let first = stream.look(4, |b| !magic.starts_with(b)).await?;
        if first.is_empty() {
            return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof));
        }
        Ok::<_, std::io::Error>((admitted, crate::wire::framed::is_framed(first)))
    };
    let (admitted, framed) = tokio::time::timeout(OPENING_TIMEOUT, opening)
        .await
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))??;
    let allowed = admitted != Admission::Unauthenticated;
    let identity = match admitted {
        Admission::Authenticated(id) => Some(id),
        _ => None,
    };
    match (framed, allowed) {
        (true, true) => {
            crate::wire::framed::serve(
                stream,
                routes.service.clone(),
                identity,
                std::time::Duration::from_secs(30),
                stop,
            )
            .await
        }
        (true, false) => crate::wire::framed::refuse(stream, OPENING_TIMEOUT).await,
        (false, true) => {
            let identity = Identity(identity.map(Into::into));
            let stream: Box<dyn Io> = Box::new(stream);
            let _ = routes.grpc.send(Admitted { stream, identity }).await;
            Ok(())
        }
        (false, false) => {
            let identity = Identity(None);
            // Answered UNAUTHENTICATED, call after call: closed after a while, so that
            // connections nothing will ever let in do not pile up (file descriptors, tasks).
            let stream: Box<dyn Io> = Box::new(Expiring::new(stream, REFUSED_FOR));
            let _ = routes.refused.send(Admitted { stream, identity }).await;
            Ok(())
        }
    }
}

/// The caller of a gRPC request: the identity its connection proved, acting as the tenant the
/// request's metadata names (if any).
fn caller_of_grpc(req: &tonic::Request<()>) -> Result<Caller, tonic::Status> {
    let identity = req
        .extensions()
        .get::<Identity>()
        .ok_or_else(|| tonic::Status::internal("the connection carries no identity"))?;
    let declared = match req.metadata().get(mooncake_common::tenant::GRPC_HEADER) {
        Some(v) => Some(v.to_str().map_err(|_| {
            tonic::Status::invalid_argument("the tenant metadata is not a valid name")
        })?),
        None => None,
    };
    Caller::resolve(identity.0.as_deref(), declared).map_err(|e| match e.code() {
        mooncake_common::Code::PermissionDenied => tonic::Status::permission_denied(e.to_string()),
        _ => tonic::Status::invalid_argument(e.to_string()),
    })
}

/// A channel of accepted connections as the stream tonic serves.
fn incoming(
    rx: tokio::sync::mpsc::Receiver<Rpc>,
) -> impl futures::Stream<Item = std::io::Result<Rpc>> {
    futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|s| (Ok::<_, std::io::Error>(s), rx))
    })
}

async fn bind(host: &str, port: u16) -> std::io::Result<TcpListener> {
    TcpListener::bind((host, port))
        .await
        .map_err(|e| std::io::Error::new(e.kind(), format!("cannot bind {host}:{port}: {e}")))
}

async fn wait_stop(mut rx: watch::Receiver<bool>) {
    while !*rx.borrow() {
        if rx.changed().await.is_err() {
            return;
        }
    }
}

/// Microseconds since the Unix epoch: the floor of this process's put ids.
pub(crate) fn wall_clock_micros() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_micros() as u64)
}
