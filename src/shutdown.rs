//! Signals → [`Control`]: QUIT, TERM and INT stop reserving and let the running job finish
//! (within `shutdown_timeout`); a second one stops the job at once.

use crate::worker::Control;
use futures::StreamExt;
use signal_hook::consts::signal::{SIGINT, SIGQUIT, SIGTERM};
use signal_hook_tokio::Signals;
use tracing::{info, warn};

/// Installs the handlers and returns the control they drive. Must be called inside a runtime.
pub fn install() -> std::io::Result<Control> {
    let control = Control::default();
    let mut signals = Signals::new([SIGQUIT, SIGTERM, SIGINT])?;
    let c = control.clone();
    tokio::spawn(async move {
        while let Some(sig) = signals.next().await {
            if c.quit.is_cancelled() {
                warn!(
                    signal = sig,
                    "second stop signal: stopping the running job now"
                );
                c.kill.cancel();
            } else {
                info!(
                    signal = sig,
                    "stop signal: finishing the running job, reserving nothing new"
                );
                c.quit.cancel();
            }
        }
    });
    Ok(control)
}
