//! Aligned Markdown tables (they paste into docs/performance.md as they are).

pub struct Table {
    pub headers: Vec<&'static str>,
    pub rows: Vec<Vec<String>>,
}

impl std::fmt::Display for Table {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut width: Vec<usize> = self.headers.iter().map(|h| h.len()).collect();
        for r in &self.rows {
            for (w, c) in width.iter_mut().zip(r) {
                *w = (*w).max(c.chars().count());
            }
        }
        let line = |f: &mut std::fmt::Formatter<'_>, cells: &[String]| -> std::fmt::Result {
            write!(f, "|")?;
            for (c, w) in cells.iter().zip(&width) {
                write!(f, " {c:>w$} |")?;
            }
            writeln!(f)
        };
        let heads: Vec<String> = self.headers.iter().map(|h| h.to_string()).collect();
        line(f, &heads)?;
        let rule: Vec<String> = width
            .iter()
            .map(|w| format!("{}:", "-".repeat(w - 1)))
            .collect();
        line(f, &rule)?;
        for r in &self.rows {
            line(f, r)?;
        }
        Ok(())
    }
}

/// A number with 3 significant figures (no exponent for the usual ranges).
pub fn num(v: f64) -> String {
    if !v.is_finite() {
        return format!("{v}");
    }
    let a = v.abs();
    if a >= 100.0 {
        format!("{v:.0}")
    } else if a >= 10.0 {
        format!("{v:.1}")
    } else if a >= 1.0 {
        format!("{v:.2}")
    } else if a >= 0.001 || a == 0.0 {
        format!("{v:.3}")
    } else {
        format!("{v:.2e}")
    }
}

pub fn mb(bytes: f64) -> String {
    num(bytes / 1e6)
}

/// Bytes with a decimal unit (GB, MB, kB, B).
pub fn size(bytes: f64) -> String {
    match bytes {
        b if b >= 1e9 => format!("{} GB", num(b / 1e9)),
        b if b >= 1e6 => format!("{} MB", num(b / 1e6)),
        b if b >= 1e3 => format!("{} kB", num(b / 1e3)),
        b => format!("{} B", num(b)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_align_and_numbers_round() {
        let t = Table {
            headers: vec!["batch", "ms/step"],
            rows: vec![vec!["1".into(), num(12.345)], vec!["128".into(), num(0.5)]],
        };
        let s = t.to_string();
        let lines: Vec<&str> = s.lines().collect();
        assert_eq!(lines.len(), 4);
        assert!(lines.iter().all(|l| l.len() == lines[0].len()), "{s}");
        assert_eq!(lines[0], "| batch | ms/step |");
        assert_eq!(lines[2], "|     1 |    12.3 |");
        assert_eq!(lines[3], "|   128 |   0.500 |");
        assert_eq!(num(1234.0), "1234");
        assert_eq!(num(0.0001234), "1.23e-4");
        assert_eq!(mb(2.5e6), "2.50");
        assert_eq!(size(12.9e9), "12.9 GB");
        assert_eq!(size(685e3), "685 kB");
    }
}
