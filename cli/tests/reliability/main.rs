//! The reliability and security suite: real `pdserve` processes (and hand-written rogue
//! peers) on loopback, each case bounded to seconds. Run it alone with
//! `cargo test -p pdserve --test reliability`.
//!
//! - `auth`: API and admin keys on the router (401s, constant-time checks, key rotation
//!   on SIGHUP, no key in logs or /config, no unauthenticated non-loopback listener).
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../support/mod.rs"]
mod support;

mod auth;
