//! Every file in `config/` parses into its config type and validates.

use std::path::Path;

use mooncake_common::config::load_toml;

#[test]
fn every_example_config_parses_and_validates() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../config");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        match name.as_str() {
            "master.toml" => {
                let c: mooncake_master::MasterConfig = load_toml(&path).unwrap();
                c.validate().unwrap();
                assert_eq!(c.rpc_port, 50051);
            }
            "owner.toml" => {
                let c: mooncake_owner::OwnerConfig = load_toml(&path).unwrap();
                c.validate().unwrap();
                assert_eq!(c.segment_size.bytes(), 4 << 30);
            }
            "client.toml" => {
                let c: mooncake_client::ClientConfig = load_toml(&path).unwrap();
                c.validate().unwrap();
            }
            other => panic!("config/{other} has no parse test: add it here"),
        }
        seen += 1;
    }
    assert_eq!(seen, 3);
}

#[test]
fn a_typo_in_a_config_file_is_named() {
    let dir = std::env::temp_dir().join(format!("mc-cfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("bad.toml");
    std::fs::write(&path, "segment_sise = \"1GiB\"\n").unwrap();
    let err = load_toml::<mooncake_owner::OwnerConfig>(&path)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("segment_sise") && err.contains("bad.toml"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
