//! The `locketd` binary: command line, config, runtime, then the library.

use anyhow::Context;
use clap::parser::ValueSource;
use clap::{CommandFactory, FromArgMatches};
use locketd::cli::{Cli, Command};
use locketd::config::{Config, LogFormat, DEFAULT_CONFIG_PATH};
use locketd::handler::Handlers;
use locketd::logsink::LogSink;
use locketd::worker::{StopReason, Worker};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use tracing_subscriber::EnvFilter;

/// mimalloc instead of glibc's malloc: the job path allocates and frees small buffers for every
/// job (keys, arguments, replies), and glibc's malloc/free were about a quarter of a worker's CPU
/// in the multi-slot profile (docs/dev/performance-log.md, round two). Built as v2 with `no_thp`: its
/// default asks for transparent huge pages on its arena, which took a worker's RSS from 14 to
/// 28 MiB where THP is `madvise`; without the request it stays at 15.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// sysexits EX_CONFIG.
const EXIT_CONFIG: u8 = 78;
/// sysexits EX_UNAVAILABLE.
const EXIT_UNAVAILABLE: u8 = 69;

fn main() -> ExitCode {
    // Before anything reads argv: makes room for the Resque-style process title.
    let retitle = locketd::proctitle::ensure_title_space();
    // Read before any title overwrites the argv area: the master re-executes workers with them.
    let args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    let matches = Cli::command().get_matches();
    let mut cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    cli.redis_given = match matches.value_source("redis") {
        Some(ValueSource::CommandLine) => Some("given by --redis"),
        Some(ValueSource::EnvVariable) => Some("given by REDIS_URL"),
        _ => None,
    };
    // A password given with --redis must not stay readable in /proc/<pid>/cmdline (world-
    // readable) while the process connects: the title overwrites the argv area now. The
    // arguments were read above; nothing reads argv after this.
    if args
        .iter()
        .any(|a| a.as_encoded_bytes().starts_with(b"--redis"))
    {
        locketd::proctitle::set_title(&format!("{}: Starting", locketd::proctitle::title_prefix()));
    }
    match run(cli, args, retitle.err()) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("locketd: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn apply_overrides(cfg: &mut Config, cli: &Cli) {
    if let Some(r) = &cli.redis {
        cfg.redis = r.clone();
    }
    if let Some(ns) = &cli.namespace {
        cfg.namespace = ns.clone();
    }
    let queues = cli
        .queues
        .clone()
        .or_else(|| std::env::var("QUEUE").ok().filter(|q| !q.trim().is_empty()));
    if let Some(q) = queues {
        cfg.queues = locketd::config::List(
            q.split(',')
                .map(|p| p.trim().to_string())
                .filter(|p| !p.is_empty())
                .collect(),
        );
    }
    if let Some(i) = cli.interval {
        cfg.interval = locketd::config::Secs(std::time::Duration::from_secs_f64(i));
    }
    if let Some(f) = cli.log_format {
        cfg.log_format = f;
    }
    if let Some(n) = cli.workers {
        cfg.workers = n;
    }
    if let Some(k) = cli.slots {
        cfg.slots = k;
    }
    if cli.graceful_term || std::env::var("GRACEFUL_TERM").is_ok_and(|v| !v.trim().is_empty()) {
        cfg.graceful_term = true;
    }
    if let Some(t) = cli.term_timeout {
        cfg.term_timeout = locketd::config::Secs(std::time::Duration::from_secs_f64(t));
    }
    if let Some(m) = &cli.metrics {
        cfg.metrics = Some(m.clone());
        cfg.http = None;
    }
    if let Some(h) = &cli.http {
        cfg.http = Some(h.clone());
        // The flag names the listener: a `metrics` address of the file gives way to it.
        cfg.metrics = None;
    }
}

/// Flushes the log queue (bounded) when `run` returns, so the last lines are written.
struct FlushLogs(LogSink);

impl Drop for FlushLogs {
    fn drop(&mut self) {
        self.0.flush(std::time::Duration::from_secs(2));
    }
}

fn init_logging(cfg: &Config) -> FlushLogs {
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(&cfg.log_level))
        .unwrap_or_else(|_| EnvFilter::new("info"));
    // Lines go through a queue written by a thread of its own (src/logsink.rs): a stderr that
    // is not read (a stalled journald, a full pipe) drops lines instead of blocking the
    // runtime that extends locks. A line that cannot be written at all (a reader gone: a dead
    // log shipper, `| head`) is dropped too; tracing's own eprintln! report of it would panic
    // on that same broken pipe, hence log_internal_errors(false).
    let json = cfg.log_format == LogFormat::Json;
    let sink = LogSink::start(std::io::stderr(), json);
    // One event per write: the text format keeps each event on one line (it escapes the
    // newlines inside an event, src/logline.rs) before the event is queued, and the queue's
    // thread writes several events at once.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(sink.clone())
        .log_internal_errors(false);
    match cfg.log_format {
        LogFormat::Json => builder
            .with_timer(locketd::logsink::LogClock)
            .json()
            .flatten_event(true)
            .init(),
        LogFormat::Text => builder
            .with_ansi(false)
            .event_format(locketd::logline::TextFormat::default())
            .init(),
    }
    FlushLogs(sink)
}

/// `check-config`: how the class plans published in Redis (D-3a) differ from this file's, as
/// warnings; nothing when Redis is out of reach from here (the file is still valid).
fn show_published_plans(cfg: &Config) {
    let Ok(plans) = locketd::config::plans::Plans::compile(cfg) else {
        return;
    };
    let Ok(rt) = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    else {
        return;
    };
    let keys = locketd::resque::keys::Keys::new(&cfg.namespace);
    let found = rt.block_on(async {
        let mut conn = locketd::conn::connect(&cfg.redis, std::time::Duration::ZERO)
            .await
            .ok()?;
        locketd::store::plans::compare(&mut conn, &keys, &plans)
            .await
            .ok()
    });
    let found = found.unwrap_or_default();
    // Before any daemon published, every class is "not published": nothing to say.
    let any = found
        .iter()
        .any(|d| !matches!(d, locketd::store::plans::Difference::NotPublished { .. }));
    for d in found.iter().filter(|_| any) {
        eprintln!("locketd: warning: plans: {d}");
    }
}

/// `check-config` with a `redis+sentinel://` URL: the primary its sentinels name now, or why
/// none (a warning: the file is still valid, and the sentinels may be out of reach from here).
fn show_sentinel_primary(url: &str) {
    let Ok(rt) = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    else {
        return;
    };
    match rt.block_on(locketd::conn::sentinel_primary(url)) {
        None => {}
        Some(Ok(primary)) => println!(
            "redis: the sentinels of {} name the primary {primary}",
            locketd::conn::redact(url)
        ),
        Some(Err(e)) => eprintln!(
            "locketd: warning: redis: no primary from the sentinels of {}: {e}",
            locketd::conn::redact(url)
        ),
    }
}

fn run(
    cli: Cli,
    args: Vec<std::ffi::OsString>,
    retitle_error: Option<std::io::Error>,
) -> anyhow::Result<ExitCode> {
    if let Some(Command::Config(cmd)) = &cli.command {
        return Ok(cmd.run());
    }
    if let Some(Command::CheckConfig { file }) = &cli.command {
        let path = file.clone().or_else(|| cli.config.clone());
        let path = path.unwrap_or_else(|| PathBuf::from(DEFAULT_CONFIG_PATH));
        let mut cfg = match Config::load(&path) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("locketd: {e}");
                return Ok(ExitCode::from(EXIT_CONFIG));
            }
        };
        apply_overrides(&mut cfg, &cli);
        return Ok(match cfg.check() {
            Ok(warnings) => {
                for w in warnings {
                    eprintln!("locketd: warning: {w}");
                }
                show_sentinel_primary(&cfg.redis);
                show_published_plans(&cfg);
                println!("{}: ok", path.display());
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("locketd: {}: {e}", path.display());
                ExitCode::from(EXIT_CONFIG)
            }
        });
    }

    if let Some(Command::Status { json, watch, count }) = &cli.command {
        let cfg = match load_for_ops(&cli) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("locketd: {e}");
                return Ok(ExitCode::from(EXIT_CONFIG));
            }
        };
        return locketd::ops::status::run_cli(&cfg, *json, *watch, *count);
    }
    if let Some(Command::Failed(args)) = &cli.command {
        let cfg = match load_for_ops(&cli) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("locketd: {e}");
                return Ok(ExitCode::from(EXIT_CONFIG));
            }
        };
        return locketd::ops::failed::run_cli(&cfg, args);
    }

    if let Some(Command::Why(args)) = &cli.command {
        return match load_for_ops(&cli) {
            Ok(cfg) => locketd::admin::why::run_cli(&cfg, args),
            Err(e) => {
                eprintln!("locketd: {e}");
                Ok(ExitCode::from(EXIT_CONFIG))
            }
        };
    }
    if let Some(Command::Admin(cmd)) = &cli.command {
        let cfg = match load_for_ops(&cli) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("locketd: {e}");
                return Ok(ExitCode::from(EXIT_CONFIG));
            }
        };
        return locketd::admin::run(cmd, &cfg);
    }

    let worker_role = std::env::var(locketd::process::ROLE_ENV).is_ok_and(|r| r == "worker");
    let loaded = if worker_role {
        // The master validated this text and sends it on stdin.
        let mut text = String::new();
        use std::io::Read;
        if let Err(e) = std::io::stdin()
            // One byte more than allowed, so a text cut at the limit is refused, not run
            // without its tail.
            .take(locketd::master::MAX_CONFIG_BYTES + 1)
            .read_to_string(&mut text)
        {
            eprintln!("locketd: worker: reading the config from the master: {e}");
            return Ok(ExitCode::from(EXIT_CONFIG));
        }
        load_text(&text, "config from the master", &cli)
    } else {
        load_effective(&cli)
    };
    let (loaded, warnings) = match loaded {
        Ok(x) => x,
        Err(e) => {
            eprintln!("locketd: {e}");
            return Ok(ExitCode::from(EXIT_CONFIG));
        }
    };
    let cfg = loaded.config.clone();
    // Dropped last in run(), after the runtime: the final lines are flushed (bounded).
    let _logs = init_logging(&cfg);
    if !worker_role {
        for w in warnings {
            tracing::warn!("{w}");
        }
    }
    if let Some(e) = retitle_error {
        tracing::warn!(error = %e, "cannot set a Resque-style process title; co-located Ruby workers may prune this worker");
    }

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("building the async runtime")?;
    if !worker_role {
        return runtime.block_on(run_master(cli, args, loaded));
    }
    runtime.block_on(async move {
        let control = locketd::worker::signals::install(cfg.graceful_term)
            .context("installing signal handlers")?;
        let handlers = Handlers::from_config(&cfg);
        let worker = match Worker::start(cfg, handlers).await {
            Ok(w) => w,
            Err(e) => return start_error(e),
        };
        // The master reads these snapshots (LOCKETD_METRICS_FD) and serves /metrics.
        let reporter =
            locketd::metrics::spawn_reporter(&worker.metrics(), std::time::Duration::from_secs(1));
        let reason = worker.run(control).await?;
        if let Some(r) = reporter {
            r.flush();
        }
        Ok(match reason {
            StopReason::Shutdown | StopReason::Drained => ExitCode::SUCCESS,
            StopReason::PresumedDead => ExitCode::from(3),
        })
    })
}

/// Exit code for an error at start (69 Redis unreachable, 78 config or a Redis that refused us:
/// a wrong password or TLS setting, which a restart cannot fix), or the error itself.
fn start_error(e: locketd::Error) -> anyhow::Result<ExitCode> {
    match e {
        locketd::Error::Unreachable {
            ref source,
            refused,
            ..
        } => {
            // The redis error once: its own text already holds its io cause, which the
            // alternate chain would print a second time.
            tracing::error!("{e}: {source}");
            Ok(ExitCode::from(if refused {
                EXIT_CONFIG
            } else {
                EXIT_UNAVAILABLE
            }))
        }
        e @ (locketd::Error::Config(_)
        | locketd::Error::Queues(_)
        | locketd::Error::EvictingRedis(_)) => {
            tracing::error!("{:#}", anyhow::Error::from(e));
            Ok(ExitCode::from(EXIT_CONFIG))
        }
        e => Err(anyhow::Error::from(e).context("starting the worker")),
    }
}

/// The config for `status` and `failed`: parsed with the command line applied, not checked
/// (they need only the Redis URL and namespace).
fn load_for_ops(cli: &Cli) -> Result<Config, String> {
    let mut config = match config_path(cli) {
        None => Config::default(),
        Some(p) => Config::load(&p).map_err(|e| e.to_string())?,
    };
    apply_overrides(&mut config, cli);
    Ok(config)
}

/// Parses config text, applies the command line and checks the result.
fn load_text(
    text: &str,
    origin: &str,
    cli: &Cli,
) -> Result<(locketd::master::Loaded, Vec<String>), String> {
    let mut config = if text.is_empty() {
        Config::default()
    } else {
        Config::parse(text, origin).map_err(|e| e.to_string())?
    };
    apply_overrides(&mut config, cli);
    let warnings = config.check().map_err(|e| format!("{origin}: {e}"))?;
    Ok((
        locketd::master::Loaded {
            config,
            text: text.to_string(),
        },
        warnings,
    ))
}

/// The config file named by --config, else /etc/locketd/locketd.toml if present.
fn config_path(cli: &Cli) -> Option<PathBuf> {
    match &cli.config {
        Some(p) => Some(p.clone()),
        None if Path::new(DEFAULT_CONFIG_PATH).exists() => Some(PathBuf::from(DEFAULT_CONFIG_PATH)),
        None => None,
    }
}

/// Where the Redis URL in use came from (issue 29 item 5): the flag, `REDIS_URL`, the config
/// file `text` (when it sets `redis`), or the default.
fn redis_from(cli: &Cli, text: &str) -> String {
    if let Some(given) = cli.redis_given {
        return given.to_string();
    }
    let in_file = text
        .parse::<toml::Table>()
        .is_ok_and(|t| t.contains_key("redis"));
    match config_path(cli) {
        Some(p) if in_file => format!("set by `redis` in {}", p.display()),
        _ => "the default: no --redis, REDIS_URL or `redis` in a config".to_string(),
    }
}

/// The config file named by --config, else /etc/locketd/locketd.toml if present, else defaults.
fn load_effective(cli: &Cli) -> Result<(locketd::master::Loaded, Vec<String>), String> {
    match config_path(cli) {
        None => load_text("", "command line", cli),
        Some(p) => {
            let text = std::fs::read_to_string(&p).map_err(|e| {
                locketd::config::ConfigError::Read {
                    path: p.clone(),
                    source: e,
                }
                .to_string()
            })?;
            load_text(&text, &p.display().to_string(), cli)
        }
    }
}

async fn run_master(
    cli: Cli,
    args: Vec<std::ffi::OsString>,
    loaded: locketd::master::Loaded,
) -> anyhow::Result<ExitCode> {
    let cfg = &loaded.config;
    // Fail fast, before any worker starts: Redis must answer (69), accept our password (78)
    // and not evict (78).
    let from = redis_from(&cli, &loaded.text);
    match locketd::conn::connect_from(&cfg.redis, Some(&from), cfg.redis_connect_timeout.get())
        .await
    {
        Ok(mut conn) => {
            if let Err(e) =
                locketd::conn::check_eviction(&mut conn, cfg.locket.allow_evicting_redis).await
            {
                return start_error(e);
            }
        }
        Err(e) => return start_error(e),
    }
    let loader: locketd::master::Loader =
        Box::new(move || load_effective(&cli).map(|(loaded, _)| loaded));
    let master =
        locketd::master::Master::new(args, loader, loaded).context("starting the master")?;
    Ok(match master.run().await.context("running the master")? {
        locketd::master::MasterExit::SidecarsFailed => ExitCode::from(EXIT_CONFIG),
        locketd::master::MasterExit::RedisUnavailable => ExitCode::from(EXIT_UNAVAILABLE),
        _ => ExitCode::SUCCESS,
    })
}

#[cfg(test)]
mod tests {
    use super::{redis_from, Cli};
    use clap::Parser;

    // Issue 29 item 5: the origin named when no Redis answers. The flag and REDIS_URL cases
    // run through the binary (tests/it/first_run.rs); the default cannot (it is port 6379).
    #[test]
    fn the_redis_url_origin_is_the_file_only_when_it_sets_redis() {
        let mut cli = Cli::try_parse_from(["locketd", "--config", "/x/l.toml"]).unwrap();
        cli.redis_given = None;
        assert_eq!(
            redis_from(&cli, "queues = \"q\"\n"),
            "the default: no --redis, REDIS_URL or `redis` in a config"
        );
        assert_eq!(
            redis_from(&cli, "redis = \"redis://h:1/0\"\n"),
            "set by `redis` in /x/l.toml"
        );
        cli.redis_given = Some("given by REDIS_URL");
        assert_eq!(
            redis_from(&cli, "redis = \"redis://h:1/0\"\n"),
            "given by REDIS_URL"
        );
    }
}
