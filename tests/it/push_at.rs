//! PUSH_AT, PUSH's delayed form (locking-semantics.md D-3b; scheduler-protocol.md SC-1, SC-2):
//! `locketd enqueue --at/--in` and any client schedule a job in resque-scheduler's layout with
//! its enqueue-time holds and `unique` key placed at schedule time, in one step.

use std::time::Duration;

use crate::admin::cli;
use crate::daemon::{workdir, NS, R};
use crate::push::{assert_b_after_a, events, logger, seed_001_cfg};
use crate::support::{wait_until, Daemon, RedisServer};

const LONG: Duration = Duration::from_secs(30);

fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

/// Seed 001 with a delayed A (D-3b): A for orders 1..=3 is scheduled with `locketd enqueue
/// --at` two seconds ahead, its hold placed at once (before any daemon ran: the CLI offers its
/// plans); B (`locked_by` the hold) is pushed plainly to the queue the workers take first. B
/// is reserved long before A is due, and must not start before A (delivered by locketd's
/// scheduler) succeeded. The scheduled item keeps resque-scheduler's exact bytes and index.
#[test]
fn a_delayed_push_places_its_holds_at_schedule_time_and_b_waits_for_a() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let work = workdir();
    let log = work.path().join("runs.log");
    let a = logger(work.path(), "a.sh", &log, "sleep 0.3");
    let b = logger(work.path(), "b.sh", &log, "true");
    let config = seed_001_cfg(&a, &b, 2).render();
    let path = work.path().join("c.toml");
    std::fs::write(&path, &config).unwrap();
    let at = unix_now() + 2;
    for n in 1..=3u64 {
        let out = cli(
            &redis,
            &path,
            &[
                "enqueue",
                "a",
                "Webhook::Receive",
                &n.to_string(),
                r#"{"event": "paid"}"#,
                "--at",
                &at.to_string(),
                "--json",
            ],
        );
        assert!(out.status.success(), "{out:?}");
        let done: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(done["pushed"], true, "{done}");
        assert_eq!(done["at"], at, "{done}");
        assert_eq!(done["holds"], serde_json::json!([format!("order:{n}")]));
        assert!(
            r.exists(&format!("{NS}:locket:dep:order:{n}")),
            "no hold placed at schedule time for A {n}"
        );
        // SC-1, SC-2: the gem's layout, the item's bytes kept (only whitespace dropped).
        let item = format!(
            r#"{{"class":"Webhook::Receive","args":[{n},{{"event":"paid"}}],"queue":"a"}}"#
        );
        assert_eq!(done["item"], item.as_str());
        let index: Vec<String> = r.cmd(&["SMEMBERS", &format!("{NS}:timestamps:{item}")]);
        assert_eq!(index, [format!("delayed:{at}")]);
        r.push(
            "b",
            &format!(r#"{{"class":"Order::CancelUnshipped","args":[{n}]}}"#),
        );
    }
    let bucket = format!("{NS}:delayed:{at}");
    assert_eq!(r.llen(&bucket), 3);
    let score: Option<f64> = r.cmd(&[
        "ZSCORE",
        &format!("{NS}:delayed_queue_schedule"),
        &at.to_string(),
    ]);
    assert_eq!(score, Some(at as f64));
    assert_eq!(r.llen(&format!("{NS}:queue:a")), 0);

    let mut d = Daemon::start(&redis, &config, &[]);
    wait_until(LONG, "every job ran", || {
        events(&log).iter().filter(|e| e.0 == "end").count() == 6
    });
    assert_eq!(d.terminate(LONG).code(), Some(0), "{}", d.log());
    assert_b_after_a(&mut r, &log, 3);
    assert!(!r.exists(&bucket), "the bucket was delivered");
}

/// U-1 at schedule time: a duplicate scheduled within `unique_ttl` is refused (`pushed`
/// false, nothing written); the scheduled item is found by its exact bytes as
/// `Resque.remove_delayed` finds it (SMEMBERS of its index, LREM of each bucket); a key of
/// another type is refused before anything is written (S-6).
#[test]
fn a_delayed_duplicate_is_refused_and_remove_delayed_finds_the_item() {
    let redis = RedisServer::start();
    let mut r = R::new(&redis);
    let dir = workdir();
    let config = dir.path().join("c.toml");
    std::fs::write(
        &config,
        "queues = \"u\"\n[classes.\"Sync\"]\ncommand = [\"/bin/true\"]\n\
         unique = \"until_expired\"\nunique_ttl = \"60s\"\nunique_key = \"sync:{args[0]}\"\n\
         holds = [ { name = \"sync:{args[0]}\", when = \"enqueue\" } ]\n",
    )
    .unwrap();
    let at = (unix_now() + 3600).to_string();
    let schedule = |arg: &str| -> serde_json::Value {
        let out = cli(
            &redis,
            &config,
            &["enqueue", "u", "Sync", arg, "--at", &at, "--json"],
        );
        assert!(out.status.success(), "{out:?}");
        serde_json::from_slice(&out.stdout).unwrap()
    };
    assert_eq!(schedule("7")["pushed"], true);
    let again = schedule("7");
    assert_eq!(again["pushed"], false, "{again}");
    assert_eq!(schedule("8")["pushed"], true);
    let bucket = format!("{NS}:delayed:{at}");
    assert_eq!(r.llen(&bucket), 2, "the duplicate wrote nothing");
    let hold: std::collections::HashMap<String, String> =
        r.cmd(&["HGETALL", &format!("{NS}:locket:dep:sync:7")]);
    assert_eq!(hold.len(), 1);
    assert!(hold.values().all(|v| v.starts_with("1:")), "{hold:?}");
    assert!(r.exists(&format!("{NS}:locket:unique:sync:7")));

    // Resque.remove_delayed(Sync, 7): the item as the gem encodes it, byte for byte.
    let item = r#"{"class":"Sync","args":[7],"queue":"u"}"#;
    let index = format!("{NS}:timestamps:{item}");
    let buckets: Vec<String> = r.cmd(&["SMEMBERS", &index]);
    assert_eq!(buckets, [format!("delayed:{at}")]);
    let removed: i64 = r.cmd(&["LREM", &format!("{NS}:{}", buckets[0]), "0", item]);
    assert_eq!(removed, 1);
    let _: i64 = r.cmd(&["SREM", &index, &buckets[0]]);
    assert_eq!(r.llen(&bucket), 1);

    // S-6: the index key of another type: refused, no hold, no unique key, no item.
    let item9 = r#"{"class":"Sync","args":[9],"queue":"u"}"#;
    let _: () = r.cmd(&["SET", &format!("{NS}:timestamps:{item9}"), "x"]);
    let out = cli(&redis, &config, &["enqueue", "u", "Sync", "9", "--at", &at]);
    assert!(!out.status.success(), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("WRONGTYPE"),
        "{out:?}"
    );
    assert!(!r.exists(&format!("{NS}:locket:dep:sync:9")));
    assert!(!r.exists(&format!("{NS}:locket:unique:sync:9")));
    assert_eq!(r.llen(&bucket), 1);
}
