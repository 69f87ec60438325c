//! A worker whose handlers are Rust closures running in-process, instead of commands.
//!
//! ```sh
//! cargo run --example in_process -- redis://127.0.0.1:6379/0 high,low
//! redis-cli RPUSH resque:queue:high '{"class":"Greet","args":["world"]}'
//! ```
//! QUIT, TERM or Ctrl-C stop it after the running job.

use locketd::config::Config;
use locketd::handler::{Handlers, JobContext};
use locketd::resque::failure::JobFailure;
use locketd::worker::Worker;

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt().with_env_filter("info").init();
    let mut args = std::env::args().skip(1);
    let redis = args
        .next()
        .unwrap_or_else(|| "redis://127.0.0.1:6379/0".into());
    let queues = args.next().unwrap_or_else(|| "high,low".into());

    let mut config = Config::parse(&format!("queues = {queues:?}\ninterval = 1"), "example")?;
    config.redis = redis;

    let mut handlers = Handlers::new();
    handlers.insert("Greet", |job: JobContext| async move {
        let who = job.args.get(0).and_then(|v| v.as_str()).unwrap_or("nobody");
        println!("hello, {who} (lock {:?})", job.lock_keys);
        Ok(())
    });
    handlers.insert("Divide", |job: JobContext| async move {
        let a = job.args.get(0).and_then(|v| v.as_f64()).unwrap_or(0.0);
        let b = job.args.get(1).and_then(|v| v.as_f64()).unwrap_or(0.0);
        if b == 0.0 {
            // Shows up in resque-web's Failed tab as ZeroDivisionError, retryable from there.
            return Err(JobFailure::new("ZeroDivisionError", "divided by 0"));
        }
        println!("{a} / {b} = {}", a / b);
        Ok(())
    });

    let control = locketd::worker::signals::install(false)?;
    let worker = Worker::start(config, handlers).await?;
    let reason = worker.run(control).await?;
    println!("stopped: {reason:?}");
    Ok(())
}
