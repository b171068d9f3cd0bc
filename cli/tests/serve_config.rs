//! Layered configuration of the server roles: defaults < file < env < flags, printed with
//! sources; flags whose machinery is missing are refused with a clear error.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use support::bin;

fn line<'a>(out: &'a str, key: &str) -> &'a str {
    out.lines()
        .find(|l| l.split_whitespace().next() == Some(key))
        .unwrap_or_else(|| panic!("no `{key}` in:\n{out}"))
}

#[test]
fn print_config_shows_each_layer() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("pd.toml");
    std::fs::write(
        &file,
        "max_batch = 8\nkv_pages = 100\nchunked_prefill_size = 64\n",
    )
    .unwrap();
    let out = bin()
        .args(["decode", "--print-config", "--config"])
        .arg(&file)
        .args(["--kv-pages", "200"])
        .env("PDSERVE_CHUNKED_PREFILL_SIZE", "32")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let s = String::from_utf8(out.stdout).unwrap();
    assert!(
        line(&s, "max_batch").contains("= 8") && line(&s, "max_batch").contains("# file"),
        "{s}"
    );
    assert!(
        line(&s, "kv_pages").contains("= 200")
            && line(&s, "kv_pages").contains("# flag --kv-pages"),
        "{s}"
    );
    assert!(
        line(&s, "chunked_prefill_size").contains("= 32")
            && line(&s, "chunked_prefill_size").contains("# env PDSERVE_CHUNKED_PREFILL_SIZE"),
        "{s}"
    );
    assert!(
        line(&s, "index_k_dtype").contains("= f32")
            && line(&s, "index_k_dtype").ends_with("# default"),
        "{s}"
    );
}

#[test]
fn missing_machinery_is_refused_not_ignored() {
    for (args, want) in [
        (vec!["--transfer", "nccl"], "--transfer nccl"),
        (vec!["--hicache-ratio", "0.5"], "--hicache-ratio"),
        (vec!["--cuda-graph", "capture"], "--cuda-graph capture"),
        (vec!["--device", "cuda:x"], "--device `cuda:x`"),
        (
            vec!["--device", "cuda:0", "--cuda-graph", "sometimes"],
            "--cuda-graph `sometimes`",
        ),
        (vec!["--index-k-dtype", "int3"], "--index-k-dtype"),
    ] {
        // --print-config prints, then validates: nothing starts even if a check were missing.
        let out = bin()
            .args(["decode", "--print-config"])
            .args(&args)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?} was accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want), "{args:?}: {err}");
    }
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("bad.toml");
    std::fs::write(&file, "max_bacth = 8\n").unwrap();
    let out = bin()
        .args(["prefill", "--print-config", "--config"])
        .arg(&file)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown key `max_bacth`"));
}

#[test]
fn a_cuda_worker_without_a_driver_fails_clearly() {
    if pdserve_kernels::device::driver_present() {
        eprintln!(
            "skipped: this machine has a CUDA driver (scripts/gpu-check.sh covers GPU workers)"
        );
        return;
    }
    let mut child = bin()
        .args(["decode", "--device", "cuda:0", "--listen", "127.0.0.1:0"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "decode --device cuda:0 kept running without a driver"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert!(!status.success());
    assert!(err.contains("cuda:0") && err.contains("libcuda"), "{err}");
}
