//! `pdserve bench` on the CPU with the tiny synthetic model: the tables have every row
//! asked for, with finite positive figures; the peer column appears with a peer file.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::Command;

fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_pdserve"));
    c.env("RUST_LOG", "warn");
    c
}

fn run(args: &[&str]) -> String {
    let out = bin().args(args).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "pdserve {args:?} failed\nstdout:\n{stdout}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// Stderr of a run that must fail (and not by a panic).
fn run_err(args: &[&str]) -> String {
    let out = bin().args(args).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "pdserve {args:?} succeeded");
    assert!(!stderr.contains("panicked"), "{stderr}");
    stderr
}

/// Table rows (after the header and rule) as cells, with the header.
fn table(out: &str, first_header: &str) -> (Vec<String>, Vec<Vec<String>>) {
    let lines: Vec<&str> = out
        .lines()
        .skip_while(|l| {
            !l.starts_with(&format!("| {first_header}"))
                && !l
                    .trim_start_matches('|')
                    .trim_start()
                    .starts_with(first_header)
        })
        .take_while(|l| l.starts_with('|'))
        .collect();
    assert!(
        lines.len() >= 2,
        "no table starting with {first_header}:\n{out}"
    );
    let cells = |l: &str| -> Vec<String> {
        l.trim_matches('|')
            .split('|')
            .map(|c| c.trim().to_string())
            .collect()
    };
    (
        cells(lines[0]),
        lines[2..].iter().map(|l| cells(l)).collect(),
    )
}

fn positive(cell: &str) -> f64 {
    let v: f64 = cell
        .parse()
        .unwrap_or_else(|_| panic!("not a number: {cell}"));
    assert!(v.is_finite() && v > 0.0, "{cell}");
    v
}

const TINY: &[&str] = &[
    "--device",
    "cpu",
    "--tiny",
    "--layers",
    "4",
    "--experts",
    "4",
];

#[test]
fn bench_decode_table_on_cpu() {
    let mut args = vec!["bench", "decode"];
    args.extend(TINY);
    args.extend([
        "--batch",
        "1,3",
        "--context",
        "20,70",
        "--graph",
        "capture,eager",
    ]);
    args.extend(["--steps", "2", "--warmup", "1", "--json"]);
    let json_path = Path::new(env!("CARGO_TARGET_TMPDIR")).join("bench-decode.json");
    args.push(json_path.to_str().unwrap());
    let out = run(&args);
    let j: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json_path).unwrap()).unwrap();
    assert_eq!(j["rows"].as_array().unwrap().len(), 8);
    assert!(j["memory_bandwidth_bytes_per_s"].as_f64().unwrap() > 0.0);
    // No graph comparison on the CPU (graphs are not applied there).
    assert!(!out.contains("CUDA graphs against eager"), "{out}");
    assert!(out.contains("memory bandwidth:"), "{out}");
    assert!(out.contains("weights:"), "{out}");
    // The canary's page pass covers the pool's pages once (one checksum per section of a
    // page): "KV pool: S sequences x P pages of B B ...".
    let pool: Vec<f64> = out
        .lines()
        .find_map(|l| l.strip_prefix("KV pool: "))
        .unwrap()
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .take(3)
        .collect();
    assert_eq!(
        j["kv_canary"]["page_bytes"].as_f64().unwrap(),
        pool[0] * pool[1] * pool[2],
        "{out}"
    );
    // Device sampling (the default) is checked against the host on the first warmup step.
    assert!(
        out.contains("sampling: greedy tokens from the backend (--sample device), checked"),
        "{out}"
    );
    let (head, rows) = table(&out, "batch");
    assert_eq!(rows.len(), 2 * 2 * 2, "{out}");
    let col = |name: &str| head.iter().position(|h| h == name).unwrap();
    let mut seen = Vec::new();
    for r in &rows {
        seen.push((r[col("batch")].clone(), r[col("context")].clone()));
        for c in [
            "ms/step",
            "host ms",
            "tok/s",
            "experts/layer",
            "weights MB",
            "KV MB",
            "floor ms",
            "x floor",
        ] {
            positive(&r[col(c)]);
        }
        assert_eq!(r[col("finite")], "yes");
        let mode = &r[col("mode")];
        assert!(
            mode == "eager" || mode == "eager (cpu has no graphs)",
            "{mode}"
        );
        // tok/s = batch / (ms/step).
        let b: f64 = r[col("batch")].parse().unwrap();
        let ms = positive(&r[col("ms/step")]);
        // The CPU computes on the host: a step is all host time (medians of the same steps).
        assert!(positive(&r[col("host ms")]) <= ms * 1.05, "{r:?}");
        // Nor does it record a dry pass or submit launches: those columns are the GPU's.
        for c in ["dry ms", "submit ms"] {
            assert_eq!(r[col(c)].parse::<f64>().unwrap(), 0.0, "{c}: {r:?}");
        }
        let tps = positive(&r[col("tok/s")]);
        assert!((tps * ms / 1e3 / b - 1.0).abs() < 0.02, "{r:?}");
        // Experts per layer never exceed E = 4 nor batch * top_k.
        let e: f64 = r[col("experts/layer")].parse().unwrap();
        assert!(e <= 4.0 && e <= b * 2.0, "{r:?}");
    }
    for want in [("1", "20"), ("3", "20"), ("1", "70"), ("3", "70")] {
        assert!(
            seen.contains(&(want.0.into(), want.1.into())),
            "{want:?} missing:\n{out}"
        );
    }
    // More context reads more KV at the same batch.
    let kv = |b: &str, c: &str| -> f64 {
        let r = rows
            .iter()
            .find(|r| r[col("batch")] == b && r[col("context")] == c)
            .unwrap();
        positive(&r[col("KV MB")])
    };
    assert!(kv("1", "70") > kv("1", "20"));
    assert!(kv("3", "20") > kv("1", "20"));
}

/// `--numerics deepseek` reaches the forward: the stored-format model prefills under it
/// (FP8 activations, fp8 KV, the indexer rotated) with finite logits and says so.
#[test]
fn bench_prefill_under_deepseek_numerics_on_cpu() {
    let mut args = vec!["bench", "prefill"];
    args.extend(TINY);
    args.extend([
        "--weights",
        "fp8-fp4",
        "--numerics",
        "deepseek",
        "--kv-dtype",
        "fp8",
        "--tokens",
        "24",
        "--repeats",
        "1",
        "--warmup",
        "0",
    ]);
    let out = run(&args);
    assert!(out.contains("numerics deepseek"), "{out}");
    let (head, rows) = table(&out, "tokens");
    let col = |name: &str| head.iter().position(|h| h == name).unwrap();
    assert_eq!(rows.len(), 1, "{out}");
    assert_eq!(rows[0][col("finite")], "yes", "{out}");
    // The mode needs fp8 KV entries: refused by name without them.
    let mut args = vec!["bench", "prefill"];
    args.extend(TINY);
    args.extend(["--numerics", "deepseek", "--tokens", "8"]);
    let err = run_err(&args);
    assert!(err.contains("kv_dtype"), "{err}");
}

#[test]
fn bench_prefill_table_on_cpu_with_peer() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("bench-peer");
    std::fs::create_dir_all(&dir).unwrap();
    let mut args = vec!["bench", "config"];
    args.extend(TINY);
    let config: serde_json::Value = serde_json::from_str(&run(&args)).unwrap();
    assert_eq!(config["num_hidden_layers"], 4);
    assert_eq!(config["n_routed_experts"], 4);
    let peer = serde_json::json!({
        "label": "test peer",
        "config": config,
        "prefill": [{"tokens": 16, "seconds": 100.0}],
        "decode": [],
    });
    let peer_path = dir.join("peer.json");
    std::fs::write(&peer_path, peer.to_string()).unwrap();

    let mut args = vec!["bench", "prefill"];
    args.extend(TINY);
    args.extend([
        "--tokens",
        "16,40",
        "--repeats",
        "1",
        "--warmup",
        "0",
        "--peer",
    ]);
    args.push(peer_path.to_str().unwrap());
    let out = run(&args);
    assert!(out.contains("GEMM rate:"), "{out}");
    assert!(out.contains("peer: test peer"), "{out}");
    let (head, rows) = table(&out, "tokens");
    let col = |name: &str| head.iter().position(|h| h == name).unwrap();
    assert_eq!(rows.len(), 2, "{out}");
    assert_eq!(rows[0][col("tokens")], "16");
    assert_eq!(rows[1][col("tokens")], "40");
    for r in &rows {
        for c in ["seconds", "tok/s", "GFLOP/token", "TFLOP/s", "x GEMM rate"] {
            positive(&r[col(c)]);
        }
        assert_eq!(r[col("finite")], "yes");
    }
    // Peer row for 16 tokens only: 100 s against ours.
    assert_eq!(positive(&rows[0][col("peer s")]), 100.0);
    assert!(positive(&rows[0][col("speed-up vs peer")]) > 1.0);
    assert_eq!(rows[1][col("peer s")], "-");

    // A peer file for another model is refused, naming the field.
    let mut other = peer.clone();
    other["config"]["n_routed_experts"] = 8.into();
    std::fs::write(&peer_path, other.to_string()).unwrap();
    let mut args = vec!["bench", "prefill"];
    args.extend(TINY);
    args.extend(["--tokens", "16", "--repeats", "1", "--peer"]);
    args.push(peer_path.to_str().unwrap());
    let o = bin().args(&args).output().unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("n_routed_experts"), "{err}");
}

/// `bench prefill` on the tiny CPU model with `extra` flags, one timed repeat and no warm-up: its
/// output and the table's header and rows.
fn tiny_prefill_table(extra: &[&str]) -> (String, Vec<String>, Vec<Vec<String>>) {
    let mut args = vec!["bench", "prefill"];
    args.extend(TINY);
    args.extend(extra);
    args.extend(["--repeats", "1", "--warmup", "0"]);
    let out = run(&args);
    let (head, rows) = table(&out, "tokens");
    (out, head, rows)
}

/// `--chunk`: each prompt as forwards of at most that many tokens (the last one shorter),
/// the table saying so; a prompt shorter than the chunk runs whole.
#[test]
fn bench_prefill_in_chunks_on_cpu() {
    let (out, head, rows) = tiny_prefill_table(&["--tokens", "8,40", "--chunk", "16"]);
    let col = |name: &str| head.iter().position(|h| h == name).unwrap();
    assert!(!head.iter().any(|h| h == "cuts"), "{out}");
    assert_eq!(rows.len(), 2, "{out}");
    assert_eq!(rows[0][col("chunk")], "8", "{out}");
    assert_eq!(rows[1][col("chunk")], "16", "{out}");
    for r in &rows {
        positive(&r[col("seconds")]);
        assert_eq!(r[col("finite")], "yes");
    }
}

/// `--cut-every`: the prefix cache's cuts inside each forward, their states read back;
/// the table gains the cut columns (without the flag it has none).
#[test]
fn bench_prefill_with_cuts_on_cpu() {
    let (out, head, rows) =
        tiny_prefill_table(&["--tokens", "64", "--chunk", "32", "--cut-every", "8"]);
    let col = |name: &str| head.iter().position(|h| h == name).unwrap();
    assert_eq!(rows.len(), 1, "{out}");
    let r = &rows[0];
    assert_eq!(r[col("cut every")], "8", "{out}");
    // At most the 7 multiples of 8 inside the two forwards of 32 (0..32 and 32..64, each
    // cut at least the longest ring's rows past its forward's start), at least one.
    let cuts: usize = r[col("cuts")].parse().unwrap();
    assert!((1..=6).contains(&cuts), "{out}");
    positive(&r[col("read-back ms")]);
    assert_eq!(r[col("finite")], "yes");
}

#[test]
fn bench_without_cuda_fails_clearly() {
    if pdserve_kernels::device::driver_present() {
        eprintln!("SKIPPED: CUDA driver present");
        return;
    }
    let o = bin()
        .args([
            "bench", "prefill", "--device", "cuda:0", "--tiny", "--tokens", "8",
        ])
        .output()
        .unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("--device cuda:0") && err.contains("libcuda"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

/// Every `<text>` of an SVG, trimmed (the document must parse).
fn svg_texts(path: &Path) -> Vec<String> {
    let svg = std::fs::read_to_string(path).unwrap();
    let doc = roxmltree::Document::parse(&svg).unwrap();
    assert_eq!(doc.root_element().tag_name().name(), "svg");
    doc.descendants()
        .filter(|n| n.has_tag_name("text"))
        .map(|n| n.text().unwrap_or("").trim().to_string())
        .collect()
}

/// Two formats in one run: every row labelled with its format, the peer's ratio where the
/// peer has the row and "-" where not, the figure naming every series, and `bench plot`
/// redrawing the same figure from the --json file.
#[test]
fn bench_decode_over_formats_with_peer_and_plot() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("bench-decode-plot");
    std::fs::create_dir_all(&dir).unwrap();
    let mut args = vec!["bench", "config"];
    args.extend(TINY);
    let config: serde_json::Value = serde_json::from_str(&run(&args)).unwrap();
    let peer = serde_json::json!({
        "label": "test peer",
        "config": config,
        "decode": [{"batch": 1, "context": 20, "ms_per_step": 500.0},
                   {"batch": 3, "context": 20, "error": "OOM"}],
    });
    let (peer_path, json, svg, again) = (
        dir.join("peer.json"),
        dir.join("rows.json"),
        dir.join("decode.svg"),
        dir.join("again.svg"),
    );
    std::fs::write(&peer_path, peer.to_string()).unwrap();
    let mut args = vec!["bench", "decode"];
    args.extend(TINY);
    args.extend([
        "--weights",
        "bf16,fp8-fp4",
        "--batch",
        "1,3",
        "--context",
        "20",
    ]);
    args.extend(["--graph", "eager", "--steps", "1", "--warmup", "0"]);
    for (flag, p) in [("--peer", &peer_path), ("--json", &json), ("--plot", &svg)] {
        args.extend([flag, p.to_str().unwrap()]);
    }
    let out = run(&args);
    assert!(
        out.contains("weights: bf16,") && out.contains("weights: fp8-fp4,"),
        "{out}"
    );
    let (head, rows) = table(&out, "batch");
    let col = |name: &str| head.iter().position(|h| h == name).unwrap();
    let labels: Vec<(&str, &str)> = rows
        .iter()
        .map(|r| (r[col("weights")].as_str(), r[col("batch")].as_str()))
        .collect();
    assert_eq!(
        labels,
        [
            ("bf16", "1"),
            ("bf16", "3"),
            ("fp8-fp4", "1"),
            ("fp8-fp4", "3")
        ],
        "{out}"
    );
    for r in &rows {
        if r[col("batch")] == "1" {
            assert_eq!(positive(&r[col("peer ms")]), 500.0);
            let ms = positive(&r[col("ms/step")]);
            let ratio = positive(&r[col("speed-up vs peer")]);
            assert!((ratio * ms / 500.0 - 1.0).abs() < 0.02, "{r:?}");
        } else {
            assert_eq!(
                (
                    r[col("peer ms")].as_str(),
                    r[col("speed-up vs peer")].as_str()
                ),
                ("-", "-")
            );
        }
    }
    let j: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let formats: Vec<&str> = j["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["weights"].as_str().unwrap())
        .collect();
    assert_eq!(formats, ["bf16", "bf16", "fp8-fp4", "fp8-fp4"]);

    let t = svg_texts(&svg);
    for want in [
        "bf16 eager",
        "bf16 floor",
        "fp8-fp4 eager",
        "fp8-fp4 floor",
        "ms per decode step",
    ] {
        assert_eq!(t.iter().filter(|x| *x == want).count(), 1, "{want}: {t:?}");
    }
    assert!(
        t.iter().any(|x| x.starts_with("context 20; floor =")),
        "{t:?}"
    );
    run(&[
        "bench",
        "plot",
        "--json",
        json.to_str().unwrap(),
        "--out",
        again.to_str().unwrap(),
    ]);
    assert_eq!(
        std::fs::read_to_string(&again).unwrap(),
        std::fs::read_to_string(&svg).unwrap(),
        "bench plot redraws the run's own figure"
    );
    // A file that is neither bench's record is refused, naming the file.
    let o = bin()
        .args([
            "bench",
            "plot",
            "--json",
            peer_path.to_str().unwrap(),
            "--out",
        ])
        .arg(&again)
        .output()
        .unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("peer.json") && err.contains("not a `bench decode --json`"),
        "{err}"
    );
}

#[test]
fn bench_prefill_plot_draws_the_gemm_rate_and_redraws_from_json() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("bench-prefill-plot");
    std::fs::create_dir_all(&dir).unwrap();
    let (json, svg, again) = (
        dir.join("rows.json"),
        dir.join("p.svg"),
        dir.join("again.svg"),
    );
    let mut args = vec!["bench", "prefill"];
    args.extend(TINY);
    args.extend(["--tokens", "16,40", "--repeats", "1", "--warmup", "0"]);
    args.extend([
        "--json",
        json.to_str().unwrap(),
        "--plot",
        svg.to_str().unwrap(),
    ]);
    run(&args);
    let t = svg_texts(&svg);
    assert_eq!(
        t.iter().filter(|x| *x == "bf16 prefill").count(),
        1,
        "{t:?}"
    );
    assert!(t.iter().any(|x| x.starts_with("GEMM rate ")), "{t:?}");
    run(&[
        "bench",
        "plot",
        "--json",
        json.to_str().unwrap(),
        "--out",
        again.to_str().unwrap(),
    ]);
    assert_eq!(
        std::fs::read_to_string(&again).unwrap(),
        std::fs::read_to_string(&svg).unwrap()
    );
    // A --plot into a missing folder is refused before the run.
    let mut args = vec!["bench", "prefill"];
    args.extend(TINY);
    args.extend(["--tokens", "16", "--plot", "/nonexistent-dir/p.svg"]);
    let o = bin().args(&args).output().unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("--plot /nonexistent-dir/p.svg: folder /nonexistent-dir does not exist"),
        "{err}"
    );
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        !stdout.contains("GEMM rate"),
        "refused before measuring: {stdout}"
    );
}

/// `bench transfer` on the tiny layout: one row per size, rounded up to whole pages, the
/// payload counting pages + state slot + logits, a positive rate; a bad size is refused.
#[test]
fn bench_transfer_moves_page_sets_over_grpc() {
    let mut args = vec!["bench", "transfer"];
    args.extend(TINY);
    args.extend(["--sizes", "1K,256K", "--repeats", "1", "--warmup", "0"]);
    let out = run(&args);
    let (head, rows) = table(&out, "transport");
    let col = |name: &str| head.iter().position(|h| h == name).unwrap();
    assert_eq!(rows.len(), 2, "{out}");
    let pages: Vec<usize> = rows
        .iter()
        .map(|r| r[col("pages")].parse().unwrap())
        .collect();
    assert_eq!(pages[0], 1, "1 KiB rounds up to one page: {out}");
    assert!(pages[1] > pages[0], "{out}");
    for r in &rows {
        assert_eq!(r[col("transport")], "grpc");
        positive(&r[col("GB/s")]);
        positive(&r[col("MB")]);
    }
    let o = bin()
        .args(["bench", "transfer", "--tiny", "--sizes", "12Q"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("--sizes") && err.contains("12Q"), "{err}");
}
