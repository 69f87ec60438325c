//! `locketd failed`.
