//! The shipped unit files: `systemd-analyze verify` accepts them (with the built binary in
//! place of /usr/local/bin/locketd, which verify requires to exist), and they say what the daemon
//! relies on. Run: `cargo test --test it systemd_units::`.

use std::path::{Path, PathBuf};
use std::process::Command;

use locketd::config::Config;

use crate::support::manifest_dir;

/// `systemd-analyze`, or None (allowed only outside CI: `.ci/run` installs it).
fn analyzer() -> Option<PathBuf> {
    let found = ["/usr/bin/systemd-analyze", "/bin/systemd-analyze"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
        .or_else(|| {
            let out = Command::new("sh")
                .args(["-c", "command -v systemd-analyze"])
                .output()
                .ok()?;
            let p = String::from_utf8_lossy(&out.stdout).trim().to_string();
            (!p.is_empty()).then(|| PathBuf::from(p))
        });
    if found.is_none() {
        assert!(
            std::env::var_os("CI").is_none(),
            "systemd-analyze is missing in CI: .ci/run must install Debian's systemd package"
        );
        eprintln!(
            "SKIPPED: systemd-analyze not installed (apt-get install systemd); CI runs this test"
        );
    }
    found
}

fn unit_text(name: &str) -> String {
    std::fs::read_to_string(manifest_dir().join("systemd").join(name))
        .unwrap_or_else(|e| panic!("read systemd/{name}: {e}"))
}

/// Copies `name` into `dir` with the built binary as ExecStart's program.
fn install_copy(dir: &Path, name: &str) -> PathBuf {
    let text = unit_text(name).replace("/usr/local/bin/locketd", env!("CARGO_BIN_EXE_locketd"));
    assert!(
        text.contains(env!("CARGO_BIN_EXE_locketd")),
        "{name}: no ExecStart binary to swap"
    );
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

/// Runs `systemd-analyze verify` on `unit` (a path); returns (success, complaints about it).
fn verify(analyze: &Path, unit: &Path) -> (bool, Vec<String>) {
    let out = Command::new(analyze)
        .args(["verify", "--man=no"])
        .arg(unit)
        .env("SYSTEMD_LOG_COLOR", "0")
        .output()
        .expect("run systemd-analyze");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    // verify reports bad settings as warnings with exit 0; any line about our unit counts.
    let complaints = stderr
        .lines()
        .filter(|l| l.contains("locketd"))
        .map(str::to_string)
        .collect();
    (out.status.success(), complaints)
}

#[test]
fn unit_files_pass_systemd_analyze_verify() {
    let Some(analyze) = analyzer() else { return };
    let dir = tempfile::tempdir().unwrap();
    let plain = install_copy(dir.path(), "locketd.service");
    let (ok, complaints) = verify(&analyze, &plain);
    assert!(
        ok && complaints.is_empty(),
        "locketd.service: {complaints:?}"
    );

    // A template is verified through an instance name next to it.
    install_copy(dir.path(), "locketd@.service");
    let (ok, complaints) = verify(&analyze, &dir.path().join("locketd@billing.service"));
    assert!(
        ok && complaints.is_empty(),
        "locketd@.service: {complaints:?}"
    );

    // The check itself catches a broken unit here.
    let broken = dir.path().join("locketd-broken.service");
    std::fs::write(
        &broken,
        std::fs::read_to_string(&plain)
            .unwrap()
            .replace("KillMode=mixed", "KillMode=sometimes"),
    )
    .unwrap();
    let (_, complaints) = verify(&analyze, &broken);
    assert!(
        !complaints.is_empty(),
        "verify did not notice KillMode=sometimes"
    );
}

fn setting<'a>(text: &'a str, key: &str) -> Vec<&'a str> {
    text.lines()
        .filter_map(|l| l.trim().strip_prefix(key)?.strip_prefix('='))
        .collect()
}

fn secs(v: &str) -> u64 {
    v.trim_end_matches('s').parse().expect("seconds")
}

#[test]
fn units_match_what_the_daemon_does() {
    let defaults = Config::default();
    let stop_budget = defaults.locket.shutdown_timeout.get().as_secs()
        + defaults.term_timeout.get().as_secs()
        + 5;
    for name in ["locketd.service", "locketd@.service"] {
        let t = unit_text(name);
        let one = |k: &str| -> &str {
            let v = setting(&t, k);
            assert_eq!(v.len(), 1, "{name}: {k}= {v:?}");
            v[0]
        };
        assert_eq!(one("Type"), "notify", "{name}");
        assert_eq!(
            one("KillSignal"),
            "SIGQUIT",
            "{name}: QUIT is the graceful stop"
        );
        assert_eq!(one("KillMode"), "mixed", "{name}");
        assert_eq!(one("Restart"), "on-failure", "{name}");
        assert_eq!(
            one("RestartPreventExitStatus"),
            "78",
            "{name}: bad config exits 78"
        );
        assert!(one("ExecReload").contains("-HUP $MAINPID"), "{name}");
        assert!(
            secs(one("TimeoutStopSec")) >= stop_budget,
            "{name}: TimeoutStopSec below shutdown_timeout + term_timeout + 5s = {stop_budget}"
        );
        assert!(
            secs(one("TimeoutStartSec")) > defaults.redis_connect_timeout.get().as_secs(),
            "{name}: start must outlast redis_connect_timeout"
        );
        assert!(secs(one("WatchdogSec")) >= 2, "{name}");
        assert_eq!(one("User"), "locketd", "{name}");
        for hardening in ["NoNewPrivileges", "ProtectHome", "PrivateTmp"] {
            assert_eq!(one(hardening), "yes", "{name}: {hardening}");
        }
        assert_eq!(one("ProtectSystem"), "strict", "{name}");
        assert!(
            setting(&t, "MemoryDenyWriteExecute").is_empty(),
            "{name}: breaks JIT handlers"
        );
    }
    let plain = unit_text("locketd.service");
    assert!(setting(&plain, "ExecStart")[0].ends_with("--config /etc/locketd/locketd.toml"));
    let tmpl = unit_text("locketd@.service");
    assert!(setting(&tmpl, "ExecStart")[0].ends_with("--config /etc/locketd/%i.toml"));
}
