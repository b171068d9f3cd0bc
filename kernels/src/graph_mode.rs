//! How the CUDA backend runs decode steps.

/// `--cuda-graph`: decode steps replayed from captured CUDA graphs, or launched eagerly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GraphMode {
    /// One graph per batch-size bucket, captured on first use and replayed.
    #[default]
    Capture,
    /// The same kernels over the same padded batch, launched one by one.
    Eager,
}

impl std::str::FromStr for GraphMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "capture" => Ok(GraphMode::Capture),
            "eager" => Ok(GraphMode::Eager),
            other => Err(format!(
                "unknown CUDA graph mode `{other}` (expected capture or eager)"
            )),
        }
    }
}

impl std::fmt::Display for GraphMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            GraphMode::Capture => "capture",
            GraphMode::Eager => "eager",
        })
    }
}
