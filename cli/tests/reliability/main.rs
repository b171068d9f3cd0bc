//! The reliability and security suite: real `pdserve` processes (and hand-written rogue
//! peers) on loopback, each case bounded to seconds. Run it alone with
//! `cargo test -p pdserve --test reliability`.
//!
//! - `auth`: API and admin keys on the router (401s, constant-time checks, key rotation
//!   on SIGHUP, no key in logs or /config, no unauthenticated non-loopback listener).
//! - `rogue_prefill`: a lying or silent prefill peer against a decode server serving
//!   real traffic fails only its own requests, within its deadlines, in bounded memory.
//! - `cluster_token`: rogue gRPC clients and rogue workers without the cluster token are
//!   refused; members serve.
//! - `mutual_tls`: a cluster on mutual TLS serves; rogue gRPC clients (plain, no
//!   certificate, another CA's) and workers from another CA are refused; a decode server
//!   pulls only from the prefill address its router granted; bad TLS files fail at start.
//! - `slow_clients`: slowloris headers, idle keep-alives, stalled bodies, 429s past
//!   `--max-concurrent-requests`, refused fields, 2 MB prompts beside normal traffic.
//! - `migration`: a decode server SIGKILLed mid-stream; the router continues the stream on
//!   another pair and the client's text (greedy, seeded) equals the unbroken reference.
//! - `role_faults`: kill, stop and restart of each role (prefill, decode, router) with
//!   requests in flight: full outputs or clear errors, nothing hangs, pages freed.
//! - `stress`: 32 concurrent multi-turn sessions, exact against the reference, every page
//!   back at the end.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../support/mod.rs"]
mod support;

mod auth;
mod cluster_token;
mod migration;
mod mutual_tls;
mod pd;
mod rogue_prefill;
mod role_faults;
mod slow_clients;
mod stress;
