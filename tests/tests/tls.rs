//! TLS on the master's RPC port against real processes: a master with a certificate, a client
//! CA and the cluster's token; an owner that mounts over TLS with its client certificate; clients
//! on both protocols that put and read back byte for byte. A client without TLS, one without a
//! client certificate and one trusting another CA are refused within their deadline.

use std::{path::Path, time::Duration};

use mooncake_client::{Client, ClientConfig, MasterProtocol, PutOutcome, ReplicateConfig};
use mooncake_common::Code;
use mooncake_tests::{payload, spawn_master, spawn_owner, TempDir};

/// Runs openssl (Debian's; `.ci/run` installs it) in `dir`.
fn openssl(dir: &Path, args: &[&str]) {
    let out = std::process::Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("run openssl");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A certificate authority: `<name>.pem` and `<name>.key` in a directory.
struct Ca<'a> {
    dir: &'a Path,
    name: String,
}

impl<'a> Ca<'a> {
    fn new(dir: &'a Path, name: &str) -> Ca<'a> {
        let (pem, key, subj) = (
            format!("{name}.pem"),
            format!("{name}.key"),
            format!("/CN={name}"),
        );
        openssl(
            dir,
            &[
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-keyout",
                &key,
                "-out",
                &pem,
                "-days",
                "2",
                "-subj",
                &subj,
                "-addext",
                "basicConstraints=critical,CA:TRUE",
                "-addext",
                "keyUsage=critical,keyCertSign,cRLSign",
            ],
        );
        Ca {
            dir,
            name: name.to_string(),
        }
    }

    fn file(&self) -> String {
        self.dir
            .join(format!("{}.pem", self.name))
            .display()
            .to_string()
    }

    /// A certificate for `san` (openssl's subjectAltName syntax) signed by this CA: its PEM
    /// file and its key's.
    fn issue(&self, name: &str, san: &str) -> (String, String) {
        let (pem, key, csr, ext) = (
            format!("{name}.pem"),
            format!("{name}.key"),
            format!("{name}.csr"),
            format!("{name}.ext"),
        );
        std::fs::write(
            self.dir.join(&ext),
            format!(
                "subjectAltName={san}\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature\n\
                 extendedKeyUsage=serverAuth,clientAuth\n"
            ),
        )
        .unwrap();
        let subj = format!("/CN={name}");
        openssl(
            self.dir,
            &[
                "req",
                "-new",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-keyout",
                &key,
                "-out",
                &csr,
                "-subj",
                &subj,
            ],
        );
        let (ca_pem, ca_key) = (format!("{}.pem", self.name), format!("{}.key", self.name));
        openssl(
            self.dir,
            &[
                "x509",
                "-req",
                "-in",
                &csr,
                "-CA",
                &ca_pem,
                "-CAkey",
                &ca_key,
                "-CAcreateserial",
                "-out",
                &pem,
                "-days",
                "2",
                "-extfile",
                &ext,
            ],
        );
        let path = |f: &str| self.dir.join(f).display().to_string();
        (path(&pem), path(&key))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_works_end_to_end_and_refuses_peers_without_it() {
    let dir = TempDir::new("tls");
    let ca = Ca::new(dir.path(), "ca");
    let ca_file = ca.file();
    let (server_cert, server_key) = ca.issue("master", "IP:127.0.0.1,DNS:localhost");
    let (client_cert, client_key) = ca.issue("worker", "DNS:worker");
    let token = dir.path().join("token");
    std::fs::write(&token, "tls-and-a-token-0123456789abcdef\n").unwrap();
    let token = token.display().to_string();

    let (_master, rpc, _) = spawn_master(&[
        "--tls_cert",
        &server_cert,
        "--tls_key",
        &server_key,
        "--tls_ca",
        &ca_file,
        "--auth_token_file",
        &token,
    ]);
    // The owner mounts (gRPC) over TLS with its client certificate.
    let (_owner, _) = spawn_owner(
        &rpc,
        "32MiB",
        &[
            "--auth_token_file",
            &token,
            "--tls_ca",
            &ca_file,
            "--tls_cert",
            &client_cert,
            "--tls_key",
            &client_key,
        ],
    );

    let config = |tls: bool, cert: bool, protocol: MasterProtocol| ClientConfig {
        auth_token_file: Some(token.clone().into()),
        master_protocol: protocol,
        tls_ca: tls.then(|| ca_file.clone().into()),
        tls_cert: cert.then(|| client_cert.clone().into()),
        tls_key: cert.then(|| client_key.clone().into()),
        rpc_timeout: Duration::from_secs(3),
        connect_timeout: Duration::from_secs(3),
        ..ClientConfig::new(&rpc)
    };
    let rc = ReplicateConfig::default();
    for protocol in [MasterProtocol::Framed, MasterProtocol::Grpc] {
        let c = Client::connect(config(true, true, protocol)).await.unwrap();
        let keys: Vec<String> = (0..8).map(|i| format!("tls-{protocol:?}-{i}")).collect();
        for (i, k) in keys.iter().enumerate() {
            let v = payload(k, 1000 + i * 4096);
            assert!(matches!(c.put(k, &v, &rc).await, Ok(PutOutcome::Stored)));
        }
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        for (k, got) in keys.iter().zip(c.batch_get_owned(&refs).await) {
            let i = keys.iter().position(|x| x == k).unwrap();
            assert_eq!(got.unwrap(), payload(k, 1000 + i * 4096), "{k}");
        }

        // Refused: no TLS at all, TLS without the client certificate the master asks for.
        for (tls, cert) in [(false, false), (true, false)] {
            let started = std::time::Instant::now();
            let e = Client::connect(config(tls, cert, protocol))
                .await
                .err()
                .unwrap_or_else(|| panic!("{protocol:?} tls={tls} cert={cert} was let in"));
            assert!(
                matches!(e.code(), Code::RpcFail | Code::RpcTimeout),
                "{protocol:?} tls={tls} cert={cert}: {e}"
            );
            assert!(started.elapsed() < Duration::from_secs(10), "{e}");
        }
    }

    // A client trusting another CA does not accept the master's certificate.
    let other_file = Ca::new(dir.path(), "other").file();
    let e = Client::connect(ClientConfig {
        tls_ca: Some(other_file.into()),
        ..config(true, true, MasterProtocol::Framed)
    })
    .await
    .err()
    .unwrap();
    assert!(e.to_string().contains("TLS"), "{e}");
}
