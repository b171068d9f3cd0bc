//! Reading Prometheus text exposition: series types and samples, for the tests that
//! scrape every process's `/metrics`.

use std::collections::BTreeMap;

/// One scrape: `# TYPE` of every family, and every sample line (name with labels, value).
pub struct Scrape {
    pub types: BTreeMap<String, String>,
    pub samples: Vec<(String, String, f64)>,
}

impl Scrape {
    pub fn parse(text: &str) -> Scrape {
        let mut types = BTreeMap::new();
        let mut samples = Vec::new();
        for l in text.lines() {
            if let Some(rest) = l.strip_prefix("# TYPE ") {
                let mut w = rest.split_whitespace();
                let (n, t) = (w.next().unwrap(), w.next().unwrap());
                types.insert(n.to_string(), t.to_string());
            } else if !l.starts_with('#') && !l.trim().is_empty() {
                let (series, value) = l.rsplit_once(' ').unwrap();
                let (name, labels) = match series.split_once('{') {
                    Some((n, rest)) => (n, rest.trim_end_matches('}')),
                    None => (series, ""),
                };
                samples.push((name.to_string(), labels.to_string(), value.parse().unwrap()));
            }
        }
        Scrape { types, samples }
    }

    /// The family a sample name belongs to (histogram `_bucket`/`_sum`/`_count` lines).
    pub fn family<'a>(&'a self, sample: &'a str) -> &'a str {
        if self.types.contains_key(sample) {
            return sample;
        }
        for suffix in ["_bucket", "_sum", "_count"] {
            if let Some(base) = sample.strip_suffix(suffix) {
                if self
                    .types
                    .get(base)
                    .is_some_and(|t| t == "histogram" || t == "summary")
                {
                    return base;
                }
            }
        }
        sample
    }

    /// The value of the first sample named `name` whose labels contain every `labels` part.
    pub fn value(&self, name: &str, labels: &[&str]) -> Option<f64> {
        self.samples
            .iter()
            .find(|(n, l, _)| n == name && labels.iter().all(|p| l.contains(p)))
            .map(|s| s.2)
    }

    /// Counters end in `_total`, nothing else does; every sample has a declared type.
    pub fn convention_errors(&self) -> Vec<String> {
        let mut errors = Vec::new();
        for (n, t) in &self.types {
            match (t.as_str(), n.ends_with("_total")) {
                ("counter", false) => errors.push(format!("counter {n} does not end in _total")),
                ("counter", true) => {}
                (_, true) => errors.push(format!("{t} {n} ends in _total")),
                _ => {}
            }
        }
        for (n, ..) in &self.samples {
            if !self.types.contains_key(self.family(n)) {
                errors.push(format!("sample {n} has no # TYPE"));
            }
        }
        errors
    }
}
