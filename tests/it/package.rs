//! The Debian package (issue 29 item 1, README "Install"): what `debian/` ships beside the
//! repository's own files stays in step with them, and the built `.deb` installs into a
//! scratch root (`dpkg -x`) whose binary accepts its own config. `.ci/run` builds the package
//! (`cargo deb`) before the tests; the maintainer scripts run against a scratch root with the
//! system tools they call stubbed. Run: `cargo test --test it package::`.

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

/// The maintainer scripts to run: the built package's (its `#DEBHELPER#` parts filled in by
/// cargo-deb) when there is one, else `debian/`'s own, in a fresh directory.
fn maintainer_scripts(into: &Path) -> PathBuf {
    let dir = into.join("scripts");
    if let Some(deb) = built_deb() {
        run(Command::new("dpkg-deb").arg("-e").arg(&deb).arg(&dir));
    } else {
        std::fs::create_dir_all(&dir).unwrap();
        for s in ["postinst", "prerm", "postrm"] {
            let from = manifest_dir().join("debian").join(s);
            // A script the package lacks fails where a test runs it.
            if from.exists() {
                std::fs::copy(&from, dir.join(s)).unwrap();
            }
        }
    }
    dir
}

/// Stand-ins for the system tools the maintainer scripts call, so that they run against a
/// scratch root and never touch this host: each call is logged to `$STUB_LOG`. The locketd
/// user exists; `dpkg-statoverride` keeps its overrides in `$STUB_DB` and, with `--update`,
/// applies the mode to the file under `$DPKG_ROOT` (ownership is only logged);
/// `systemctl list-units 'locketd@*.service'` lists two running instances.
fn stubs(dir: &Path) -> PathBuf {
    let bin = dir.join("bin");
    let log = r#"echo "$(basename "$0") $*" >> "$STUB_LOG""#;
    crate::support::write_script(
        &bin,
        "getent",
        &format!("{log}\necho 'locketd:x:990:990::/var/lib/locketd:/usr/sbin/nologin'\n"),
    );
    crate::support::write_script(
        &bin,
        "dpkg-statoverride",
        &format!(
            r#"{log}
touch "$STUB_DB"
update=
while [ $# -gt 0 ]; do
    case "$1" in
    --update) update=1 ;;
    --list) grep -q " $2\$" "$STUB_DB"; exit $? ;;
    --remove) grep -v " $2\$" "$STUB_DB" > "$STUB_DB.new" || true; mv "$STUB_DB.new" "$STUB_DB"; exit 0 ;;
    --add)
        echo "$2 $3 $4 $5" >> "$STUB_DB"
        if [ -n "$update" ] && [ -n "$DPKG_ROOT" ] && [ -e "$DPKG_ROOT$5" ]; then
            chmod "$4" "$DPKG_ROOT$5"
        fi
        exit 0 ;;
    esac
    shift
done
exit 2
"#
        ),
    );
    crate::support::write_script(
        &bin,
        "systemctl",
        &format!(
            r#"{log}
case "$*" in
*list-units*) printf '%s\n' \
    'locketd@billing.service loaded active running locketd Resque-compatible job worker (billing)' \
    'locketd@mail.service loaded active running locketd Resque-compatible job worker (mail)' ;;
esac
exit 0
"#
        ),
    );
    for tool in [
        "useradd",
        "chgrp",
        "chown",
        "deb-systemd-invoke",
        "deb-systemd-helper",
    ] {
        crate::support::write_script(&bin, tool, &format!("{log}\nexit 0\n"));
    }
    bin
}

struct Scratch {
    _dir: tempfile::TempDir,
    root: PathBuf,
    scripts: PathBuf,
    bin: PathBuf,
    log: PathBuf,
    db: PathBuf,
}

impl Scratch {
    fn new() -> Scratch {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        std::fs::create_dir_all(root.join("etc/locketd")).unwrap();
        Scratch {
            root,
            scripts: maintainer_scripts(dir.path()),
            bin: stubs(dir.path()),
            log: dir.path().join("calls.log"),
            db: dir.path().join("statoverride"),
            _dir: dir,
        }
    }

    /// Runs one maintainer script as dpkg would (`sh <script> <args>`), under `$DPKG_ROOT`
    /// = the scratch root when `rooted`; returns the tool calls it made.
    fn run(&self, script: &str, args: &[&str], rooted: bool) -> String {
        let _ = std::fs::remove_file(&self.log);
        let path = format!(
            "{}:{}",
            self.bin.display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let mut cmd = Command::new("sh");
        cmd.arg(self.scripts.join(script))
            .args(args)
            .env("PATH", path)
            .env("STUB_LOG", &self.log)
            .env("STUB_DB", &self.db);
        if rooted {
            cmd.env("DPKG_ROOT", &self.root);
        } else {
            cmd.env_remove("DPKG_ROOT");
        }
        run(&mut cmd);
        crate::support::read_lossy(&self.log)
    }

    fn conf(&self) -> PathBuf {
        self.root.join("etc/locketd/locketd.toml")
    }

    fn mode(&self) -> u32 {
        use std::os::unix::fs::PermissionsExt;
        std::fs::metadata(self.conf()).unwrap().permissions().mode() & 0o7777
    }

    fn set_mode(&self, mode: u32) {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(self.conf(), std::fs::Permissions::from_mode(mode)).unwrap();
    }
}

// Debian policy 10.9.1: the config's owner and mode are a stat override registered on the
// first install; a reinstall or an upgrade keeps what the admin made of them.
#[test]
fn the_postinst_sets_the_configs_mode_once_and_a_reinstall_keeps_the_admins() {
    let s = Scratch::new();
    std::fs::write(s.conf(), "queues = [\"default\"]\n").unwrap();
    s.set_mode(0o640);
    let calls = s.run("postinst", &["configure"], true);
    assert!(
        calls.contains(
            "dpkg-statoverride --update --add root locketd 0640 /etc/locketd/locketd.toml"
        ),
        "{calls}"
    );
    assert_eq!(s.mode(), 0o640);

    // The admin tightens it; a reinstall (configure <same version>) and an upgrade keep it.
    s.set_mode(0o600);
    for version in ["0.1.0", "0.1.0", "0.2.0"] {
        let calls = s.run("postinst", &["configure", version], true);
        assert_eq!(s.mode(), 0o600, "configure {version}: {calls}");
    }
    let db = crate::support::read_lossy(&s.db);
    assert_eq!(db.lines().count(), 1, "{db}");

    // An upgrade from a version that registered no override keeps the mode the file has.
    std::fs::remove_file(&s.db).unwrap();
    s.set_mode(0o620);
    s.run("postinst", &["configure", "0.0.9"], true);
    assert_eq!(s.mode(), 0o620);
    let db = crate::support::read_lossy(&s.db);
    assert!(
        db.trim_end()
            .ends_with("locketd 620 /etc/locketd/locketd.toml"),
        "{db}"
    );
}

// The template's running instances (locketd@<name>) are stopped on removal and restarted
// by an upgrade, as locketd.service is; an upgrade's prerm and a first install touch none.
#[test]
fn the_maintainer_scripts_stop_and_restart_the_running_instances() {
    let s = Scratch::new();
    std::fs::write(
        s.db.clone(),
        "root locketd 0640 /etc/locketd/locketd.toml\n",
    )
    .unwrap();
    let instances = "locketd@billing.service locketd@mail.service";

    let calls = s.run("prerm", &["remove"], false);
    assert!(
        calls.contains(&format!("deb-systemd-invoke stop {instances}")),
        "{calls}"
    );
    let calls = s.run("prerm", &["upgrade", "0.2.0"], false);
    assert!(!calls.contains("locketd@billing"), "{calls}");

    let calls = s.run("postinst", &["configure", "0.1.0"], false);
    assert!(
        calls.contains(&format!("deb-systemd-invoke try-restart {instances}")),
        "{calls}"
    );
    let calls = s.run("postinst", &["configure"], false);
    assert!(!calls.contains("try-restart locketd@"), "{calls}");
}

// Purge removes the state directory (every instance's too) and the stat override; a plain
// removal keeps both. The system user stays (README "Install").
#[test]
fn purge_removes_the_state_directory_and_remove_keeps_it() {
    let s = Scratch::new();
    let state = s.root.join("var/lib/locketd");
    std::fs::create_dir_all(state.join("billing")).unwrap();
    std::fs::write(state.join("billing/out.txt"), "x").unwrap();
    std::fs::write(
        s.db.clone(),
        "root locketd 0640 /etc/locketd/locketd.toml\n",
    )
    .unwrap();

    s.run("postrm", &["remove"], true);
    assert!(state.join("billing/out.txt").exists());
    let calls = s.run("postrm", &["purge"], true);
    assert!(!state.exists(), "{calls}");
    assert!(!s.root.join("var/lib").read_dir().unwrap().any(|_| true));
    assert_eq!(crate::support::read_lossy(&s.db).trim(), "", "{calls}");
    assert!(!calls.contains("userdel"), "{calls}");
}
