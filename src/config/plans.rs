//! Per-class locking plans (locking-semantics.md §3, §4, §6, §8): which locks a job takes and
//! with what limit, what happens on a conflict, which dependency holds it places and waits for.
//!
//! The TOML shapes live here ([`LockSetting`], [`LockEntry`], [`HoldEntry`]; the conflict
//! [`Policy`] is the lock model's); the
//! configuration is compiled once at start-up into [`Plans`] with every template parsed (T-7)
//! and every C-1 check made, so a job only renders.

use super::{ClassConfig, Config, ConfigError, Secs};
use crate::locks::template::{RenderError, RenderInput, Template, DEFAULT_TEMPLATE};
use crate::locks::{DelaySettings, LockSpec, Policy};
use serde::Deserialize;
use std::collections::HashMap;
use std::time::Duration;

/// `lock = false | true | "template"`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum LockSetting {
    /// `false`: no execution lock; `true`: the default lock.
    Enabled(bool),
    /// A key template.
    Template(String),
}

/// One entry of `locks = [...]`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LockEntry {
    /// Key template.
    pub key: String,
    /// Most live holders, default 1.
    #[serde(default = "one")]
    pub limit: u32,
}

fn one() -> u32 {
    1
}

/// When a hold is placed (§8).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HoldWhen {
    /// By the ENQUEUE script, with the push (D-3); also ensured at start (D-4).
    #[default]
    Enqueue,
    /// In ACQUIRE's success branch (D-9).
    Start,
}

/// When a hold is released (D-7).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReleaseOn {
    /// Only when the job succeeds.
    #[default]
    Success,
    /// Whatever the outcome.
    Completion,
}

/// One entry of `holds = [...]`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HoldEntry {
    /// Hold name template.
    pub name: String,
    /// `enqueue` (default) or `start`.
    #[serde(default)]
    pub when: HoldWhen,
    /// `success` (default) or `completion`.
    #[serde(default)]
    pub release_on: ReleaseOn,
}

/// One hold of a class, template parsed.
#[derive(Debug, Clone)]
pub struct HoldPlan {
    /// Name template.
    pub name: Template,
    /// When placed.
    pub when: HoldWhen,
    /// When released.
    pub release_on: ReleaseOn,
}

/// Everything locketd needs to lock, check and settle one class's jobs.
#[derive(Debug, Clone)]
pub struct ClassPlan {
    /// Execution locks when the class is locked; empty = unlocked.
    pub locks: Vec<(Template, u32)>,
    /// Policy for execution-lock conflicts.
    pub on_conflict: Policy,
    /// Policy for `locked_by` conflicts.
    pub on_dependency_conflict: Policy,
    /// Bound of `wait`.
    pub wait_timeout: Duration,
    /// After a timed-out wait.
    pub wait_then: Policy,
    /// Backoff of `delay`.
    pub delay: DelaySettings,
    /// Fencing numbers (L-10).
    pub fencing: bool,
    /// Hold lifetime.
    pub hold_ttl: Duration,
    /// Holds placed.
    pub holds: Vec<HoldPlan>,
    /// Hold names waited for.
    pub locked_by: Vec<Template>,
    /// Most jobs parked on one resource (PK-7).
    pub max_parked: u64,
    /// The policy when the parked list is full (PK-7).
    pub on_park_full: Policy,
    /// Keyed rate limits, all must allow a start (rate-limits.md RL-1).
    pub rates: Vec<super::rates::RatePlan>,
    /// Unique jobs at enqueue (U-1).
    pub unique: Option<UniquePlan>,
}

/// A unique policy (U-1..U-4): how long a push refuses a duplicate with the same `unique_key`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UniquePolicy {
    /// For `unique_ttl` after the push that took the key, whatever the job does (U-1).
    UntilExpired,
    /// While the job waits (queued, delayed, parked, reserved): released when it starts (U-2).
    UntilExecuting,
    /// While it waits or runs: released when it ends, succeeded or failed (U-3).
    UntilExecuted,
}

impl UniquePolicy {
    /// The configuration's and the published plan's word.
    pub fn word(self) -> &'static str {
        match self {
            UniquePolicy::UntilExpired => "until_expired",
            UniquePolicy::UntilExecuting => "until_executing",
            UniquePolicy::UntilExecuted => "until_executed",
        }
    }

    /// True for the policies whose entry follows the job's life (U-2..U-4).
    pub fn follows_job(self) -> bool {
        self != UniquePolicy::UntilExpired
    }
}

/// `unique` (U-1..U-4): a push whose rendered `key` is taken is not made.
#[derive(Debug, Clone)]
pub struct UniquePlan {
    /// The policy.
    pub policy: UniquePolicy,
    /// The key template.
    pub key: Template,
    /// The entry's lifetime: required for `until_expired`; for the other two an optional
    /// backstop for entries whose job a foreign tool removed (U-4); `None` = no expiry.
    pub ttl: Option<Duration>,
}

/// A class plan rendered for one payload.
#[derive(Debug, Clone, Default)]
pub struct RenderedPlan {
    /// Execution locks (empty when unlocked).
    pub locks: Vec<LockSpec>,
    /// Full rendered text of each lock id, for `lockinfo.lock_id_source` (T-5).
    pub lock_sources: Vec<String>,
    /// `locked_by` names.
    pub locked_by: Vec<String>,
    /// Holds placed at enqueue (ensured at start).
    pub enqueue_holds: Vec<String>,
    /// Holds placed at start.
    pub start_holds: Vec<String>,
    /// Holds released on success only.
    pub release_on_success: Vec<String>,
    /// Holds released on any outcome.
    pub release_on_completion: Vec<String>,
    /// Rate limits (RL-1), whether or not the class is locked.
    pub rates: Vec<crate::locks::RateSpec>,
}

impl RenderedPlan {
    /// The holds FINISH releases for an outcome (D-7).
    pub fn releases(&self, success: bool) -> Vec<String> {
        let mut out = self.release_on_completion.clone();
        if success {
            out.extend(self.release_on_success.iter().cloned());
        }
        out
    }
}

impl ClassPlan {
    /// Renders every template for one payload; `locked` says whether the execution locks apply
    /// (class setting and `lock_queues`).
    pub fn render(
        &self,
        input: &RenderInput<'_>,
        locked: bool,
    ) -> Result<RenderedPlan, RenderError> {
        let mut out = RenderedPlan::default();
        if locked {
            for (t, limit) in &self.locks {
                let r = t.render(input)?;
                // The same id twice in one job would count its own token twice: keep one.
                if !out.locks.iter().any(|l| l.id == r.id) {
                    out.locks.push(LockSpec {
                        id: r.id,
                        limit: *limit,
                    });
                    out.lock_sources.push(r.source);
                }
            }
        }
        for r in &self.rates {
            let spec = r.render(input)?;
            // One key named twice counts once (its strictest entry would be ambiguous: keep
            // the first).
            if !out.rates.iter().any(|x| x.key == spec.key) {
                out.rates.push(spec);
            }
        }
        for t in &self.locked_by {
            let id = t.render(input)?.id;
            if !out.locked_by.contains(&id) {
                out.locked_by.push(id);
            }
        }
        for h in &self.holds {
            let id = h.name.render(input)?.id;
            match h.when {
                HoldWhen::Enqueue => out.enqueue_holds.push(id.clone()),
                HoldWhen::Start => out.start_holds.push(id.clone()),
            }
            match h.release_on {
                ReleaseOn::Success => out.release_on_success.push(id),
                ReleaseOn::Completion => out.release_on_completion.push(id),
            }
        }
        Ok(out)
    }

    /// The policy for a conflict: the dependency policy when a `locked_by` name conflicted
    /// (§6: it wins when both kinds meet), else the lock policy.
    pub fn policy_for(&self, dependency: bool) -> Policy {
        if dependency {
            self.on_dependency_conflict
        } else {
            self.on_conflict
        }
    }

    /// True when the class places or waits for holds (A-5 "dependency checks").
    pub fn has_dependencies(&self) -> bool {
        !self.holds.is_empty() || !self.locked_by.is_empty()
    }
}

/// Every class's plan, compiled from the configuration.
#[derive(Debug, Clone)]
pub struct Plans {
    classes: HashMap<String, ClassPlan>,
    default: ClassPlan,
}

fn invalid(setting: &str, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        setting: setting.to_string(),
        message: message.into(),
    }
}

fn template(setting: &str, text: &str) -> Result<Template, ConfigError> {
    Template::parse(text).map_err(|e| invalid(setting, format!("template {text:?}: {e}")))
}

fn limit(setting: &str, n: u32) -> Result<u32, ConfigError> {
    if n < 1 {
        return Err(invalid(setting, "limit must be at least 1"));
    }
    Ok(n)
}

impl Plans {
    /// Compiles and checks (C-1) every class plan.
    pub fn compile(config: &Config) -> Result<Plans, ConfigError> {
        let default = compile_class(config, "locket", None)?;
        let mut classes = HashMap::new();
        for (name, class) in &config.classes {
            let setting = format!("classes.{name:?}");
            classes.insert(name.clone(), compile_class(config, &setting, Some(class))?);
        }
        check_shared_rate_keys(&classes)?;
        Ok(Plans { classes, default })
    }

    /// Every plan with the name it is published under (D-3a): each class table by its name
    /// (`*` included), and the `[locket]` defaults as `""`.
    pub fn fields(&self) -> impl Iterator<Item = (&str, &ClassPlan)> {
        std::iter::once(("", &self.default))
            .chain(self.classes.iter().map(|(k, v)| (k.as_str(), v)))
    }

    /// True when some plan has a unique policy that follows the job (U-2..U-4).
    pub fn any_unique_follows_job(&self) -> bool {
        self.fields()
            .any(|(_, p)| p.unique.as_ref().is_some_and(|u| u.policy.follows_job()))
    }

    /// The plan of a class: its own table, else the `"*"` fallback table, else the `[locket]`
    /// defaults. Tables do not merge: a class with a table of its own takes nothing from `"*"`.
    pub fn get(&self, class: &str) -> &ClassPlan {
        self.classes
            .get(class)
            .or_else(|| self.classes.get("*"))
            .unwrap_or(&self.default)
    }
}

/// RL-1 across classes: a rate key's log keeps the starts of the period (and at most the
/// limit) of the class that writes it, so two classes that give one key template different
/// periods would let the shorter one's start drop the starts the longer one still counts (and
/// end the log after the shorter period), and limits on both sides of 256 keep the key's
/// starts in two logs that do not see each other (src/store/lua/rate.lua). Both are refused,
/// naming the two classes. (Templates are compared as written: two different templates that
/// render one key for some jobs are not seen here; docs/guide/rate-limits.md says so.)
fn check_shared_rate_keys(classes: &HashMap<String, ClassPlan>) -> Result<(), ConfigError> {
    let mut names: Vec<&String> = classes.keys().collect();
    names.sort();
    let mut seen: HashMap<&str, (&str, &super::rates::RatePlan)> = HashMap::new();
    for name in names {
        for r in &classes[name].rates {
            let key = r.key.source();
            let Some((other, first)) = seen.get(key) else {
                seen.insert(key, (name, r));
                continue;
            };
            if *other == name.as_str() {
                continue;
            }
            let big = super::rates::RATE_STRING_MAX;
            let problem = if first.period != r.period {
                format!(
                    "rate key {key:?} has period {:?} here and {:?} in class {other:?}: a start \
                     of the shorter period drops the starts the longer one still counts, so its \
                     limit could be exceeded; give one key one period (or use two keys)",
                    r.period, first.period
                )
            } else if (first.limit > big) != (r.limit > big) {
                format!(
                    "rate key {key:?} has limit {} here and {} in class {other:?}: limits up to \
                     {big} and above it keep their starts in two logs that do not see each \
                     other; give both limits on the same side of {big}",
                    r.limit, first.limit
                )
            } else {
                continue;
            };
            return Err(invalid(&format!("classes.{name:?}"), problem));
        }
    }
    Ok(())
}

/// U-1..U-4: `unique`, `unique_ttl`, `unique_key`. `unique_ttl` is required for
/// `until_expired` (the key lives only by it) and optional for the two policies that follow the
/// job, where it is a backstop lifetime for entries whose job a foreign tool removed.
fn compile_unique(setting: &str, c: &ClassConfig) -> Result<Option<UniquePlan>, ConfigError> {
    let Some(word) = &c.unique else {
        if c.unique_ttl.is_some() || c.unique_key.is_some() {
            return Err(invalid(
                &format!("{setting}.unique"),
                "unique_ttl and unique_key need `unique` (\"until_expired\", \"until_executing\" \
                 or \"until_executed\")",
            ));
        }
        return Ok(None);
    };
    let policy = match word.as_str() {
        "until_expired" => UniquePolicy::UntilExpired,
        "until_executing" => UniquePolicy::UntilExecuting,
        "until_executed" => UniquePolicy::UntilExecuted,
        other => {
            return Err(invalid(
                &format!("{setting}.unique"),
                format!(
                    "{other:?} is not a unique policy (use \"until_expired\", \
                     \"until_executing\" or \"until_executed\")"
                ),
            ))
        }
    };
    let ttl = match c.unique_ttl.map(Secs::get) {
        Some(d) if d.as_millis() < 1 => {
            return Err(invalid(
                &format!("{setting}.unique_ttl"),
                "must be at least 1ms",
            ))
        }
        Some(d) => Some(d),
        None if policy == UniquePolicy::UntilExpired => {
            return Err(invalid(
                &format!("{setting}.unique_ttl"),
                "is required with unique = \"until_expired\" (at least 1ms)",
            ))
        }
        None => None,
    };
    let text = c.unique_key.as_deref().unwrap_or(DEFAULT_TEMPLATE);
    Ok(Some(UniquePlan {
        policy,
        key: template(&format!("{setting}.unique_key"), text)?,
        ttl,
    }))
}

fn compile_class(
    config: &Config,
    setting: &str,
    class: Option<&ClassConfig>,
) -> Result<ClassPlan, ConfigError> {
    let l = &config.locket;
    let c = class.cloned().unwrap_or_default();
    let or = |o: Option<Secs>, d: Secs| o.unwrap_or(d).get();
    let class_limit = limit(&format!("{setting}.limit"), c.limit.unwrap_or(1))?;
    let default_lock = || -> Result<Vec<(Template, u32)>, ConfigError> {
        Ok(vec![(template(setting, DEFAULT_TEMPLATE)?, class_limit)])
    };
    let locks = match (&c.lock, &c.locks) {
        (Some(LockSetting::Template(_)), Some(_)) => {
            return Err(invalid(
                &format!("{setting}.locks"),
                "give either `lock = \"template\"` or `locks = [...]`, not both",
            ))
        }
        (Some(LockSetting::Enabled(false)), _) => Vec::new(),
        (_, Some(entries)) => {
            if entries.is_empty() {
                return Err(invalid(
                    &format!("{setting}.locks"),
                    "is empty (use `lock = false` to opt out)",
                ));
            }
            let mut out = Vec::new();
            for (i, e) in entries.iter().enumerate() {
                let s = format!("{setting}.locks[{i}]");
                out.push((template(&s, &e.key)?, limit(&s, e.limit)?));
            }
            out
        }
        (Some(LockSetting::Template(t)), None) => {
            vec![(template(&format!("{setting}.lock"), t)?, class_limit)]
        }
        (Some(LockSetting::Enabled(true)), None) => default_lock()?,
        (None, None) if l.lock_all => default_lock()?,
        (None, None) => Vec::new(),
    };
    let wait_timeout = or(c.wait_timeout, l.wait_timeout);
    if wait_timeout > Duration::from_secs(60) {
        return Err(invalid(
            &format!("{setting}.wait_timeout"),
            "must be at most 60s",
        ));
    }
    let wait_then = c.wait_then.unwrap_or(l.wait_then);
    if wait_then == Policy::Wait {
        return Err(invalid(
            &format!("{setting}.wait_then"),
            "must be park, requeue, delay, discard or fail",
        ));
    }
    let delay = DelaySettings {
        base: or(c.delay_base, l.delay_base),
        max: or(c.delay_max, l.delay_max),
        jitter: c.delay_jitter.unwrap_or(l.delay_jitter),
        max_delays: c.max_delays.unwrap_or(l.max_delays),
    };
    if delay.max < delay.base {
        return Err(invalid(
            &format!("{setting}.delay_max"),
            "must not be below delay_base",
        ));
    }
    if delay.base.is_zero() {
        return Err(invalid(&format!("{setting}.delay_base"), "must be above 0"));
    }
    if !(0.0..=1.0).contains(&delay.jitter) {
        return Err(invalid(
            &format!("{setting}.delay_jitter"),
            "must be between 0 and 1",
        ));
    }
    let hold_ttl = or(c.hold_ttl, l.hold_ttl);
    if hold_ttl < Duration::from_secs(1) {
        return Err(invalid(&format!("{setting}.hold_ttl"), "is below 1s"));
    }
    let mut holds = Vec::new();
    for (i, h) in c.holds.iter().enumerate() {
        holds.push(HoldPlan {
            name: template(&format!("{setting}.holds[{i}]"), &h.name)?,
            when: h.when,
            release_on: h.release_on,
        });
    }
    let on_park_full = c.on_park_full.unwrap_or(l.on_park_full);
    if matches!(on_park_full, Policy::Park | Policy::Wait) {
        return Err(invalid(
            &format!("{setting}.on_park_full"),
            "must be requeue, delay, discard or fail",
        ));
    }
    let max_parked = c.max_parked.unwrap_or(l.max_parked);
    if max_parked == 0 {
        return Err(invalid(&format!("{setting}.max_parked"), "must be above 0"));
    }
    let mut locked_by = Vec::new();
    for (i, t) in c.locked_by.iter().enumerate() {
        locked_by.push(template(&format!("{setting}.locked_by[{i}]"), t)?);
    }
    let rates = super::rates::compile(setting, c.rate.as_ref(), c.rates.as_deref())?;
    let unique = compile_unique(setting, &c)?;
    Ok(ClassPlan {
        unique,
        rates,
        locks,
        on_conflict: c.on_conflict.unwrap_or(l.on_conflict),
        on_dependency_conflict: c.on_dependency_conflict.unwrap_or(l.on_dependency_conflict),
        wait_timeout,
        wait_then,
        delay,
        fencing: c.fencing.unwrap_or(l.fencing),
        hold_ttl,
        holds,
        locked_by,
        max_parked,
        on_park_full,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plans(text: &str) -> Result<Plans, ConfigError> {
        Plans::compile(&Config::parse(&format!("queues = \"q\"\n{text}"), "t").unwrap())
    }

    // locking-semantics.md C-1 for the policy settings
    #[test]
    fn c1_bad_policy_settings_are_rejected_by_name() {
        for (text, name) in [
            ("[classes.A]\nlimit = 0", "limit"),
            (
                "[classes.A]\nlocks = [{ key = \"x\", limit = 0 }]",
                "locks[0]",
            ),
            ("[classes.A]\nlock = \"{nope}\"", "classes.\"A\".lock"),
            ("[classes.A]\nlocked_by = [\"{args[\"]", "locked_by[0]"),
            ("[locket]\nwait_timeout = \"61s\"", "locket.wait_timeout"),
            (
                "[locket]\ndelay_base = \"10s\"\ndelay_max = \"5s\"",
                "delay_max",
            ),
            ("[classes.A]\nwait_then = \"wait\"", "wait_then"),
            (
                "[classes.A]\nlock = \"x\"\nlocks = [{ key = \"y\" }]",
                "locks",
            ),
            ("[classes.A]\ndelay_jitter = 2.0", "delay_jitter"),
        ] {
            let err = plans(text).unwrap_err().to_string();
            assert!(err.contains(name), "{text}: {err}");
        }
        let err = Config::parse("queues=\"q\"\n[classes.A]\non_conflict = \"maybe\"", "t")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("maybe") || err.contains("on_conflict"),
            "{err}"
        );
    }

    #[test]
    fn defaults_and_overrides() {
        let p = plans(
            "[classes.A]\nlock = \"u:{args[0]}\"\nlimit = 3\non_conflict = \"discard\"\n\
             [classes.B]\nlock = false\nlocked_by = [\"x\"]\n",
        )
        .unwrap();
        let a = p.get("A");
        assert_eq!(a.locks[0].0.source(), "u:{args[0]}");
        assert_eq!(a.locks[0].1, 3);
        assert_eq!(a.on_conflict, Policy::Discard);
        assert_eq!(a.on_dependency_conflict, Policy::Delay);
        assert!(p.get("B").locks.is_empty());
        assert_eq!(p.get("Other").locks[0].0.source(), DEFAULT_TEMPLATE);
        assert_eq!(p.get("Other").on_conflict, Policy::Park);
        assert_eq!(p.get("Other").wait_timeout, Duration::from_secs(5));
        let none = plans("[locket]\nlock_all = false").unwrap();
        assert!(none.get("Other").locks.is_empty());
    }

    // locking-semantics.md P-4: min(base × 2^(attempt−1), max) × (1 + r)
    #[test]
    fn delay_backoff_doubles_and_is_capped_before_jitter() {
        let d = DelaySettings {
            base: Duration::from_secs(5),
            max: Duration::from_secs(60),
            jitter: 0.2,
            max_delays: 0,
        };
        assert_eq!(d.delay(1, 0.0), Duration::from_secs(5));
        assert_eq!(d.delay(2, 0.0), Duration::from_secs(10));
        assert_eq!(d.delay(4, 0.0), Duration::from_secs(40));
        assert_eq!(d.delay(5, 0.0), Duration::from_secs(60));
        assert_eq!(d.delay(500, 0.0), Duration::from_secs(60));
        assert_eq!(d.delay(5, 0.1), Duration::from_secs(66));
    }
}
