//! The failing assertion, said again after the daemon logs a failing test prints.
//!
//! A test that fails while daemons run prints their logs as they drop (hundreds of lines), so
//! the panic message itself ends up far above the end of the output, which is the part CI
//! shows. A panic hook remembers each thread's message; the drops of [`Daemon`](super::Daemon)
//! and [`RedisServer`](super::RedisServer) repeat it after their logs.

use std::collections::HashMap;
use std::sync::{Mutex, Once};
use std::thread::ThreadId;

static INSTALL: Once = Once::new();
static MESSAGES: Mutex<Option<HashMap<ThreadId, String>>> = Mutex::new(None);

/// Installs the hook (once per test binary); the default hook still prints as before.
pub fn install() {
    INSTALL.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            previous(info);
            let payload = info.payload();
            let text = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "(a panic without a message)".to_string());
            let place = info
                .location()
                .map(|l| format!(" at {}:{}", l.file(), l.line()))
                .unwrap_or_default();
            if let Ok(mut m) = MESSAGES.lock() {
                m.get_or_insert_with(HashMap::new)
                    .insert(std::thread::current().id(), format!("{text}{place}"));
            }
        }));
    });
}

/// The message of this thread's panic, once the hook has seen one.
pub fn message() -> Option<String> {
    let m = MESSAGES.lock().ok()?;
    m.as_ref()?.get(&std::thread::current().id()).cloned()
}
