//! The Debian package (issue 29 item 1, README "Install"): what `debian/` ships beside the
//! repository's own files stays in step with them, and the built `.deb` installs into a
//! scratch root (`dpkg -x`) whose binary accepts its own config. `.ci/run` builds the package
//! (`cargo deb`) before the tests. Run: `cargo test --test it package::`.

use std::path::{Path, PathBuf};
use std::process::Command;

use locketd::config::Config;

use crate::support::manifest_dir;

fn read(rel: &str) -> String {
    std::fs::read_to_string(manifest_dir().join(rel)).unwrap_or_else(|e| panic!("read {rel}: {e}"))
}

/// The packaged config with every commented setting (`#key = value`, `#[table]`) uncommented.
/// Prose and examples are written `# ...`, with a space, and stay comments.
fn uncommented(text: &str) -> (String, usize) {
    let mut n = 0;
    let out = text
        .lines()
        .map(|l| match l.strip_prefix('#') {
            Some(rest) if rest.starts_with(|c: char| c.is_ascii_lowercase() || c == '[') => {
                n += 1;
                rest.to_string()
            }
            _ => l.to_string(),
        })
        .collect::<Vec<_>>()
        .join("\n");
    (out, n)
}

// The conffile shows the defaults: with every commented setting switched on, the daemon reads
// exactly the configuration the file gives as shipped. A default changed in the code, or a
// setting renamed (deny_unknown_fields), fails here.
#[test]
fn the_packaged_config_is_the_defaults_commented_out() {
    let text = read("debian/locketd.toml");
    let shipped = Config::parse(&text, "debian/locketd.toml").unwrap();
    let (all, n) = uncommented(&text);
    assert!(n >= 40, "only {n} commented settings found");
    let spelled_out = Config::parse(&all, "debian/locketd.toml, uncommented")
        .unwrap_or_else(|e| panic!("{e}\n{all}"));
    assert_eq!(format!("{shipped:#?}"), format!("{spelled_out:#?}"));
    // It is not the demo: no job class is configured, and it passes the daemon's checks.
    assert!(shipped.classes.is_empty());
    shipped.check().unwrap();
}

// The packaged units are the repository's, with the binary where the package puts it.
#[test]
fn the_packaged_units_are_the_repository_units_at_usr_bin() {
    for unit in ["locketd.service", "locketd@.service"] {
        let ours = read(&format!("systemd/{unit}"));
        assert!(ours.contains("ExecStart=/usr/local/bin/locketd "), "{unit}");
        assert_eq!(
            read(&format!("debian/{unit}")),
            ours.replace("/usr/local/bin/locketd", "/usr/bin/locketd"),
            "debian/{unit} differs from systemd/{unit} by more than the binary's path: \
             regenerate it with sed 's|/usr/local/bin/locketd|/usr/bin/locketd|g'"
        );
    }
}

/// The newest `target/debian/locketd_*.deb` (or `LOCKETD_DEB`), or None outside CI.
fn built_deb() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("LOCKETD_DEB") {
        return Some(PathBuf::from(p));
    }
    let dir = manifest_dir().join("target/debian");
    let newest = std::fs::read_dir(&dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            let name = p.file_name().unwrap_or_default().to_string_lossy();
            name.starts_with("locketd_") && name.ends_with(".deb")
        })
        .max_by_key(|p| p.metadata().and_then(|m| m.modified()).ok());
    if newest.is_none() {
        assert!(
            std::env::var_os("CI").is_none(),
            "no target/debian/locketd_*.deb in CI: .ci/run must run `cargo deb` before the tests"
        );
        eprintln!("SKIPPED: no package built (cargo deb); CI runs this test");
    }
    newest
}

fn run(cmd: &mut Command) -> std::process::Output {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(out.status.success(), "{cmd:?}: {out:?}");
    out
}

#[test]
fn the_package_installs_into_a_scratch_root_and_its_config_checks() {
    let Some(deb) = built_deb() else { return };
    let root = tempfile::tempdir().unwrap();
    run(Command::new("dpkg").arg("-x").arg(&deb).arg(root.path()));
    let r = root.path();
    let unit_dir = ["usr/lib/systemd/system", "lib/systemd/system"]
        .iter()
        .map(|d| r.join(d))
        .find(|d| d.join("locketd.service").exists())
        .unwrap_or_else(|| panic!("no locketd.service in {}", deb.display()));
    for unit in ["locketd.service", "locketd@.service"] {
        assert_eq!(
            std::fs::read_to_string(unit_dir.join(unit)).unwrap(),
            read(&format!("debian/{unit}")),
            "{unit}"
        );
    }
    for adapter in [
        "ruby/locketd-ruby",
        "python/locketd_handler.py",
        "node/locketd-handler.js",
    ] {
        let p = r.join("usr/share/locketd/adapters").join(adapter);
        let mode = std::fs::metadata(&p)
            .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
            .permissions();
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(mode.mode() & 0o111, 0o111, "{adapter} is not executable");
    }
    let conf = r.join("etc/locketd/locketd.toml");
    assert_eq!(
        std::fs::read_to_string(&conf).unwrap(),
        read("debian/locketd.toml")
    );

    // The control area: the config is a conffile, postinst creates the user.
    let control = r.join("DEBIAN");
    run(Command::new("dpkg-deb").arg("-e").arg(&deb).arg(&control));
    let conffiles = std::fs::read_to_string(control.join("conffiles")).unwrap();
    assert!(
        conffiles.lines().any(|l| l == "/etc/locketd/locketd.toml"),
        "{conffiles}"
    );
    let postinst = std::fs::read_to_string(control.join("postinst")).unwrap();
    assert!(postinst.contains("useradd --system"), "{postinst}");

    // The packaged binary accepts the packaged config, as an operator would check it.
    let out = run(Command::new(r.join("usr/bin/locketd"))
        .arg("check-config")
        .arg(&conf)
        .env_remove("REDIS_URL")
        .env_remove("QUEUES")
        .env_remove("QUEUE"));
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(said.trim_end().ends_with(": ok"), "{out:?}");
    assert!(Path::new(&r.join("usr/share/doc/locketd/README.md")).exists());
}
