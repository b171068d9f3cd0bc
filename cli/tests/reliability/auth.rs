//! API keys on the router, against a real router process (no workers are needed: every
//! refusal happens before routing).

use crate::support::api::start_logged;
use crate::support::*;
use serde_json::{json, Value};
use std::time::Duration;

const T: Duration = Duration::from_secs(10);
const API: &str = "sk-test-api-0123";
const ADMIN: &str = "adm-test-9876";

fn get(addr: &str, path: &str, key: Option<&str>) -> (u16, String, String) {
    let auth = key.map(|k| format!("Bearer {k}"));
    let headers: Vec<(&str, &str)> = auth.iter().map(|a| ("Authorization", a.as_str())).collect();
    raw(addr, "GET", path, &headers, b"", T)
}

fn post_completion(addr: &str, key: Option<&str>) -> (u16, String, String) {
    let auth = key.map(|k| format!("Bearer {k}"));
    let mut headers: Vec<(&str, &str)> = vec![("Content-Type", "application/json")];
    if let Some(a) = &auth {
        headers.push(("Authorization", a));
    }
    let body = json!({"prompt": "hello", "max_tokens": 2}).to_string();
    raw(
        addr,
        "POST",
        "/v1/completions",
        &headers,
        body.as_bytes(),
        T,
    )
}

fn assert_401(r: (u16, String, String), what: &str) {
    let (st, head, body) = r;
    assert_eq!(st, 401, "{what}: {body}");
    assert!(head.contains("www-authenticate: bearer"), "{what}: {head}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["error"]["code"], "invalid_api_key", "{what}: {body}");
    assert_eq!(
        v["error"]["type"], "invalid_request_error",
        "{what}: {body}"
    );
}

#[test]
fn api_and_admin_keys_guard_their_endpoints_and_never_leak() {
    let (_router, addr, log) = start_logged(
        "router",
        &[
            "--api-key",
            API,
            "--api-key",
            "sk-second-key",
            "--admin-key",
            ADMIN,
        ],
    );
    assert_401(post_completion(&addr, None), "no key");
    assert_401(
        post_completion(&addr, Some("sk-test-api-012")),
        "a prefix of the key",
    );
    assert_401(post_completion(&addr, Some(ADMIN)), "the admin key on /v1");
    assert_401(get(&addr, "/v1/models", None), "models without a key");
    // The right key gets past authentication: no workers, so the request is a 503.
    let (st, _, body) = post_completion(&addr, Some(API));
    assert_eq!(st, 503, "{body}");
    let (st, _, body) = post_completion(&addr, Some("sk-second-key"));
    assert_eq!(st, 503, "{body}");
    assert_eq!(get(&addr, "/v1/models", Some(API)).0, 200);

    assert_401(get(&addr, "/workers", None), "workers without a key");
    assert_401(
        get(&addr, "/workers", Some(API)),
        "workers with the API key",
    );
    assert_401(get(&addr, "/config", Some(API)), "config with the API key");
    let add = json!({"address": "127.0.0.1:1", "role": "decode"}).to_string();
    let (st, _, _) = raw(
        &addr,
        "POST",
        "/workers",
        &[
            ("Content-Type", "application/json"),
            ("Authorization", &format!("Bearer {API}")),
        ],
        add.as_bytes(),
        T,
    );
    assert_eq!(st, 401, "adding a worker needs the admin key");
    let (st, _, _) = raw(&addr, "DELETE", "/workers/127.0.0.1:1", &[], b"", T);
    assert_eq!(st, 401, "removing a worker needs the admin key");
    assert_eq!(get(&addr, "/workers", Some(ADMIN)).0, 200);

    let (st, _, config) = get(&addr, "/config", Some(ADMIN));
    assert_eq!(st, 200);
    assert!(!config.contains(API) && !config.contains(ADMIN), "{config}");
    assert!(config.contains("(2 redacted)"), "{config}");
    // Health and metrics stay open for load balancers and Prometheus.
    assert_ne!(get(&addr, "/health", None).0, 401);
    assert_eq!(get(&addr, "/metrics", None).0, 200);

    std::thread::sleep(Duration::from_millis(200));
    let log = log.lock().unwrap().join("\n");
    assert!(log.contains("not authenticated"), "refusals are logged");
    for k in [API, ADMIN, "sk-test-api-012", "sk-second-key"] {
        assert!(!log.contains(k), "the log shows a key: {log}");
    }
}

#[test]
fn api_keys_only_closes_the_admin_endpoints() {
    let mut c = bin();
    c.env("PDSERVE_API_KEY", format!("{API},sk-other"))
        .args(["router", "--listen", "127.0.0.1:0"]);
    let p = Proc::start(c);
    let addr = p
        .wait_line("listening on", 60)
        .rsplit(' ')
        .next()
        .unwrap()
        .to_string();
    assert_eq!(
        post_completion(&addr, Some("sk-other")).0,
        503,
        "PDSERVE_API_KEY is read"
    );
    assert_401(post_completion(&addr, Some("nope")), "wrong key");
    let (st, _, body) = get(&addr, "/workers", Some(API));
    assert_eq!(st, 401);
    assert!(body.contains("--admin-key"), "{body}");
}

#[test]
fn key_files_rotate_on_sighup() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("api-keys");
    std::fs::write(&f, "# clients\nsk-old\n").unwrap();
    let (router, addr) = role("router", &["--api-key-file", f.to_str().unwrap()]);
    assert_eq!(post_completion(&addr, Some("sk-old")).0, 503);
    assert_401(
        post_completion(&addr, Some("sk-new")),
        "new key before the reload",
    );
    // Rotation: both keys for a while, then only the new one.
    std::fs::write(&f, "sk-old\nsk-new\n").unwrap();
    hup(router.pid());
    wait_status(&addr, "sk-new", 503);
    assert_eq!(post_completion(&addr, Some("sk-old")).0, 503);
    std::fs::write(&f, "sk-new\n").unwrap();
    hup(router.pid());
    wait_status(&addr, "sk-old", 401);
    assert_eq!(post_completion(&addr, Some("sk-new")).0, 503);
    // A broken file on reload keeps the keys in force.
    std::fs::write(&f, "\n").unwrap();
    hup(router.pid());
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(post_completion(&addr, Some("sk-new")).0, 503);
}

fn hup(pid: u32) {
    let st = std::process::Command::new("kill")
        .args(["-HUP", &pid.to_string()])
        .status()
        .unwrap();
    assert!(st.success());
}

/// The status a completion with `key` gets settles on `want` within 5 s.
fn wait_status(addr: &str, key: &str, want: u16) {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let st = post_completion(addr, Some(key)).0;
        if st == want {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "still {st}, want {want}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn no_key_means_loopback_only() {
    let out = bin()
        .args(["router", "--listen", "0.0.0.0:0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("no API key is configured") && err.contains("--allow-unauthenticated"),
        "{err}"
    );
    // (`--allow-unauthenticated` is covered by auth::tests: serving unauthenticated on
    // every interface would expose the test machine.)
    let (_p, addr) = on_all_interfaces(&["--api-key", API]);
    assert_401(post_completion(&addr, None), "keyed on 0.0.0.0");
}

/// A router listening on 0.0.0.0 (port 0), and the loopback address to reach it at.
fn on_all_interfaces(args: &[&str]) -> (Proc, String) {
    let mut c = bin();
    c.args(["router", "--listen", "0.0.0.0:0"]).args(args);
    let p = Proc::start(c);
    let l = p.wait_line("listening on", 60);
    let port = l.rsplit(':').next().unwrap().to_string();
    (p, format!("127.0.0.1:{port}"))
}

#[test]
fn print_config_redacts_keys() {
    let out = bin()
        .args([
            "router",
            "--print-config",
            "--api-key",
            API,
            "--admin-key",
            ADMIN,
        ])
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!text.contains(API) && !text.contains(ADMIN), "{text}");
    assert!(
        text.contains("api_key") && text.contains("(1 redacted)"),
        "{text}"
    );
}
