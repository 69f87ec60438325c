//! The generated configuration reference: `locketd config reference` prints the settings table
//! (src/config/reference/), and the committed renderings of it (the reference page, the example
//! config, the packaged config) are exactly what it prints today. Run:
//! `cargo test --test it reference::`.

use std::path::Path;
use std::process::Command;

use crate::support::manifest_dir;

/// Each committed rendering: its path in the repository and its `--format`.
const RENDERINGS: &[(&str, &str)] = &[
    ("docs/reference/config.md", "markdown"),
    ("config/locketd.toml", "toml"),
    ("debian/locketd.toml", "deb"),
];

fn reference(format: &str) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_locketd"))
        .args(["config", "reference", "--format", format])
        .env_remove("REDIS_URL")
        .env_remove("QUEUES")
        .output()
        .unwrap();
    assert!(out.status.success(), "--format {format}: {out:?}");
    String::from_utf8(out.stdout).unwrap()
}

/// One message per rendering under `root` that differs from what the binary prints: the first
/// line that differs, and the command that regenerates the file.
fn stale(root: &Path) -> Vec<String> {
    let mut found = Vec::new();
    for (path, format) in RENDERINGS {
        let committed = std::fs::read_to_string(root.join(path)).unwrap_or_default();
        let generated = reference(format);
        if committed == generated {
            continue;
        }
        let (n, (was, now)) = committed
            .lines()
            .chain(std::iter::repeat("<end of file>"))
            .zip(generated.lines().chain(std::iter::repeat("<end of file>")))
            .enumerate()
            .find(|(_, (a, b))| a != b)
            .unwrap_or((0, ("", "")));
        found.push(format!(
            "{path} is stale: line {} is\n    {was}\nbut the settings table gives\n    {now}\n\
             run `locketd config reference --format {format} > {path}` (cargo run -- config \
             reference --format {format} > {path})",
            n + 1
        ));
    }
    found
}

// The committed page and configs are the table's renderings: a setting added, renamed or given
// a new default in src/config/reference/ without regenerating them fails here.
#[test]
fn the_committed_renderings_are_up_to_date() {
    let found = stale(&manifest_dir());
    assert!(found.is_empty(), "{}", found.join("\n\n"));
}

// The check above can fail: a copy of the repository's renderings with one default changed by
// hand in each is reported, file by file, with the command that regenerates it.
#[test]
fn a_hand_edited_rendering_is_reported_stale_with_the_fix() {
    let copy = tempfile::tempdir().unwrap();
    for (path, _) in RENDERINGS {
        let text = std::fs::read_to_string(manifest_dir().join(path)).unwrap();
        let broken = text.replacen("\"35s\"", "\"40s\"", 1);
        assert_ne!(broken, text, "{path} shows no lock_ttl default to change");
        let to = copy.path().join(path);
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::write(&to, broken).unwrap();
    }
    let found = stale(copy.path());
    assert_eq!(found.len(), RENDERINGS.len(), "{found:#?}");
    for ((path, format), message) in RENDERINGS.iter().zip(&found) {
        assert!(message.contains("40s"), "{message}");
        assert!(
            message.contains(&format!(
                "run `locketd config reference --format {format} > {path}`"
            )),
            "{message}"
        );
    }
}
