//! The class plans a daemon publishes in Redis for the enqueue function (locking-semantics.md
//! D-3a): per class, what a push needs to render and place in Lua, compiled from [`Plans`].
//!
//! Layout: the hash `<ns>:locket:plans`, field = class name (`*` for the fallback table, the
//! empty name for the `[locket]` defaults), value = the JSON below; and the set
//! `<ns>:locket:holding_plans` of the fields whose plan places holds at enqueue. PUSH
//! (src/store/lua/push.lua) reads the payload only when that set is not empty, then the class's
//! field, else `*`, else the empty name, as [`Plans::get`] chooses.
//!
//! ```json
//! {"v":1,"digest":"<64 hex>","hold_ttl_ms":86400000,
//!  "holds":[{"name":<template>,"when":"enqueue","release_on":"success"}],
//!  "locks":[{"key":<template>,"limit":1}],"locked_by":[<template>],
//!  "unique":{"policy":"until_expired","key":<template>,"ttl_ms":60000}}    (unique: when set;
//!  policy also "until_executing" or "until_executed", whose ttl_ms is 0 without unique_ttl)
//! ```
//!
//! Each `<template>` is [`Template::compiled`](crate::locks::template::Template::compiled).
//! The digest is the SHA-256 of the canonical JSON of the plan without its `digest` member:
//! two daemons with the same settings for a class publish the same digest, whatever the
//! order or spelling of their files.

use super::plans::{ClassPlan, HoldWhen, Plans, ReleaseOn};
use crate::locks::canonical;
use serde_json::{json, Value};

/// The published form's version (`v`): a renderer reads only the versions it knows.
pub const PLAN_VERSION: u64 = 1;

/// One class's published plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Published {
    /// The hash field: a class name, `*`, or `""` for the `[locket]` defaults.
    pub field: String,
    /// The plan's digest (the `digest` member of `json`).
    pub digest: String,
    /// The JSON text stored in the field.
    pub json: String,
    /// Whether the plan acts at enqueue, placing holds or refusing duplicates (its field is then
    /// in `holding_plans`).
    pub holding: bool,
}

/// The published plan of one class.
pub fn publish_class(field: &str, plan: &ClassPlan) -> Published {
    let holds: Vec<Value> = plan
        .holds
        .iter()
        .map(|h| {
            json!({
                "name": h.name.compiled(),
                "when": match h.when { HoldWhen::Enqueue => "enqueue", HoldWhen::Start => "start" },
                "release_on": match h.release_on {
                    ReleaseOn::Success => "success",
                    ReleaseOn::Completion => "completion",
                },
            })
        })
        .collect();
    let locks: Vec<Value> = plan
        .locks
        .iter()
        .map(|(t, limit)| json!({"key": t.compiled(), "limit": limit}))
        .collect();
    let locked_by: Vec<Value> = plan.locked_by.iter().map(|t| t.compiled()).collect();
    let mut body = json!({
        "v": PLAN_VERSION,
        "hold_ttl_ms": u64::try_from(plan.hold_ttl.as_millis()).unwrap_or(u64::MAX),
        "holds": holds,
        "locks": locks,
        "locked_by": locked_by,
    });
    if let Some(u) = &plan.unique {
        body["unique"] = json!({
            "policy": u.policy.word(),
            "key": u.key.compiled(),
            "ttl_ms": u.ttl.map_or(0, |t| u64::try_from(t.as_millis()).unwrap_or(u64::MAX)),
        });
    }
    let digest = canonical::sha256_hex(canonical::canonical_json(&body).as_bytes());
    body["digest"] = Value::from(digest.clone());
    Published {
        field: field.to_string(),
        digest,
        json: canonical::canonical_json(&body),
        holding: plan.unique.is_some() || plan.holds.iter().any(|h| h.when == HoldWhen::Enqueue),
    }
}

/// Every plan of `plans`, sorted by field.
pub fn publish_all(plans: &Plans) -> Vec<Published> {
    let mut out: Vec<Published> = plans
        .fields()
        .map(|(field, plan)| publish_class(field, plan))
        .collect();
    out.sort_by(|a, b| a.field.cmp(&b.field));
    out
}

/// The digest member of a published JSON text, if it has one.
pub fn digest_of(json_text: &str) -> Option<String> {
    let v: Value = serde_json::from_str(json_text).ok()?;
    v.get("digest")?.as_str().map(str::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    // locking-semantics.md U-1, C-1
    #[test]
    fn unique_settings_are_checked_and_published() {
        let bad = |text: &str| {
            Plans::compile(&Config::parse(&format!("queues = \"q\"\n{text}"), "t").unwrap())
                .unwrap_err()
                .to_string()
        };
        // U-2, U-3: the policies that follow the job need no unique_ttl (a backstop there).
        let p = plans("[classes.A]\nunique = \"until_executed\"\n[classes.B]\nunique = \"until_executing\"\nunique_ttl = \"1h\"\nunique_key = \"{args[0]}\"\n");
        let all = publish_all(&p);
        let a: Value = serde_json::from_str(&all[1].json).unwrap();
        assert_eq!(a["unique"]["policy"], "until_executed");
        assert_eq!(a["unique"]["ttl_ms"], 0);
        let b: Value = serde_json::from_str(&all[2].json).unwrap();
        assert_eq!(b["unique"]["policy"], "until_executing");
        assert_eq!(b["unique"]["ttl_ms"], 3_600_000);
        assert!(all[1].holding && all[2].holding);
        assert!(
            bad("[classes.A]\nunique = \"until_executed\"\nunique_ttl = \"0s\"").contains("1ms")
        );
        assert!(bad("[classes.A]\nunique = \"until_expired\"").contains("unique_ttl"));
        assert!(bad("[classes.A]\nunique_key = \"{args[0]}\"").contains("unique"));
        assert!(bad("[classes.A]\nunique = \"maybe\"\nunique_ttl = \"1s\"").contains("maybe"));
        let p = plans("[classes.A]\nunique = \"until_expired\"\nunique_ttl = \"90s\"\n");
        let a = &publish_all(&p)[1];
        assert!(a.holding);
        let v: Value = serde_json::from_str(&a.json).unwrap();
        assert_eq!(v["unique"]["ttl_ms"], 90_000);
        assert_eq!(v["unique"]["key"]["src"], "{class}:{args_digest}");
        assert!(!publish_all(&p)[0].holding);
    }

    fn plans(text: &str) -> Plans {
        Plans::compile(&Config::parse(&format!("queues = \"q\"\n{text}"), "t").unwrap()).unwrap()
    }

    #[test]
    fn the_digest_ignores_spelling_and_order_and_follows_settings() {
        let a = plans(
            "[classes.A]\nholds = [{ name = \"o:{args[0]}\" }, { name = \"x\", when = \"start\" }]\n\
             [classes.B]\nlock = false\n",
        );
        let b = plans(
            "[classes.B]\nlock = false\n[classes.A]\n\
             holds = [ { name = 'o:{args[0]}', when = 'enqueue' }, {name='x',when='start'} ]\n",
        );
        let pa = publish_all(&a);
        assert_eq!(pa, publish_all(&b));
        let fields: Vec<&str> = pa.iter().map(|p| p.field.as_str()).collect();
        assert_eq!(fields, ["", "A", "B"]);
        let c = plans("[classes.A]\nholds = [{ name = \"o:{args[1]}\" }]\n");
        let pc = publish_all(&c);
        assert_ne!(pa[1].digest, pc[1].digest);
        assert_eq!(
            digest_of(&pa[1].json).as_deref(),
            Some(pa[1].digest.as_str())
        );
        let v: Value = serde_json::from_str(&pa[1].json).unwrap();
        assert_eq!(
            v["holds"][0]["name"],
            json!({"src": "o:{args[0]}", "parts": ["o:", ["path", 0]]})
        );
    }
}
