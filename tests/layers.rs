//! The layering of `src/` (docs/dev/architecture.md): each top-level module belongs to one layer
//! of [`LAYERS`], and a module may name (`crate::<module>`, in code or in a doc link) only
//! modules of lower layers. Two modules of one layer may not name each other, so no two modules
//! import each other. A module missing from the table fails too: a new one takes its place in
//! the table.
//!
//! Like the project's layout check, it reads every file's text up to its first `#[cfg(test)]`:
//! unit tests may reach anywhere.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The layers, bottom to top.
const LAYERS: &[(&str, &[&str])] = &[
    ("the wire format", &["resque"]),
    (
        "leaves",
        &[
            "host",
            "proctitle",
            "logsink",
            "notify",
            "process",
            "watchdog",
            "metrics",
        ],
    ),
    ("the text log's format, over its sink", &["logline"]),
    ("the lock model", &["locks"]),
    ("errors", &["error"]),
    ("the connection", &["conn"]),
    ("configuration", &["config"]),
    ("the Redis-side state machine", &["store"]),
    ("the scheduler", &["scheduler"]),
    ("handlers", &["handler"]),
    ("the worker", &["worker"]),
    ("operator reads", &["ops"]),
    ("the client", &["client"]),
    ("admin commands", &["admin"]),
    ("the web page", &["web"]),
    ("service side-cars", &["service"]),
    ("the master", &["master"]),
    ("the command line", &["cli"]),
];

/// Files that are not part of the library's layers: the binaries and the crate root.
fn exempt(rel: &Path) -> bool {
    rel.starts_with("bin") || rel == Path::new("main.rs") || rel == Path::new("lib.rs")
}

fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
        .map(|e| e.expect("dir entry").path())
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The top-level module a file belongs to (`worker/run.rs` → `worker`, `config.rs` → `config`).
fn module_of(rel: &Path) -> String {
    let first = rel.components().next().expect("a path");
    let name = first.as_os_str().to_string_lossy();
    name.strip_suffix(".rs").unwrap_or(&name).to_string()
}

/// The top-level modules `code` names through `crate::`: `crate::a::…`, `crate::{a, b::c}`, and
/// the crate root's re-exports `crate::Error` and `crate::Result` (module `error`).
fn named(code: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = code;
    while let Some(i) = rest.find("crate::") {
        // Not a suffix of a longer path such as `locketd_crate::`.
        let before = rest[..i].chars().next_back();
        rest = &rest[i + "crate::".len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        if let Some(group) = rest.strip_prefix('{') {
            let end = matching_brace(group);
            for item in split_top(&group[..end]) {
                out.extend(first_segment(item));
            }
        } else {
            out.extend(first_segment(rest));
        }
    }
    out
}

/// The index of the `}` closing a group that starts right after a `{`.
fn matching_brace(s: &str) -> usize {
    let mut depth = 0;
    for (i, c) in s.char_indices() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => return i,
            '}' => depth -= 1,
            _ => {}
        }
    }
    s.len()
}

/// The items of a `{…}` group's inside, split at its own commas.
fn split_top(s: &str) -> Vec<&str> {
    let (mut out, mut depth, mut start) = (Vec::new(), 0, 0);
    for (i, c) in s.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                out.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&s[start..]);
    out
}

fn first_segment(s: &str) -> Option<String> {
    let s = s.trim_start();
    let ident: String = s
        .chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect();
    match ident.as_str() {
        "" | "self" => None,
        "Error" | "Result" => Some("error".to_string()),
        i if i.starts_with(char::is_uppercase) => None,
        i => Some(i.to_string()),
    }
}

/// Every breach of the layering in the tree at `src`, one line each.
fn breaches(src: &Path) -> Vec<String> {
    let layer: BTreeMap<&str, usize> = LAYERS
        .iter()
        .enumerate()
        .flat_map(|(i, (_, ms))| ms.iter().map(move |m| (*m, i)))
        .collect();
    let mut all = Vec::new();
    files(src, &mut all);
    let mut out = Vec::new();
    let mut unknown = BTreeSet::new();
    for path in all {
        let rel = path.strip_prefix(src).expect("under src").to_path_buf();
        if exempt(&rel) {
            continue;
        }
        let me = module_of(&rel);
        let text = std::fs::read_to_string(&path).expect("read source");
        let code = text.split("#[cfg(test)]").next().unwrap_or("");
        let Some(&mine) = layer.get(me.as_str()) else {
            unknown.insert(me);
            continue;
        };
        for other in named(code) {
            if other == me {
                continue;
            }
            match layer.get(other.as_str()) {
                None => out.push(format!(
                    "src/{}: names crate::{other}, a module the layer table does not know",
                    rel.display()
                )),
                Some(&theirs) if theirs > mine => out.push(format!(
                    "src/{}: names crate::{other}, but {me} ({}) is below {other} ({})",
                    rel.display(),
                    LAYERS[mine].0,
                    LAYERS[theirs].0
                )),
                Some(&theirs) if theirs == mine => out.push(format!(
                    "src/{}: names crate::{other}, of its own layer ({}): modules of one layer stay apart",
                    rel.display(),
                    LAYERS[mine].0
                )),
                Some(_) => {}
            }
        }
    }
    for m in unknown {
        out.push(format!(
            "src/{m}: a module missing from the layer table in tests/layers.rs"
        ));
    }
    out
}

#[test]
fn every_module_names_only_modules_of_lower_layers() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let found = breaches(&src);
    assert!(
        found.is_empty(),
        "{} layering breach(es):\n{}",
        found.len(),
        found.join("\n")
    );
}

// The checker itself, on trees written for the purpose.
#[test]
fn the_check_names_the_file_and_the_import_of_an_upward_or_circular_reference() {
    let dir = tempfile::tempdir().expect("tempdir");
    let src = dir.path();
    std::fs::create_dir_all(src.join("worker")).unwrap();
    std::fs::write(
        src.join("resque.rs"),
        "use crate::config::Config;\n#[cfg(test)]\nuse crate::worker::X;\n",
    )
    .unwrap();
    std::fs::write(src.join("config.rs"), "use crate::{error::E, conn};\n").unwrap();
    std::fs::write(
        src.join("conn.rs"),
        "fn f() -> crate::Result<()> { Ok(()) }\n",
    )
    .unwrap();
    std::fs::write(src.join("error.rs"), "/// See [`crate::resque`].\n").unwrap();
    std::fs::write(src.join("worker/run.rs"), "use crate::{store, nowhere};\n").unwrap();
    std::fs::write(src.join("host.rs"), "use crate::notify;\n").unwrap();
    std::fs::write(src.join("shutdown.rs"), "\n").unwrap();
    std::fs::write(src.join("main.rs"), "use locketd::master;\n").unwrap();
    let found = breaches(src);
    assert_eq!(
        found,
        [
            "src/host.rs: names crate::notify, of its own layer (leaves): modules of one layer stay apart",
            "src/resque.rs: names crate::config, but resque (the wire format) is below config (configuration)",
            "src/worker/run.rs: names crate::nowhere, a module the layer table does not know",
            "src/shutdown: a module missing from the layer table in tests/layers.rs",
        ],
        "{found:#?}"
    );
}
