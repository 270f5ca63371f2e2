//! `mooncake_master`: flags (Mooncake's names) over an optional TOML file, then serve until
//! Ctrl-C or SIGTERM.

use std::{path::PathBuf, time::Duration};

use anyhow::Context;
use clap::Parser;
use mooncake_common::config::{load_toml, parse_duration_in};
use mooncake_master::{core::AllocationStrategy, MasterConfig, RunningMaster};

#[derive(Parser, Debug)]
#[command(
    name = "mooncake_master",
    version,
    about = "Metadata master of the KV object store"
)]
struct Args {
    /// TOML config file; flags given on the command line override its values.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Address to bind the RPC and metrics listeners to.
    #[arg(long = "rpc_address", alias = "rpc-address")]
    rpc_address: Option<String>,
    #[arg(long = "rpc_port", alias = "rpc-port")]
    rpc_port: Option<u16>,
    #[arg(long = "metrics_port", alias = "metrics-port")]
    metrics_port: Option<u16>,
    /// Read lease: milliseconds, or a duration such as "10s".
    #[arg(long = "default_kv_lease_ttl", value_parser = ms)]
    default_kv_lease_ttl: Option<Duration>,
    /// Soft-pin protection: milliseconds (as Mooncake reads it), or a duration such as "30m".
    #[arg(long = "default_kv_soft_pin_ttl", value_parser = ms)]
    soft_pin_ttl: Option<Duration>,
    #[arg(long = "eviction_high_watermark_ratio")]
    eviction_high_watermark_ratio: Option<f64>,
    #[arg(long = "eviction_ratio")]
    eviction_ratio: Option<f64>,
    /// Owner liveness TTL: seconds, or a duration.
    #[arg(long = "client_ttl", value_parser = secs)]
    client_ttl: Option<Duration>,
    #[arg(long = "put_start_discard_timeout_sec", value_parser = secs)]
    put_start_discard_timeout: Option<Duration>,
    #[arg(long = "put_start_release_timeout_sec", value_parser = secs)]
    put_start_release_timeout: Option<Duration>,
    /// "random" or "free_ratio_first".
    #[arg(long = "allocation_strategy")]
    allocation_strategy: Option<AllocationStrategy>,
    /// Offload objects to their owner's SSD tier when their put ends (not only on eviction).
    #[arg(long = "eager_offload", alias = "eager-offload", num_args = 0..=1,
        default_missing_value = "true", action = clap::ArgAction::Set)]
    eager_offload: Option<bool>,
    /// Which objects eviction takes first: "car" (adaptive recency/frequency) or "lru".
    #[arg(long = "eviction_policy", alias = "eviction-policy")]
    eviction_policy: Option<mooncake_master::core::EvictionPolicy>,
    /// What ends a read lease: "reads" (its readers being done) or "ttl" (the TTL alone).
    #[arg(long = "lease_mode", alias = "lease-mode")]
    lease_mode: Option<mooncake_master::core::LeaseMode>,
    /// When an owner's SSD is behind, eviction "keep"s objects in memory or "drop"s them.
    #[arg(long = "when_disk_behind", alias = "when-disk-behind")]
    when_disk_behind: Option<mooncake_master::core::WhenDiskBehind>,
    /// Disk reads after which an object is copied back to memory; 0: never.
    #[arg(long = "promote_after_hits", alias = "promote-after-hits")]
    promote_after_hits: Option<u32>,
    /// After a restart, unknown keys answer a retryable code for this long (seconds) while
    /// owners remount and report what they hold; 0: never.
    #[arg(long = "rebuild_grace_sec", value_parser = secs)]
    rebuild_grace: Option<Duration>,
    /// The longest that goes on while owners are still reporting (seconds).
    #[arg(long = "rebuild_window_sec", value_parser = secs)]
    rebuild_window: Option<Duration>,
    /// Campaign for leadership in etcd (with --etcd_endpoints); standbys take over on failure.
    /// `--enable_ha` alone, or with a value as Mooncake writes it (`--enable_ha=true`).
    #[arg(long = "enable_ha", alias = "enable-ha", num_args = 0..=1,
        default_missing_value = "true", action = clap::ArgAction::Set)]
    enable_ha: Option<bool>,
    /// etcd endpoints, "host:port;host:port".
    #[arg(long = "etcd_endpoints", alias = "etcd-endpoints")]
    etcd_endpoints: Option<String>,
    /// The cluster's name in etcd (masters, owners and clients of one cluster share it).
    #[arg(long = "cluster_id", alias = "cluster-id")]
    cluster_id: Option<String>,
    /// The leader's etcd lease, in seconds (or a duration such as "5s").
    #[arg(long = "ha_lease_ttl", value_parser = secs)]
    ha_lease_ttl: Option<Duration>,
    /// The address published to clients and owners when this master leads.
    #[arg(long = "advertise_address", alias = "advertise-address")]
    advertise_address: Option<String>,
    /// A file holding the cluster's secret: every RPC connection must prove it holds it.
    #[arg(long = "auth_token_file", alias = "auth-token-file")]
    auth_token_file: Option<std::path::PathBuf>,
    /// TLS on the RPC port: the master's certificate chain (PEM); needs --tls_key.
    #[arg(long = "tls_cert")]
    tls_cert: Option<std::path::PathBuf>,
    /// The private key of --tls_cert (PEM).
    #[arg(long = "tls_key")]
    tls_key: Option<std::path::PathBuf>,
    /// With TLS, a CA (PEM) every peer's client certificate must chain to.
    #[arg(long = "tls_ca")]
    tls_ca: Option<std::path::PathBuf>,
    /// Print tenant NAME's token (derived from the cluster's secret in --auth_token_file) and
    /// exit: write it to the file a `[[tenants]]` entry names as its token_file, and hand that
    /// file to the tenant's workers.
    #[arg(long = "print_tenant_token", value_name = "NAME")]
    print_tenant_token: Option<String>,
}

fn ms(s: &str) -> Result<Duration, String> {
    parse_duration_in(s, Duration::from_millis(1))
}

fn secs(s: &str) -> Result<Duration, String> {
    parse_duration_in(s, Duration::from_secs(1))
}

fn config(args: Args) -> anyhow::Result<MasterConfig> {
    let mut c: MasterConfig = match &args.config {
        Some(path) => load_toml(path)?,
        None => MasterConfig::default(),
    };
    macro_rules! set {
        ($($field:ident <- $arg:expr),* $(,)?) => { $(if let Some(v) = $arg { c.$field = v; })* };
    }
    set!(
        bind_address <- args.rpc_address,
        rpc_port <- args.rpc_port,
        metrics_port <- args.metrics_port,
        default_kv_lease_ttl <- args.default_kv_lease_ttl,
        soft_pin_ttl <- args.soft_pin_ttl,
        eviction_high_watermark_ratio <- args.eviction_high_watermark_ratio,
        eviction_ratio <- args.eviction_ratio,
        client_ttl <- args.client_ttl,
        put_start_discard_timeout <- args.put_start_discard_timeout,
        put_start_release_timeout <- args.put_start_release_timeout,
        allocation_strategy <- args.allocation_strategy,
        when_disk_behind <- args.when_disk_behind,
        lease_mode <- args.lease_mode,
        eviction_policy <- args.eviction_policy,
        promote_after_hits <- args.promote_after_hits,
        rebuild_grace <- args.rebuild_grace,
        rebuild_window <- args.rebuild_window,
        etcd_endpoints <- args.etcd_endpoints,
        cluster_id <- args.cluster_id,
        ha_lease_ttl <- args.ha_lease_ttl,
        advertise_address <- args.advertise_address,
        eager_offload <- args.eager_offload,
        enable_ha <- args.enable_ha,
    );
    if args.auth_token_file.is_some() {
        c.auth_token_file = args.auth_token_file;
    }
    for (field, arg) in [
        (&mut c.tls_cert, args.tls_cert),
        (&mut c.tls_key, args.tls_key),
        (&mut c.tls_ca, args.tls_ca),
    ] {
        if arg.is_some() {
            *field = arg;
        }
    }
    c.validate()
        .map_err(|e| anyhow::anyhow!("invalid configuration: {e}"))?;
    Ok(c)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let args = Args::parse();
    if let Some(name) = &args.print_tenant_token {
        let tenant =
            mooncake_common::tenant::Tenant::parse(name).map_err(|e| anyhow::anyhow!(e))?;
        anyhow::ensure!(
            !tenant.is_default(),
            "the default tenant's workers use the cluster's token itself"
        );
        let path = args
            .auth_token_file
            .as_deref()
            .context("--print_tenant_token needs --auth_token_file (the cluster's token)")?;
        let secret = mooncake_common::auth::read_secret(path).map_err(|e| anyhow::anyhow!(e))?;
        println!(
            "{}",
            mooncake_common::auth::tenant_token(&secret, tenant.name())
        );
        return Ok(());
    }
    let config = config(args)?;
    if config.enable_ha {
        let ha = config.ha().map_err(|e| anyhow::anyhow!(e))?;
        println!(
            "mooncake_master standby cluster={} etcd={}",
            ha.cluster_id,
            ha.endpoints.join(";")
        );
        return mooncake_master::ha::run(config, ha, &Announce, shutdown_signal()).await;
    }
    let master = RunningMaster::start(config)
        .await
        .context("cannot start the master")?;
    println!(
        "mooncake_master ready rpc={} http={}",
        master.rpc_addr, master.http_addr
    );
    master.run_until(shutdown_signal()).await;
    Ok(())
}

/// Prints each change of role on stdout (scripts and tests wait for these lines).
struct Announce;

impl mooncake_master::ha::Events for Announce {
    fn leading(&self, master: &RunningMaster, term: i64) {
        println!(
            "mooncake_master ready rpc={} http={} term={term}",
            master.rpc_addr, master.http_addr
        );
    }

    fn standing_by(&self, leader: Option<&str>) {
        println!(
            "mooncake_master standby leader={}",
            leader.unwrap_or("unknown")
        );
    }
}

async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("install SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    tracing::info!("shutting down");
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Mooncake's own launch lines parse, with its units.
    #[test]
    fn mooncakes_flags_parse_as_mooncake_writes_them() {
        let args = Args::try_parse_from([
            "mooncake_master",
            "--enable_ha=true",
            "--etcd_endpoints=127.0.0.1:2379",
            "--default_kv_soft_pin_ttl=1800000",
            "--default_kv_lease_ttl=5000",
            "--eager_offload",
        ])
        .unwrap();
        assert_eq!(
            (args.enable_ha, args.eager_offload),
            (Some(true), Some(true))
        );
        assert_eq!(args.soft_pin_ttl, Some(Duration::from_secs(30 * 60)));
        assert_eq!(args.default_kv_lease_ttl, Some(Duration::from_secs(5)));
        let off = Args::try_parse_from(["mooncake_master", "--enable_ha=false"]).unwrap();
        assert_eq!((off.enable_ha, off.eager_offload), (Some(false), None));
        let bare = Args::try_parse_from(["mooncake_master", "--enable_ha"]).unwrap();
        assert_eq!(bare.enable_ha, Some(true));
    }

    /// A flag given on the command line overrides the config file's value, `false` too: before,
    /// `--enable_ha=false` and `--eager_offload=false` left a file's `true` in place.
    #[test]
    fn a_false_flag_overrides_the_config_files_true() {
        let dir = std::env::temp_dir().join(format!("mc-master-flags-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("master.toml");
        std::fs::write(
            &file,
            "enable_ha = true\neager_offload = true\netcd_endpoints = \"127.0.0.1:2379\"\nadvertise_address = \"127.0.0.1:50051\"\n",
        )
        .unwrap();
        let path = file.to_str().unwrap();
        let from_file =
            config(Args::try_parse_from(["mooncake_master", "--config", path]).unwrap()).unwrap();
        assert!(from_file.enable_ha && from_file.eager_offload);
        let args = Args::try_parse_from([
            "mooncake_master",
            "--config",
            path,
            "--enable_ha=false",
            "--eager_offload=false",
        ])
        .unwrap();
        let c = config(args).unwrap();
        assert!(!c.enable_ha && !c.eager_offload);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
