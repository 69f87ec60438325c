//! `locketd pause` and `locketd resume` (locking-semantics.md A-20): resque-pause's keys,
//! `<ns>:pause:queue:<q>` and `<ns>:pause:all`, set and deleted in one atomic step that
//! refuses a key of another type before any write.

use super::Admin;
use crate::store;
use clap::Args;
use std::process::ExitCode;

/// `locketd pause QUEUE…|--all` and `locketd resume QUEUE…|--all`.
#[derive(Args, Debug, Clone)]
#[command(group(clap::ArgGroup::new("which").required(true).args(["queues", "all"])))]
pub struct PauseArgs {
    /// The queues (names, not keys).
    #[arg(value_name = "QUEUE", value_parser = super::queue_name)]
    pub queues: Vec<String>,
    /// Every queue: `<ns>:pause:all` (one queue's own key is kept by a resume --all).
    #[arg(long)]
    pub all: bool,
}

impl PauseArgs {
    fn target(&self) -> Option<&[String]> {
        (!self.all).then_some(self.queues.as_slice())
    }

    fn what(&self) -> String {
        if self.all {
            "every queue".into()
        } else {
            self.queues.join(", ")
        }
    }
}

impl Admin {
    pub(super) async fn pause(&mut self, a: &PauseArgs, on: bool) -> anyhow::Result<ExitCode> {
        let changed = store::set_paused(&mut self.conn, &self.keys, a.target(), on).await?;
        let (verb, already) = if on {
            ("paused", "already paused")
        } else {
            ("resumed", "not paused")
        };
        tracing::info!(queues = %a.what(), changed, "{verb} by an operator");
        if changed == 0 {
            println!("{}: {already}", a.what());
        } else {
            println!("{verb} {}", a.what());
        }
        if !on && !a.all {
            let all = store::pause_states(&mut self.conn, &self.keys, &a.queues).await?;
            if all.contains(&store::PauseState::All) {
                println!("note: every queue is still paused (locketd resume --all)");
            }
        }
        Ok(ExitCode::SUCCESS)
    }
}
