//! A quick throughput check of one worker process, against a redis-server it starts itself on
//! a free loopback port (issue 6 grows this into the full benchmark harness).
//!
//! ```sh
//! cargo run --release --example throughput -- noop 50000      # in-process no-op handler, locks on
//! cargo run --release --example throughput -- nolock 50000    # the same with lock_all = false
//! cargo run --release --example throughput -- command 10000   # /bin/true command handler
//! ```
//! Prints jobs/s, Redis commands per job and Redis CPU per job (INFO deltas).

use locketd::config::Config;
use locketd::handler::{CommandHandler, Handlers, JobContext};
use locketd::worker::{Control, Worker};
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

struct Server {
    child: Child,
    _dir: tempfile::TempDir,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_redis() -> anyhow::Result<(Server, u16)> {
    let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let dir = tempfile::tempdir()?;
    let child = Command::new("redis-server")
        .args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
        ])
        .arg("--dir")
        .arg(dir.path())
        .stdout(Stdio::null())
        .spawn()?;
    Ok((Server { child, _dir: dir }, port))
}

fn info_field(info: &str, prefix: &str, field: &str) -> f64 {
    info.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| {
            l.split([',', ':'])
                .find_map(|kv| {
                    kv.strip_prefix(field)?
                        .strip_prefix('=')?
                        .parse::<f64>()
                        .ok()
                })
                .or_else(|| l.split_once(':').and_then(|(_, v)| v.parse().ok()))
        })
        .sum()
}

async fn redis_cpu(conn: &mut redis::aio::MultiplexedConnection) -> anyhow::Result<f64> {
    let cpu: String = redis::cmd("INFO").arg("cpu").query_async(conn).await?;
    Ok(info_field(&cpu, "used_cpu_sys:", "") + info_field(&cpu, "used_cpu_user:", ""))
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let mode = args.next().unwrap_or_else(|| "noop".into());
    let n: usize = args
        .next()
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(50_000);
    let (_server, port) = start_redis()?;
    let url = format!("redis://127.0.0.1:{port}/0");
    let client = redis::Client::open(url.as_str())?;
    let mut conn = loop {
        match client.get_multiplexed_async_connection().await {
            Ok(c) => break c,
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    };
    for start in (0..n).step_by(1000) {
        let mut pipe = redis::pipe();
        for i in start..(start + 1000).min(n) {
            pipe.rpush(
                "resque:queue:q",
                format!(r#"{{"class":"Noop","args":[{i}]}}"#),
            )
            .ignore();
        }
        pipe.query_async::<()>(&mut conn).await?;
    }
    let lock_all = mode != "nolock";
    let mut config = Config::parse(
        &format!("queues = \"q\"\ninterval = 0\n[locket]\nlock_all = {lock_all}\n"),
        "throughput",
    )?;
    config.redis = url;
    config.slots = std::env::var("SLOTS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1);
    let mut handlers = Handlers::new();
    if mode == "command" {
        handlers.insert("Noop", CommandHandler::from_argv(vec!["/bin/true".into()]));
    } else {
        handlers.insert("Noop", |_job: JobContext| async move { Ok(()) });
    }
    let worker = Worker::start(config, handlers).await?;
    redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async::<()>(&mut conn)
        .await?;
    let cpu0 = redis_cpu(&mut conn).await?;
    let t = Instant::now();
    worker.run(Control::default()).await?;
    let elapsed = t.elapsed().as_secs_f64();
    let stats: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut conn)
        .await?;
    let calls = info_field(&stats, "cmdstat_", "calls");
    let cpu_s = redis_cpu(&mut conn).await? - cpu0;
    let scripts = info_field(&stats, "cmdstat_evalsha", "calls");
    let script_us = info_field(&stats, "cmdstat_evalsha", "usec");
    println!(
        "{mode}: {n} jobs in {elapsed:.2} s = {:.0} jobs/s; {:.1} scripts/job ({:.1} us each); \
         {:.1} Redis commands/job (counting those inside scripts); Redis CPU {:.0} us/job",
        n as f64 / elapsed,
        scripts / n as f64,
        script_us / scripts.max(1.0),
        calls / n as f64,
        cpu_s * 1e6 / n as f64
    );
    Ok(())
}
