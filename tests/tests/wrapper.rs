//! `scripts/mooncake_owner`: starts the owner, exports MOONCAKE_PREFERRED_SEGMENT to the command
//! (unless already set), stops the owner when the command ends, on Ctrl-C, or when the wrapper
//! is killed outright, and returns the command's exit code.

use std::{
    path::PathBuf,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use mooncake_tests::{bin_path, master_config, ChildGuard};

fn wrapper(master: &str, cmd: &[&str]) -> Command {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/mooncake_owner");
    let mut c = Command::new(script);
    c.env("MOONCAKE_OWNERD", bin_path("mooncake_ownerd"))
        .env_remove("MOONCAKE_PREFERRED_SEGMENT")
        .args([
            "--master",
            master,
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--segment-size",
            "8MiB",
            "--no-mlock",
            "--heartbeat-interval",
            "200ms",
            "--",
        ])
        .args(cmd);
    c
}

/// The wrapper's exit status, waited for up to `secs` (None: it had not ended).
async fn exit_within(mut w: ChildGuard, secs: u64) -> Option<std::process::ExitStatus> {
    tokio::task::spawn_blocking(move || w.wait_exit(Duration::from_secs(secs)))
        .await
        .unwrap()
}

/// Whether `master` has no segment mounted within `secs`.
async fn unmounted_within(master: &mooncake_master::RunningMaster, secs: u64) -> bool {
    mooncake_tests::eventually(Duration::from_secs(secs), async || {
        master.with_state(|s| s.segment_stats().len()) == 0
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exports_the_segment_returns_the_exit_code_and_stops_the_owner() {
    let master = mooncake_master::RunningMaster::start(master_config())
        .await
        .unwrap();
    let addr = master.rpc_addr.to_string();
    let out = tokio::task::spawn_blocking(move || {
        wrapper(
            &addr,
            &["sh", "-c", "echo SEG=$MOONCAKE_PREFERRED_SEGMENT; exit 7"],
        )
        .output()
        .unwrap()
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(7),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let seg = stdout
        .trim()
        .strip_prefix("SEG=127.0.0.1:")
        .expect("segment exported");
    assert!(seg.parse::<u16>().unwrap() > 0);
    // The owner unmounted when it was stopped.
    assert_eq!(master.with_state(|s| s.segment_stats().len()), 0);

    // An explicit setting is left alone.
    let addr = master.rpc_addr.to_string();
    let out = tokio::task::spawn_blocking(move || {
        wrapper(&addr, &["sh", "-c", "echo SEG=$MOONCAKE_PREFERRED_SEGMENT"])
            .env("MOONCAKE_PREFERRED_SEGMENT", "10.1.2.3:4444")
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "SEG=10.1.2.3:4444"
    );
    master.shutdown().await;
}

/// A set-but-empty MOONCAKE_PREFERRED_SEGMENT is unset (as the client reads it): the owner's
/// segment is exported. And a `setpriv` without `--pdeathsig` (util-linux before 2.33,
/// busybox) does not keep the owner from starting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_preferred_segment_and_an_old_setpriv_are_handled() {
    let master = mooncake_master::RunningMaster::start(master_config())
        .await
        .unwrap();
    let shims = mooncake_tests::TempDir::new("old-setpriv");
    let shim = shims.path().join("setpriv");
    std::fs::write(
        &shim,
        "#!/bin/sh\necho \"setpriv: unrecognized option '--pdeathsig'\" >&2\nexit 1\n",
    )
    .unwrap();
    std::fs::set_permissions(&shim, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let path = format!(
        "{}:{}",
        shims.path().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let addr = master.rpc_addr.to_string();
    let out = tokio::task::spawn_blocking(move || {
        wrapper(&addr, &["sh", "-c", "echo SEG=$MOONCAKE_PREFERRED_SEGMENT"])
            .env("MOONCAKE_PREFERRED_SEGMENT", "")
            .env("PATH", path)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.trim().starts_with("SEG=127.0.0.1:"), "{stdout:?}");
    master.shutdown().await;
}

/// On a terminal the command owns it: one that reads from it is not stopped (SIGTTIN) with the
/// wrapper spinning beside it. Run under `script`, which gives it a pseudo-terminal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_on_a_terminal_may_read_from_it() {
    let master = mooncake_master::RunningMaster::start(master_config())
        .await
        .unwrap();
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/mooncake_owner");
    let line = format!(
        "MOONCAKE_OWNERD={} {} --master {} --host 127.0.0.1 --port 0 --segment-size 8MiB \
         --no-mlock -- bash -c 'read -t 2 x; exit 7' 2>/dev/null",
        bin_path("mooncake_ownerd").display(),
        script.display(),
        master.rpc_addr
    );
    let t = Instant::now();
    let mut cmd = Command::new("script");
    cmd.args(["-qec", &line, "/dev/null"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let w = ChildGuard::spawn_interruptible(&mut cmd);
    let status = exit_within(w, 30)
        .await
        .expect("the wrapper did not end: its command was stopped");
    assert_eq!(status.code(), Some(7), "the command's own exit code");
    assert!(t.elapsed() < Duration::from_secs(25));
    master.shutdown().await;
}

/// On a terminal too, a SIGTERM to the wrapper (a `docker stop` of `docker run -it`) reaches
/// the command at once, and the owner stops after it. Before, the shell held the signal until
/// the command ended by itself, so the command never heard of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigterm_reaches_a_command_on_a_terminal() {
    let master = mooncake_master::RunningMaster::start(master_config())
        .await
        .unwrap();
    let dir = mooncake_tests::TempDir::new("wrapper-tty");
    let pid_file = dir.path().join("wrapper.pid");
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/mooncake_owner");
    // The command's parent is the wrapper (env execs the command).
    let line = format!(
        "MOONCAKE_OWNERD={} {} --master {} --host 127.0.0.1 --port 0 --segment-size 8MiB \
         --no-mlock --heartbeat-interval 200ms -- bash -c 'trap \"exit 5\" TERM; \
         echo $PPID > {}; while :; do sleep 0.05; done' 2>/dev/null",
        bin_path("mooncake_ownerd").display(),
        script.display(),
        master.rpc_addr,
        pid_file.display(),
    );
    let mut cmd = Command::new("script");
    cmd.args(["-qec", &line, "/dev/null"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let w = ChildGuard::spawn_interruptible(&mut cmd);
    let started = mooncake_tests::eventually(Duration::from_secs(20), async || {
        std::fs::read_to_string(&pid_file).is_ok_and(|p| p.trim().parse::<i32>().is_ok())
    })
    .await;
    assert!(started, "the command never started");
    let wrapper_pid: i32 = std::fs::read_to_string(&pid_file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    // SAFETY: a plain kill(2) of the wrapper this test started (its command named it).
    assert_eq!(unsafe { libc::kill(wrapper_pid, libc::SIGTERM) }, 0);
    let status = exit_within(w, 15)
        .await
        .expect("the wrapper did not end: its command never got the SIGTERM");
    assert_eq!(status.code(), Some(5), "the command's own status");
    assert!(
        unmounted_within(&master, 10).await,
        "the owner is still mounted"
    );
    master.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctrl_c_stops_the_command_and_the_owner() {
    let master = mooncake_master::RunningMaster::start(master_config())
        .await
        .unwrap();
    let mut cmd = wrapper(&master.rpc_addr.to_string(), &["sleep", "30"]);
    cmd.stderr(Stdio::null());
    let w = ChildGuard::spawn_interruptible(&mut cmd);
    let mounted = mooncake_tests::eventually(Duration::from_secs(20), async || {
        master.with_state(|s| s.segment_stats().len()) == 1
    })
    .await;
    assert!(mounted, "the owner never mounted");
    tokio::time::sleep(Duration::from_millis(200)).await; // let the wrapper start the command
    let t = Instant::now();
    w.signal(libc::SIGINT);
    let status = exit_within(w, 15)
        .await
        .expect("wrapper did not exit after Ctrl-C");
    assert_eq!(
        status.code(),
        Some(130),
        "sleep killed by SIGINT gives 128+2"
    );
    assert!(t.elapsed() < Duration::from_secs(10));
    assert_eq!(
        master.with_state(|s| s.segment_stats().len()),
        0,
        "owner still mounted"
    );
    master.shutdown().await;
}

/// A SIGTERM to the wrapper goes to the command, and the wrapper returns the command's own
/// status: here 0, from a command that ends cleanly on TERM. (The wait the signal cuts short
/// answers 143; had the command ended by the time the wrapper looked, the wrapper returned that
/// instead. That race did not show on this machine; the wrapper now asks for the status again.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminated_wrapper_returns_the_commands_own_status() {
    let master = mooncake_master::RunningMaster::start(master_config())
        .await
        .unwrap();
    for round in 0..2 {
        let mut cmd = wrapper(
            &master.rpc_addr.to_string(),
            &[
                "bash",
                "-c",
                "trap 'exit 0' TERM; echo started; while :; do sleep 0.01; done",
            ],
        );
        cmd.stdin(Stdio::null()).stderr(Stdio::null());
        let w = ChildGuard::spawn_cmd(&mut cmd);
        w.wait_line("started", Duration::from_secs(20));
        w.signal(libc::SIGTERM);
        let status = exit_within(w, 15)
            .await
            .expect("wrapper did not exit after SIGTERM");
        assert_eq!(status.code(), Some(0), "round {round}");
    }
    assert!(
        unmounted_within(&master, 10).await,
        "an owner is still mounted"
    );
    master.shutdown().await;
}

/// A wrapper killed outright (SIGKILL: its traps never run) still takes its owner down: the
/// daemon gets SIGTERM when its parent dies, and unmounts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_wrapper_takes_its_owner_down() {
    let master = mooncake_master::RunningMaster::start(master_config())
        .await
        .unwrap();
    // Its traps never run, so its work directory stays: put it where this test removes it.
    let tmp = mooncake_tests::TempDir::new("killed-wrapper");
    let mut cmd = wrapper(&master.rpc_addr.to_string(), &["sleep", "30"]);
    cmd.stderr(Stdio::null()).env("TMPDIR", tmp.path());
    let w = ChildGuard::spawn_interruptible(&mut cmd);
    let mounted = mooncake_tests::eventually(Duration::from_secs(20), async || {
        master.with_state(|s| s.segment_stats().len()) == 1
    })
    .await;
    assert!(mounted, "the owner never mounted");
    // The wrapper's children: the owner, and the command once it has started.
    let children_of = |pid: i32| -> Vec<i32> {
        std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
            .unwrap_or_default()
            .split_whitespace()
            .map(|p| p.parse().unwrap())
            .collect()
    };
    let mut children = children_of(w.pid());
    for _ in 0..100 {
        if children.len() == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        children = children_of(w.pid());
    }
    assert_eq!(children.len(), 2, "the wrapper's children: {children:?}");

    w.signal(libc::SIGKILL);
    let unmounted = unmounted_within(&master, 15).await;
    // The command is left running (it is the caller's); end it, and the owner if it outlived
    // the wrapper.
    for pid in children {
        // SAFETY: plain kill(2) on processes this test started (through the wrapper).
        unsafe {
            libc::kill(pid, libc::SIGKILL);
        }
    }
    drop(w);
    assert!(unmounted, "the owner outlived its killed wrapper");
    master.shutdown().await;
}

#[test]
fn an_owner_that_cannot_start_fails_the_wrapper_without_running_the_command() {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/mooncake_owner");
    let out = Command::new(script)
        .env("MOONCAKE_OWNERD", bin_path("mooncake_ownerd"))
        .args([
            "--master",
            "127.0.0.1:1",
            "--host",
            "127.0.0.1",
            "--segment-size",
            "1MiB",
            "--no-mlock",
            "--mount-timeout",
            "1s",
            "--",
            "sh",
            "-c",
            "echo RAN",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(!String::from_utf8_lossy(&out.stdout).contains("RAN"));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("cannot mount") && err.contains("before serving"),
        "{err}"
    );
}

/// The readiness limit is the operator's (a large mlocked segment may take longer than the
/// default minute): past it the wrapper fails without running the command and stops the owner;
/// a limit that is not a number is refused before anything starts.
#[test]
fn the_readiness_limit_is_configurable() {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/mooncake_owner");
    // A master that never answers: the owner keeps trying for its whole mount timeout.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let master = silent.local_addr().unwrap().to_string();
    let run = |limit: &str| {
        let started = Instant::now();
        let out = Command::new(&script)
            .env("MOONCAKE_OWNERD", bin_path("mooncake_ownerd"))
            .env("MOONCAKE_OWNER_READY_TIMEOUT", limit)
            .args([
                "--master",
                &master,
                "--host",
                "127.0.0.1",
                "--segment-size",
                "1MiB",
                "--no-mlock",
                "--mount-timeout",
                "120s",
                "--",
                "sh",
                "-c",
                "echo RAN",
            ])
            .output()
            .unwrap();
        (out, started.elapsed())
    };
    // (Leading zeros are decimal: 02 is two seconds.)
    let (out, took) = run("02");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("within 2s"), "{err}");
    assert!(!String::from_utf8_lossy(&out.stdout).contains("RAN"));
    // The owner would have waited two minutes; the wrapper stopped it (its stop takes at most
    // ten seconds).
    assert!(took < Duration::from_secs(30), "{took:?}");

    for bad in ["soon", "0", "00", "-5"] {
        let (out, _) = run(bad);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{bad:?}: {err}");
        assert!(err.contains("MOONCAKE_OWNER_READY_TIMEOUT"), "{err}");
    }
}
