//! docs/flags.md is exactly what `pdserve flag-reference` generates from the CLI, and the
//! environment variables it lists are the ones the roles read.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use support::*;

const DOC: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/flags.md");

#[test]
fn the_committed_flag_reference_is_what_the_cli_generates() {
    let out = bin().arg("flag-reference").output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let generated = String::from_utf8(out.stdout).unwrap();
    let committed = std::fs::read_to_string(DOC).unwrap_or_default();
    if generated != committed && std::env::var_os("PDSERVE_BLESS").is_some() {
        std::fs::write(DOC, &generated).unwrap();
        return;
    }
    assert!(
        generated == committed,
        "docs/flags.md is stale: regenerate it with `pdserve flag-reference > docs/flags.md` (or PDSERVE_BLESS=1 cargo test -p pdserve --test flag_reference)"
    );
}

#[test]
fn environment_variables_from_the_reference_reach_the_config() {
    let dir = tempfile::tempdir().unwrap();
    let toml = dir.path().join("decode.toml");
    std::fs::write(&toml, "kv_pages = 77\n").unwrap();
    let out = bin()
        .args(["decode", "--print-config"])
        .env("PDSERVE_CONFIG", &toml)
        .env("PDSERVE_METRICS_LISTEN", "127.0.0.1:9400")
        .env("PDSERVE_DRAIN_TIMEOUT_S", "45")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let line = |k: &str| {
        text.lines()
            .find(|l| l.starts_with(&format!("{k} ")))
            .unwrap_or_else(|| panic!("no {k} in {text}"))
            .to_string()
    };
    assert!(
        line("kv_pages").contains("77") && line("kv_pages").contains("file"),
        "{text}"
    );
    assert!(
        line("metrics_listen").contains("127.0.0.1:9400")
            && line("metrics_listen").contains("env PDSERVE_METRICS_LISTEN"),
        "{text}"
    );
    assert!(line("drain_timeout_s").contains("45"), "{text}");
}

#[test]
fn address_lists_come_from_the_environment_comma_separated() {
    let out = bin()
        .args(["router", "--print-config"])
        .env("PDSERVE_DECODE", "10.0.0.1:50062,10.0.0.2:50062")
        .env("PDSERVE_DISCOVER_PREFILL", "pdserve-prefill:50061")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains(r#"["10.0.0.1:50062","10.0.0.2:50062"]"#),
        "{text}"
    );
    assert!(text.contains(r#"["pdserve-prefill:50061"]"#), "{text}");
}
