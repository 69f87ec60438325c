//! The single integration-test binary of locketd.
//!
//! Every test module lives below this file; shared helpers live in
//! `support` (real `redis-server` instances, the real `locketd` binary,
//! node-resque interop, bounded waits).

mod bench;
mod builtin;
mod compat;
mod daemon;
mod harness;
mod lock;
mod node_interop;
mod redis_url;
mod support;
