//! The `locketd` binary: command line, config, runtime, then the library.

use anyhow::Context;
use clap::{Parser, Subcommand};
use locketd::config::{Config, ConfigError, LogFormat, DEFAULT_CONFIG_PATH};
use locketd::handler::Handlers;
use locketd::worker::{StopReason, Worker};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use tracing_subscriber::EnvFilter;

/// sysexits EX_CONFIG.
const EXIT_CONFIG: u8 = 78;
/// sysexits EX_UNAVAILABLE.
const EXIT_UNAVAILABLE: u8 = 69;

#[derive(Parser, Debug)]
#[command(
    name = "locketd",
    version,
    about = "Resque-compatible job worker with locket job locks"
)]
struct Cli {
    /// Config file (default /etc/locketd/locketd.toml when present).
    #[arg(long, global = true, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Redis URL: redis://[:password@]host:port/db, rediss:// for TLS.
    #[arg(long, env = "REDIS_URL", value_name = "URL")]
    redis: Option<String>,
    /// Resque namespace (key prefix).
    #[arg(long, value_name = "NS")]
    namespace: Option<String>,
    /// Queues in priority order, Resque's syntax: "high,low", "*", "critical,*,!low".
    #[arg(long, env = "QUEUES", value_name = "LIST")]
    queues: Option<String>,
    /// Seconds to sleep when no job was found (Resque's INTERVAL); 0 drains and exits.
    #[arg(long, env = "INTERVAL", value_name = "SECS")]
    interval: Option<f64>,
    /// Log format.
    #[arg(long, value_enum, value_name = "FORMAT")]
    log_format: Option<LogFormat>,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Validate a config file and exit (non-zero with a message naming the bad setting).
    CheckConfig {
        /// The file (default: --config, then /etc/locketd/locketd.toml).
        file: Option<PathBuf>,
    },
    /// Operator commands: enqueue, locks, counters, holds, delayed, stats (src/admin.rs).
    #[command(flatten)]
    Admin(locketd::admin::AdminCommand),
}

fn main() -> ExitCode {
    // Before anything reads argv: makes room for the Resque-style process title.
    let retitle = locketd::proctitle::ensure_title_space();
    let cli = Cli::parse();
    match run(cli, retitle.err()) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("locketd: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn load_config(path: Option<&Path>) -> Result<Config, ConfigError> {
    match path {
        Some(p) => Config::load(p),
        None if Path::new(DEFAULT_CONFIG_PATH).exists() => {
            Config::load(Path::new(DEFAULT_CONFIG_PATH))
        }
        None => Ok(Config::default()),
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
        if i.is_finite() && i >= 0.0 {
            cfg.interval = locketd::config::Secs(std::time::Duration::from_secs_f64(i));
        }
    }
    if let Some(f) = cli.log_format {
        cfg.log_format = f;
    }
}

fn init_logging(cfg: &Config) {
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(&cfg.log_level))
        .unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match cfg.log_format {
        LogFormat::Json => builder.json().flatten_event(true).init(),
        LogFormat::Text => builder.with_ansi(false).init(),
    }
}

fn run(cli: Cli, retitle_error: Option<std::io::Error>) -> anyhow::Result<ExitCode> {
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
                println!("{}: ok", path.display());
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("locketd: {}: {e}", path.display());
                ExitCode::from(EXIT_CONFIG)
            }
        });
    }

    let mut cfg = match load_config(cli.config.as_deref()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("locketd: {e}");
            return Ok(ExitCode::from(EXIT_CONFIG));
        }
    };
    apply_overrides(&mut cfg, &cli);
    if let Some(Command::Admin(cmd)) = &cli.command {
        return locketd::admin::run(cmd, &cfg);
    }
    let warnings = match cfg.check() {
        Ok(w) => w,
        Err(e) => {
            eprintln!("locketd: {e}");
            return Ok(ExitCode::from(EXIT_CONFIG));
        }
    };
    init_logging(&cfg);
    for w in warnings {
        tracing::warn!("{w}");
    }
    if let Some(e) = retitle_error {
        tracing::warn!(error = %e, "cannot set a Resque-style process title; co-located Ruby workers may prune this worker");
    }

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("building the async runtime")?;
    runtime.block_on(async move {
        let control = locketd::shutdown::install().context("installing signal handlers")?;
        let handlers = Handlers::from_config(&cfg);
        let worker = match Worker::start(cfg, handlers).await {
            Ok(w) => w,
            Err(e @ locketd::Error::Unreachable { .. }) => {
                tracing::error!("{:#}", anyhow::Error::from(e));
                return Ok(ExitCode::from(EXIT_UNAVAILABLE));
            }
            Err(
                e @ (locketd::Error::Config(_)
                | locketd::Error::Queues(_)
                | locketd::Error::EvictingRedis(_)),
            ) => {
                tracing::error!("{:#}", anyhow::Error::from(e));
                return Ok(ExitCode::from(EXIT_CONFIG));
            }
            Err(e) => return Err(anyhow::Error::from(e).context("starting the worker")),
        };
        let reason = worker.run(control).await?;
        Ok(match reason {
            StopReason::Shutdown | StopReason::Drained => ExitCode::SUCCESS,
            StopReason::PresumedDead => ExitCode::from(3),
        })
    })
}
