//! GPU-versus-CPU check on reference fixtures (`pdserve gpu-check`, scripts/gpu-check.sh):
//! prefill + decode logits of the CUDA backend against the fp32 CPU engine, per-row
//! relative error and greedy tokens, plus a prefill-on-GPU / decode-on-CPU KV transfer.

use pdserve_engine::backend::Backend;
use pdserve_engine::generate::{generate, logits_prefill_decode, prefill, GenerateRequest};
use pdserve_engine::kv::{EntryDtype, KvLayoutSpec};
use pdserve_engine::sampling::SamplingParams;
use pdserve_engine::{CpuBackend, Engine, ForwardItem, Logits, PoolSize, Sequence};
use pdserve_kernels::{CudaBackend, WeightDtype};
use pdserve_tokenizer::Tokenizer;
use std::path::{Path, PathBuf};

/// Per-row relative error bound of bf16-weight GPU logits against the fp32 CPU engine.
pub const REL_TOL: f64 = 2e-2;
/// The same bound with fp32 weights and GEMMs (only summation order differs).
pub const REL_TOL_F32: f64 = 1e-3;

/// A fixture that cannot be read.
#[derive(Debug, thiserror::Error)]
#[error("fixture {dir}: {detail}")]
pub struct FixtureError {
    pub dir: PathBuf,
    pub detail: String,
}

type AnyResult<T> = Result<T, Box<dyn std::error::Error>>;

/// One line of the table.
#[derive(Debug, Clone)]
pub struct CheckRow {
    pub name: String,
    pub rows: usize,
    pub max_rel_err: f64,
    /// Row of the largest error.
    pub worst_row: usize,
    pub greedy_same: usize,
    /// Rows whose greedy token differs only at a near-tie: the CPU logits of the two
    /// tokens are closer than twice that row's largest GPU-CPU logit difference.
    pub near_ties: usize,
    pub pass: bool,
    /// Counted as pass/fail; otherwise printed for information only.
    pub gate: bool,
}

impl std::fmt::Display for CheckRow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:<52} {:>5} {:>12.3e} {:>6} {:>9} {:>5} {}",
            self.name,
            self.rows,
            self.max_rel_err,
            self.worst_row,
            format!("{}/{}", self.greedy_same, self.rows),
            self.near_ties,
            match (self.gate, self.pass) {
                (false, _) => "info",
                (true, true) => "PASS",
                (true, false) => "FAIL",
            }
        )
    }
}

pub fn header() -> String {
    format!(
        "{:<52} {:>5} {:>12} {:>6} {:>9} {:>5} result",
        "check", "rows", "max rel err", "at row", "greedy", "ties"
    )
}

pub(crate) struct Fixture {
    pub(crate) tokens: Vec<u32>,
    prefill_lens: Vec<usize>,
}

pub(crate) fn load_fixture(dir: &Path) -> Result<Fixture, FixtureError> {
    let fx_err = |detail: String| FixtureError {
        dir: dir.to_path_buf(),
        detail,
    };
    let bytes =
        std::fs::read(dir.join("expected.safetensors")).map_err(|e| fx_err(e.to_string()))?;
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| fx_err(e.to_string()))?;
    let toks = st.tensor("tokens").map_err(|e| fx_err(e.to_string()))?;
    let tokens = toks
        .data()
        .chunks_exact(8)
        .map(|c| {
            let mut b = [0u8; 8];
            b.copy_from_slice(c);
            i64::from_le_bytes(b) as u32
        })
        .collect();
    let meta: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("meta.json")).map_err(|e| fx_err(e.to_string()))?,
    )
    .map_err(|e| fx_err(e.to_string()))?;
    let prefill_lens = meta["prefill_lens"]
        .as_array()
        .ok_or_else(|| fx_err("meta.json has no prefill_lens".into()))?
        .iter()
        .filter_map(|v| v.as_u64().map(|v| v as usize))
        .collect();
    Ok(Fixture {
        tokens,
        prefill_lens,
    })
}

fn spec(dir: &Path, kv: EntryDtype) -> AnyResult<KvLayoutSpec> {
    let cfg = pdserve_engine::config::ModelConfig::from_model_dir(dir)?;
    let mut s = KvLayoutSpec::default_for(&cfg);
    s.kv_dtype = kv;
    s.index_k_dtype = kv;
    Ok(s)
}

const POOL: PoolSize = PoolSize {
    pages: 64,
    states: 8,
};

pub(crate) fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    let num: f64 = got
        .iter()
        .zip(want)
        .map(|(a, b)| ((a - b) as f64).powi(2))
        .sum();
    let den: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

pub(crate) fn argmax(v: &[f32]) -> usize {
    v.iter()
        .enumerate()
        .fold(0, |b, (i, x)| if *x > v[b] { i } else { b })
}

pub(crate) fn compare(name: String, got: &[Vec<f32>], want: &[Vec<f32>], tol: f64) -> CheckRow {
    let (max_rel_err, worst_row) = got
        .iter()
        .zip(want)
        .map(|(g, w)| rel_err(g, w))
        .enumerate()
        .fold((0.0, 0), |a, (i, e)| if e > a.0 { (e, i) } else { a });
    let greedy_same = got
        .iter()
        .zip(want)
        .filter(|(g, w)| argmax(g) == argmax(w))
        .count();
    let near_ties = got
        .iter()
        .zip(want)
        .filter(|(g, w)| {
            let (a, b) = (argmax(w), argmax(g));
            let diff = g
                .iter()
                .zip(w.iter())
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max);
            a != b && w[a] - w[b] <= 2.0 * diff
        })
        .count();
    let rows = want.len();
    CheckRow {
        name,
        rows,
        max_rel_err,
        worst_row,
        greedy_same,
        near_ties,
        pass: got.len() == rows && max_rel_err < tol && greedy_same + near_ties == rows,
        gate: true,
    }
}

/// Prefill `k` tokens on `a`, move the sequence's KV to `b`, decode the rest there.
fn transfer_logits<A: Backend, B: Backend>(
    a: &mut Engine<A>,
    b: &mut Engine<B>,
    tokens: &[u32],
    k: usize,
) -> AnyResult<Vec<Vec<f32>>> {
    let mut seq = a.new_sequence()?;
    let mut rows = prefill(a, &mut seq, &tokens[..k], 0, Logits::All)?;
    let snap = a.export_sequence(&seq)?;
    a.release(seq)?;
    let mut seq = b.import_sequence(&snap)?;
    for t in &tokens[k..] {
        let out = b.forward(&mut [ForwardItem {
            seq: &mut seq,
            tokens: std::slice::from_ref(t),
            logits: Logits::Last,
        }])?;
        rows.extend(out.into_iter().map(|o| o.data));
    }
    b.release(seq)?;
    Ok(rows)
}

/// Run every check on fixture folder `dir` with CUDA device `ordinal`.
pub fn check_fixture(
    dir: &Path,
    ordinal: usize,
) -> Result<Vec<CheckRow>, Box<dyn std::error::Error>> {
    let fx = load_fixture(dir)?;
    let fname = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut out = Vec::new();
    for wd in [WeightDtype::F32, WeightDtype::Bf16] {
        let w = match wd {
            WeightDtype::F32 => "f32",
            WeightDtype::Bf16 => "bf16",
        };
        // fp32 weights: only summation order differs from the CPU engine, so the bound
        // is tight. bf16 weights on these fp32 random fixtures move indexer scores by
        // more than their smallest top-k margins (meta.json min_topk_margin ~2e-4), so a
        // few rows pick other entries: reported for information.
        let gate = wd == WeightDtype::F32;
        for kv in [EntryDtype::F32, EntryDtype::Bf16] {
            if wd == WeightDtype::Bf16 && kv == EntryDtype::Bf16 {
                continue;
            }
            let tol = if kv == EntryDtype::F32 {
                REL_TOL_F32
            } else {
                REL_TOL
            };
            let s = spec(dir, kv)?;
            let mut cpu = Engine::load(dir, CpuBackend, Some(s), POOL)?;
            let gpu_b = CudaBackend::with_weights(ordinal, None, wd)?;
            let mut gpu = Engine::load(dir, gpu_b, Some(s), POOL)?;
            let tag = format!("{fname} w={w} kv={kv}");
            let lens: &[usize] = if gate && kv == EntryDtype::F32 {
                &fx.prefill_lens
            } else {
                &fx.prefill_lens[..1]
            };
            let mut push = |mut r: CheckRow| {
                r.gate = gate;
                out.push(r);
            };
            for &k in lens {
                let want = logits_prefill_decode(&mut cpu, &fx.tokens, k, 0)?;
                let got = logits_prefill_decode(&mut gpu, &fx.tokens, k, 0)?;
                push(compare(
                    format!("{tag} prefill {k} + decode"),
                    &got,
                    &want,
                    tol,
                ));
            }
            let k = fx.prefill_lens[fx.prefill_lens.len() / 2];
            let want = logits_prefill_decode(&mut cpu, &fx.tokens, k, 0)?;
            if gate && kv == EntryDtype::F32 {
                let chunked = logits_prefill_decode(&mut gpu, &fx.tokens, k, 7)?;
                push(compare(
                    format!("{tag} prefill {k} chunks of 7"),
                    &chunked,
                    &want,
                    tol,
                ));
            }
            let moved = transfer_logits(&mut gpu, &mut cpu, &fx.tokens, k)?;
            push(compare(
                format!("{tag} prefill {k} GPU, decode CPU"),
                &moved,
                &want,
                tol,
            ));
        }
    }
    let fp8 = EntryDtype::Fp8E4m3;
    for (kv, ik) in [(EntryDtype::F32, fp8), (fp8, EntryDtype::F32), (fp8, fp8)] {
        out.extend(fp8_rows(dir, &fname, &fx, ordinal, kv, ik)?);
    }
    Ok(out)
}

/// fp8 entries on the GPU against the CPU engine with the same layout: index-K (e4m3 + one
/// f32 scale per entry, `kv::fp8`) and compressed KV / window (FlashMLA's V4 entry,
/// `kv::fp8_kv`). Both backends quantize the same values the same way, so with fp32
/// weights only summation order differs (a value at a rounding boundary may take the
/// neighbouring code); pages move between the two unchanged.
fn fp8_rows(
    dir: &Path,
    fname: &str,
    fx: &Fixture,
    ordinal: usize,
    kv: EntryDtype,
    ik: EntryDtype,
) -> Result<Vec<CheckRow>, Box<dyn std::error::Error>> {
    let mut s = spec(dir, kv)?;
    s.index_k_dtype = ik;
    let mut cpu = Engine::load(dir, CpuBackend, Some(s), POOL)?;
    let gpu_b = CudaBackend::with_weights(ordinal, None, WeightDtype::F32)?;
    let mut gpu = Engine::load(dir, gpu_b, Some(s), POOL)?;
    let tag = format!("{fname} w=f32 kv={kv} ik={ik}");
    let mut out = Vec::new();
    for &k in &fx.prefill_lens[..2.min(fx.prefill_lens.len())] {
        let want = logits_prefill_decode(&mut cpu, &fx.tokens, k, 0)?;
        let got = logits_prefill_decode(&mut gpu, &fx.tokens, k, 0)?;
        out.push(compare(
            format!("{tag} prefill {k} + decode"),
            &got,
            &want,
            REL_TOL,
        ));
    }
    let k = fx.prefill_lens[fx.prefill_lens.len() / 2];
    let want = logits_prefill_decode(&mut cpu, &fx.tokens, k, 0)?;
    let moved = transfer_logits(&mut gpu, &mut cpu, &fx.tokens, k)?;
    out.push(compare(
        format!("{tag} prefill {k} GPU, decode CPU"),
        &moved,
        &want,
        REL_TOL,
    ));
    Ok(out)
}

pub(crate) const PROMPTS: &[&str] = &[
    "The quick brown fox",
    "Once upon a time, in a small village by the sea, there lived",
    "fn main() { println!(",
];

/// The embedded model (bf16 on disk, so bf16 storage is lossless): GPU logits against the
/// CPU engine over each prompt plus the CPU's greedy continuation, and the GPU's own
/// greedy generation against the CPU's.
pub fn check_embedded(ordinal: usize) -> Result<Vec<CheckRow>, Box<dyn std::error::Error>> {
    let dir = pdserve_engine::embedded::model_dir()?;
    let tok = Tokenizer::from_model_dir(&dir)?.ok_or("the embedded model has no tokenizer")?;
    let mut cpu = Engine::load(&dir, CpuBackend, None, POOL)?;
    let mut gpu = Engine::load(&dir, CudaBackend::new(ordinal, None)?, None, POOL)?;
    let gpu32_b = CudaBackend::with_weights(ordinal, None, WeightDtype::F32)?;
    let mut gpu32 = Engine::load(&dir, gpu32_b, None, POOL)?;
    let mut out = Vec::new();
    for (i, prompt) in PROMPTS.iter().enumerate() {
        let p = tok.encode(prompt)?;
        let req = GenerateRequest {
            prompt: p.clone(),
            max_new_tokens: 32,
            sampling: SamplingParams {
                temperature: 0.0,
                top_p: 1.0,
                top_k: 0,
                seed: 0,
                ..SamplingParams::default()
            },
            stop_tokens: Vec::new(),
            chunk_size: 0,
        };
        let cpu_gen = generate(&mut cpu, &req, |_| {})?;
        let mut all = p.clone();
        all.extend(&cpu_gen.tokens);
        let want = logits_prefill_decode(&mut cpu, &all, p.len(), 0)?;
        let got32 = logits_prefill_decode(&mut gpu32, &all, p.len(), 0)?;
        out.push(compare(
            format!("embedded w=f32 prompt {i} prefill {} + decode", p.len()),
            &got32,
            &want,
            REL_TOL_F32,
        ));
        let got = logits_prefill_decode(&mut gpu, &all, p.len(), 0)?;
        out.push(compare(
            format!("embedded w=bf16 prompt {i} prefill {} + decode", p.len()),
            &got,
            &want,
            REL_TOL,
        ));
        let gpu_gen = generate(&mut gpu, &req, |_| {})?;
        let same = gpu_gen
            .tokens
            .iter()
            .zip(&cpu_gen.tokens)
            .take_while(|(a, b)| a == b)
            .count();
        out.push(CheckRow {
            name: format!("embedded w=bf16 prompt {i} greedy generation"),
            rows: cpu_gen.tokens.len(),
            max_rel_err: 0.0,
            worst_row: same,
            greedy_same: same,
            near_ties: 0,
            pass: gpu_gen.tokens == cpu_gen.tokens,
            // Free-running: one near-tie flip changes every later token; the
            // teacher-forced row above is the gate.
            gate: false,
        });
    }
    out.push(audit_batched(&mut gpu, &tok)?);
    Ok(out)
}

/// `--kv-audit` on the GPU: every step checksums the pool and fails on any write outside
/// the step's expected pages/slots. 4 sequences, prefilled one by one, then 300 batched
/// greedy decode steps (pages are crossed and compressed entries written).
fn audit_batched<B: Backend>(gpu: &mut Engine<B>, tok: &Tokenizer) -> AnyResult<CheckRow> {
    gpu.set_kv_audit(true);
    let mut seqs = Vec::new();
    let mut next = Vec::new();
    for p in PROMPTS.iter().chain(["Hello"].iter()) {
        let ids = tok.encode(p)?;
        let mut seq = gpu.new_sequence()?;
        let rows = prefill(gpu, &mut seq, &ids, 0, Logits::Last)?;
        next.push(rows.last().map_or(0, |r| argmax(r) as u32));
        seqs.push(seq);
    }
    let steps = 300;
    let mut result = Ok(());
    for _ in 0..steps {
        let toks = next.clone();
        match decode_logits(gpu, &mut seqs, &toks) {
            Ok(outs) => {
                for (n, o) in next.iter_mut().zip(outs) {
                    *n = argmax(&o) as u32;
                }
            }
            Err(e) => {
                result = Err(e);
                break;
            }
        }
    }
    let same_sums = device_checksums_match(gpu)?;
    for seq in seqs {
        gpu.release(seq)?;
    }
    gpu.set_kv_audit(false);
    if let Err(e) = &result {
        eprintln!("audit: {e}");
    }
    if !same_sums {
        eprintln!("audit: device checksums differ from the host definition");
    }
    Ok(CheckRow {
        name: format!(
            "embedded w=bf16 --kv-audit, 4 seqs x {steps} batched steps, device checksums == host"
        ),
        rows: steps,
        max_rel_err: 0.0,
        worst_row: 0,
        greedy_same: 0,
        near_ties: 0,
        pass: result.is_ok() && same_sums,
        gate: true,
    })
}

/// The canary's device checksums of every page and state slot equal the host
/// definition (`kv::checksum`) over the same bytes copied out.
fn device_checksums_match<B: Backend>(e: &Engine<B>) -> AnyResult<bool> {
    use pdserve_engine::kv::checksum::section_checksums;
    let (b, pool) = (e.backend(), e.device_pool());
    let pages = b.page_checksums(pool.store())?;
    let states = b.state_checksums(pool.store())?;
    let mut host_pages = Vec::new();
    for p in 0..e.allocator().total_pages() {
        host_pages.extend(section_checksums(&pool.read_page(b, p as u32)?));
    }
    let mut host_states = Vec::new();
    for s in 0..e.allocator().total_states() {
        host_states.extend(section_checksums(&pool.read_state(b, s as u32)?));
    }
    Ok(pages == host_pages && states == host_states)
}

/// One decode step of every sequence in `seqs`, feeding `toks`; each row's logits.
pub(crate) fn decode_logits<'a, B: Backend>(
    e: &mut Engine<B>,
    seqs: impl IntoIterator<Item = &'a mut Sequence>,
    toks: &[u32],
) -> AnyResult<Vec<Vec<f32>>> {
    let mut items: Vec<ForwardItem<'_>> = seqs
        .into_iter()
        .zip(toks)
        .map(|(seq, t)| ForwardItem {
            seq,
            tokens: std::slice::from_ref(t),
            logits: Logits::Last,
        })
        .collect();
    Ok(e.forward(&mut items)?.into_iter().map(|t| t.data).collect())
}

/// A row passing only when `got` and `want` are non-empty and bitwise equal, with the
/// error figures of the other rows.
pub(crate) fn bitwise_row(name: &str, got: &[Vec<f32>], want: &[Vec<f32>]) -> CheckRow {
    let same =
        !got.is_empty() && got.len() == want.len() && got.iter().zip(want).all(|(g, w)| g == w);
    let mut row = compare(name.to_string(), got, want, REL_TOL);
    row.pass = same;
    row
}
