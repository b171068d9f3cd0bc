//! The deploy/ files: the systemd units pass `systemd-analyze verify` and, started exactly
//! as their `ExecStart=` lines say with the same environment files, serve a request; the
//! Kubernetes manifests validate against the Kubernetes schemas; the Containerfile passes
//! hadolint. The tools come from `.ci/run` (a venv named by `PDSERVE_DEPLOY_TOOLS`, and the
//! systemd package); without them a test fails under `CI=true` and is skipped otherwise.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;
use support::*;

fn deploy() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

/// `name` from `$PDSERVE_DEPLOY_TOOLS` or PATH; None (skip) outside CI, a failure in CI.
fn tool(name: &str) -> Option<PathBuf> {
    let from_env = std::env::var_os("PDSERVE_DEPLOY_TOOLS").map(|d| PathBuf::from(d).join(name));
    if let Some(p) = from_env.filter(|p| p.is_file()) {
        return Some(p);
    }
    let on_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join(name))
            .find(|p| p.is_file())
    });
    if on_path.is_none() {
        assert!(
            !std::env::var("CI").is_ok_and(|v| v == "true" || v == "1"),
            "{name} is not installed (.ci/run installs it)"
        );
        eprintln!("skipping: {name} is not installed (.ci/run installs it)");
    }
    on_path
}

const UNITS: [(&str, &str); 3] = [
    ("pdserve-prefill@.service", "pdserve-prefill@0.service"),
    ("pdserve-decode@.service", "pdserve-decode@1.service"),
    ("pdserve-router.service", "pdserve-router.service"),
];

#[test]
fn the_systemd_units_pass_systemd_analyze_verify() {
    let Some(analyze) = tool("systemd-analyze") else {
        return;
    };
    // A root holding the units where they are installed, the env files and a stand-in for
    // the binary (verify checks that ExecStart's command exists), over the host's units.
    let root = tempfile::tempdir().unwrap();
    let r = root.path();
    for d in [
        "etc/systemd/system",
        "etc/pdserve",
        "usr/local/bin",
        "usr/lib",
    ] {
        std::fs::create_dir_all(r.join(d)).unwrap();
    }
    std::os::unix::fs::symlink("/usr/lib/systemd", r.join("usr/lib/systemd")).unwrap();
    std::fs::copy(
        env!("CARGO_BIN_EXE_pdserve"),
        r.join("usr/local/bin/pdserve"),
    )
    .unwrap();
    for f in std::fs::read_dir(deploy().join("systemd")).unwrap() {
        let f = f.unwrap().path();
        let name = f.file_name().unwrap().to_str().unwrap().to_string();
        let dir = if name.ends_with(".service") {
            "etc/systemd/system"
        } else {
            "etc/pdserve"
        };
        std::fs::copy(&f, r.join(dir).join(&name)).unwrap();
    }
    let out = Command::new(analyze)
        .arg("verify")
        .arg(format!("--root={}", r.display()))
        .args(UNITS.map(|u| u.1))
        .current_dir(r.join("etc/systemd/system"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    // The host's own unit symlinks are reported as unresolvable inside the root: noise.
    let complaints: Vec<&str> = stderr
        .lines()
        .filter(|l| !l.starts_with("Failed to resolve symlink"))
        .collect();
    assert!(
        out.status.success() && complaints.is_empty(),
        "{}",
        complaints.join("\n")
    );
}

/// A unit's `[Service]` settings (repeated keys in order).
fn service_section(unit: &str) -> Vec<(String, String)> {
    let text = std::fs::read_to_string(deploy().join("systemd").join(unit)).unwrap();
    let mut in_service = false;
    let mut out = Vec::new();
    for l in text.lines().map(str::trim) {
        if l.starts_with('[') {
            in_service = l == "[Service]";
        } else if in_service && !l.starts_with('#') {
            if let Some((k, v)) = l.split_once('=') {
                out.push((k.to_string(), v.to_string()));
            }
        }
    }
    out
}

/// `KEY=value` lines of an environment file.
fn env_file(path: &Path) -> Vec<(String, String)> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| {
            let (k, v) = l.split_once('=').unwrap();
            (k.to_string(), v.to_string())
        })
        .collect()
}

/// A unit's processes as systemd would start them: `Environment=` then `EnvironmentFile=`
/// (which wins), `%i` replaced by the instance, `${VAR}` by the environment, installed
/// paths (`/etc/pdserve`, `/usr/local/bin/pdserve`, `/var/cache/pdserve`) mapped to this
/// checkout, the binary just built and a temporary folder.
struct Started {
    env: BTreeMap<String, String>,
    exec_start: Vec<String>,
    exec_start_post: Vec<String>,
}

fn as_systemd_starts(unit: &str, instance: &str, etc: &Path, cache: &Path) -> Started {
    let map = |s: &str| {
        s.replace("%i", instance)
            .replace("/etc/pdserve", etc.to_str().unwrap())
            .replace("/var/cache/pdserve", cache.to_str().unwrap())
            .replace("/usr/local/bin/pdserve", env!("CARGO_BIN_EXE_pdserve"))
    };
    let mut env = BTreeMap::new();
    let (mut exec_start, mut exec_start_post) = (None, None);
    for (k, v) in service_section(unit) {
        match k.as_str() {
            "Environment" => {
                let (name, value) = v.split_once('=').unwrap();
                env.insert(name.to_string(), map(value));
            }
            "EnvironmentFile" => {
                // Paths in the env files name the installed tree too.
                for (name, value) in env_file(Path::new(&map(&v))) {
                    env.insert(name, map(&value));
                }
            }
            "ExecStart" => exec_start = Some(v),
            "ExecStartPost" => exec_start_post = Some(v),
            _ => {}
        }
    }
    let argv = |line: Option<String>| -> Vec<String> {
        map(&line.unwrap())
            .split_whitespace()
            .map(
                |w| match w.strip_prefix("${").and_then(|w| w.strip_suffix('}')) {
                    Some(var) => env[var].clone(),
                    None => w.to_string(),
                },
            )
            .collect()
    };
    Started {
        exec_start: argv(exec_start),
        exec_start_post: argv(exec_start_post),
        env,
    }
}

fn command(argv: &[String], env: &BTreeMap<String, String>) -> Command {
    let mut c = bin();
    assert_eq!(argv[0], env!("CARGO_BIN_EXE_pdserve"));
    c.args(&argv[1..]).envs(env);
    c
}

#[test]
fn the_units_exec_start_lines_with_their_env_files_serve_a_request() {
    // /etc/pdserve as the deploy files install it; on this GPU-less machine the operator's
    // one change is the device (the units say cuda:<instance>).
    let etc = tempfile::tempdir().unwrap();
    let cache = tempfile::tempdir().unwrap();
    for f in ["pdserve.toml", "prefill.env", "decode.env", "router.env"] {
        let mut text = std::fs::read_to_string(deploy().join("systemd").join(f)).unwrap();
        if f == "prefill.env" || f == "decode.env" {
            text.push_str("PDSERVE_DEVICE=cpu\n");
        }
        std::fs::write(etc.path().join(f), text).unwrap();
    }
    // The secrets the env files name, as deploy/README.md has the operator create them.
    for (f, v) in [
        ("api-keys", "sk-deploy-test\n"),
        ("admin-keys", "admin-deploy-test\n"),
        ("cluster-token", "cluster-deploy-test\n"),
    ] {
        std::fs::write(etc.path().join(f), v).unwrap();
    }
    let mut procs = Vec::new();
    for (unit, instance) in [
        ("pdserve-prefill@.service", "0"),
        ("pdserve-decode@.service", "1"),
        ("pdserve-router.service", ""),
    ] {
        let s = as_systemd_starts(unit, instance, etc.path(), cache.path());
        let mut c = command(&s.exec_start, &s.env);
        // The cache the unit names, not the tests' shared one.
        c.env("PDSERVE_CACHE_DIR", &s.env["PDSERVE_CACHE_DIR"]);
        // Quieter than the env files' `info` in the test log.
        c.env("RUST_LOG", "warn");
        let mut main = Proc::start(c);
        // As systemd: the unit is started once ExecStartPost succeeds; it fails if the
        // main process dies first.
        let mut post = command(&s.exec_start_post, &s.env).spawn().unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(120);
        let ready = loop {
            if let Some(st) = post.try_wait().unwrap() {
                break st;
            }
            if let Some(st) = main.child.try_wait().unwrap() {
                let _ = post.kill();
                panic!("{unit}: the main process exited ({st}) before it was ready");
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{unit}: not ready in 120 s"
            );
            std::thread::sleep(Duration::from_millis(50));
        };
        assert!(ready.success(), "{unit}: ExecStartPost failed");
        procs.push(main);
    }
    let router = as_systemd_starts("pdserve-router.service", "", etc.path(), cache.path());
    let addr = router.env["PDSERVE_LISTEN"].replace("0.0.0.0", "127.0.0.1");
    let (st, _, v) = support::api::post(
        &addr,
        "/v1/completions",
        &greedy(&prompt(5, 16), 4),
        &[("Authorization", "Bearer sk-deploy-test")],
    );
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["choices"][0]["token_ids"].as_array().unwrap().len(), 4);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    let (st, _, body) = support::raw(
        &addr,
        "GET",
        "/workers",
        &[("Authorization", "Bearer admin-deploy-test")],
        b"",
        Duration::from_secs(5),
    );
    assert_eq!(st, 200);
    assert!(
        body.contains("127.0.0.1:7100") && body.contains("127.0.0.1:7201"),
        "{body}"
    );
    let decode = as_systemd_starts("pdserve-decode@.service", "1", etc.path(), cache.path());
    let side = decode.env["PDSERVE_METRICS_LISTEN"].replace("0.0.0.0", "127.0.0.1");
    assert_eq!(
        http(&side, "GET", "/ready", None, Duration::from_secs(5)).0,
        200
    );
}

#[test]
fn the_kubernetes_manifests_validate_against_the_kubernetes_schemas() {
    let Some(validate) = tool("kubernetes-validate") else {
        return;
    };
    let files: Vec<PathBuf> = std::fs::read_dir(deploy().join("k8s"))
        .unwrap()
        .map(|f| f.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    assert!(files.len() >= 4, "{files:?}");
    let out = Command::new(validate)
        .args(["--strict", "--kubernetes-version", "1.30.0"])
        .args(&files)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
    // A kind without a schema (a CRD) is only a warning there: refuse it here.
    assert!(!text.contains("WARN"), "{text}");
    for f in &files {
        let name = f.display().to_string();
        assert!(
            text.lines()
                .any(|l| l.contains(&name) && l.contains("passed")),
            "{name}: {text}"
        );
    }
}

#[test]
fn the_containerfile_passes_hadolint() {
    let Some(hadolint) = tool("hadolint") else {
        return;
    };
    let out = Command::new(hadolint)
        .arg(deploy().join("container/Containerfile"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
