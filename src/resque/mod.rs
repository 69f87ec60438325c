//! Resque's Redis wire format: key names, payloads, the worker registry, failure records, time
//! formats and queue patterns. No locketd policy lives here.

pub mod failure;
pub mod keys;
pub mod patterns;
pub mod payload;
pub mod time;
