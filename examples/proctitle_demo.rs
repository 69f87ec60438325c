//! Manual check of `locketd::proctitle`: re-executes itself with room for a title, sets the
//! title to the first argument, prints its pid and sleeps about five seconds so that the
//! title can be inspected with `ps -o pid,command -p <pid>`.
//!
//! Usage: `cargo run --example proctitle_demo -- "resque-0.1.0-locketd: Waiting for high,low"`

use std::time::Duration;

fn main() {
    if let Err(err) = locketd::proctitle::ensure_title_space() {
        eprintln!("proctitle: could not re-exec for title space: {err}");
    }
    // Arguments must be read before the first set_title overwrites them.
    let args: Vec<String> = std::env::args().collect();
    let title = args
        .get(1)
        .cloned()
        .unwrap_or_else(|| format!("{}: Waiting for demo", locketd::proctitle::title_prefix()));
    println!("argv before set_title: {args:?}");
    locketd::proctitle::set_title(&title);
    println!("pid {}", std::process::id());
    std::thread::sleep(Duration::from_secs(5));
}
