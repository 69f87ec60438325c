//! The single integration-test binary of locketd.
//!
//! Every test module lives below this file; shared helpers live in
//! `support` (real `redis-server` instances, the real `locketd` binary,
//! node-resque interop, bounded waits).

mod adapter_threads;
mod adapters;
mod admin;
mod bench;
mod builtin;
mod cancel;
mod compat;
mod counts;
mod daemon;
mod docs;
mod first_run;
mod harness;
mod holds;
mod liveness;
mod lock;
mod logs;
mod node_interop;
mod operate;
mod ops;
mod package;
mod parked;
mod persistent;
mod pickup;
mod policies;
mod push;
mod push_at;
mod rates;
mod redis_url;
mod reference;
mod refusals;
mod render;
mod replies;
mod ruby_shim;
mod s6_sweep;
mod scheduler;
mod sentinel;
mod service;
mod shims;
mod stalled_log;
mod stories;
mod supervision;
mod support;
mod systemd_units;
mod take;
mod threaded_adapters;
mod threads;
mod threads_chaos;
mod threads_visible;
mod unique;
mod unique_chaos;
mod web;
mod why;
