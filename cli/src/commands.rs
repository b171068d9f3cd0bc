//! The `generate` and `logits` commands.

use crate::model_args::{parse_tokens, Loaded, ModelArgs, OnEngine};
use anyhow::{bail, Context, Result};
use pdserve_engine::backend::Backend;
use pdserve_engine::generate::{generate as run_generate, logits_prefill_decode, GenerateRequest};
use pdserve_engine::sampling::SamplingParams;
use pdserve_tokenizer::Tokenizer;
use std::io::Write;
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt text (needs the model's tokenizer.json).
    #[arg(long, conflicts_with = "tokens")]
    prompt: Option<String>,
    /// Prompt as comma-separated token ids.
    #[arg(long)]
    tokens: Option<String>,
    #[arg(long, default_value_t = 32)]
    max_new_tokens: usize,
    /// 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// 0 disables.
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Do not stop at the model's end-of-sequence token(s).
    #[arg(long)]
    ignore_eos: bool,
    /// Print one JSON object with text, token ids and finish reason instead of streaming text.
    #[arg(long)]
    json: bool,
}

const DEFAULT_PROMPT: &str = "The quick brown fox";

/// Prints the completion as it grows, holding back an incomplete UTF-8 character.
struct TextStream<'a> {
    tok: &'a Tokenizer,
    ids: Vec<u32>,
    printed: usize,
}

impl TextStream<'_> {
    fn push(&mut self, id: u32) -> Result<()> {
        self.ids.push(id);
        let text = self.tok.decode(&self.ids)?;
        if text.ends_with('\u{FFFD}')
            || text.len() < self.printed
            || !text.is_char_boundary(self.printed)
        {
            return Ok(());
        }
        let mut out = std::io::stdout().lock();
        out.write_all(&text.as_bytes()[self.printed..])?;
        out.flush()?;
        self.printed = text.len();
        Ok(())
    }

    fn finish(&mut self) -> Result<()> {
        let text = self.tok.decode(&self.ids)?;
        let mut out = std::io::stdout().lock();
        if text.len() > self.printed && text.is_char_boundary(self.printed) {
            out.write_all(&text.as_bytes()[self.printed..])?;
        }
        out.write_all(b"\n")?;
        Ok(())
    }
}

pub fn generate(a: GenerateArgs) -> Result<()> {
    let model = a.model.clone();
    model.run(a)
}

impl OnEngine for GenerateArgs {
    fn run<B: Backend>(self, loaded: Loaded<B>) -> Result<()> {
        generate_on(self, loaded)
    }
}

fn generate_on<B: Backend>(a: GenerateArgs, loaded: Loaded<B>) -> Result<()> {
    let mut engine = loaded.engine;
    let tok = loaded.tokenizer.as_ref();
    let prompt = match (&a.tokens, &a.prompt, tok) {
        (Some(t), _, _) => parse_tokens(t)?,
        (None, Some(p), Some(tok)) => tok.encode(p)?,
        (None, None, Some(tok)) => {
            tracing::info!(
                prompt = DEFAULT_PROMPT,
                "no --prompt given, using the default prompt"
            );
            tok.encode(DEFAULT_PROMPT)?
        }
        (None, _, None) => bail!(
            "{} has no tokenizer.json: pass --tokens",
            loaded.dir.display()
        ),
    };
    if prompt.is_empty() {
        bail!("the prompt is empty");
    }
    let stop_tokens = if a.ignore_eos {
        Vec::new()
    } else {
        engine.config().eos_token_ids.clone()
    };
    let req = GenerateRequest {
        prompt,
        max_new_tokens: a.max_new_tokens,
        sampling: SamplingParams {
            temperature: a.temperature,
            top_p: a.top_p,
            top_k: a.top_k,
            seed: a.seed,
            ..SamplingParams::default()
        },
        stop_tokens,
        chunk_size: a.model.chunked_prefill_size,
    };
    let t0 = std::time::Instant::now();
    let mut stream = match (tok, a.json) {
        (Some(tok), false) => Some(TextStream {
            tok,
            ids: Vec::new(),
            printed: 0,
        }),
        _ => None,
    };
    let mut stream_err = None;
    let gen = run_generate(&mut engine, &req, |id| {
        if let Some(s) = stream.as_mut() {
            if let Err(e) = s.push(id) {
                stream_err.get_or_insert(e);
            }
        }
    })?;
    if let Some(e) = stream_err {
        return Err(e);
    }
    let secs = t0.elapsed().as_secs_f64();
    tracing::info!(
        prompt_tokens = req.prompt.len(),
        new_tokens = gen.tokens.len(),
        finish = ?gen.finish,
        tokens_per_s = gen.tokens.len() as f64 / secs.max(1e-9),
        "done"
    );
    if let Some(s) = stream.as_mut() {
        return s.finish();
    }
    if a.json {
        let text = tok.map(|t| t.decode(&gen.tokens)).transpose()?;
        let v = serde_json::json!({
            "text": text,
            "tokens": gen.tokens,
            "prompt_tokens": req.prompt,
            "finish_reason": gen.finish,
        });
        println!("{v}");
    } else {
        let ids: Vec<String> = gen.tokens.iter().map(u32::to_string).collect();
        println!("{}", ids.join(","));
    }
    Ok(())
}

#[derive(clap::Args, Debug)]
pub struct LogitsArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Comma-separated token ids.
    #[arg(long)]
    tokens: String,
    /// Tokens fed by the prefill; the rest go through one-token decode steps.
    #[arg(long)]
    prefill_len: usize,
    /// Output JSON file: {"logits": [[f32; vocab]; n]}.
    #[arg(long)]
    out: PathBuf,
}

pub fn logits(a: LogitsArgs) -> Result<()> {
    let tokens = parse_tokens(&a.tokens)?;
    if tokens.is_empty() {
        bail!("--tokens is empty");
    }
    if a.prefill_len == 0 || a.prefill_len > tokens.len() {
        bail!(
            "--prefill-len {} must be between 1 and the number of tokens ({})",
            a.prefill_len,
            tokens.len()
        );
    }
    let model = a.model.clone();
    model.run(LogitsRun { a, tokens })
}

struct LogitsRun {
    a: LogitsArgs,
    tokens: Vec<u32>,
}

impl OnEngine for LogitsRun {
    fn run<B: Backend>(self, loaded: Loaded<B>) -> Result<()> {
        let LogitsRun { a, tokens } = self;
        logits_on(&a, &tokens, loaded)
    }
}

fn logits_on<B: Backend>(a: &LogitsArgs, tokens: &[u32], loaded: Loaded<B>) -> Result<()> {
    let mut engine = loaded.engine;
    let rows = logits_prefill_decode(
        &mut engine,
        tokens,
        a.prefill_len,
        a.model.chunked_prefill_size,
    )?;
    let file =
        std::fs::File::create(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let mut w = std::io::BufWriter::new(file);
    serde_json::to_writer(&mut w, &serde_json::json!({ "logits": rows }))?;
    w.flush()?;
    tracing::info!(rows = rows.len(), out = %a.out.display(), "logits written");
    Ok(())
}
